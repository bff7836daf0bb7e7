"""Export a corpus case with each exporter and compare its step graphs with torch.

The checks, per case and exporter:
    grad:  every torch parameter's gradient from the step graph (``optimizer=None``), run in
           ORT CPU, within ``GRAD_TOL`` relative L2 of ``torch.autograd`` on the same weights
           and batch;
    adamw: the loss after 5 AdamW steps (and every loss on the way) within ``LOSS_TOL`` of
           ``torch.optim.AdamW`` with the same hyperparameters;
    lowp:  the emulated bf16 and fp16 step graphs' loss after 5 steps within ``LOWP_TOL`` of
           the fp32 step graph's.

Parameter names. The TorchScript exporter keeps parameter names as initializer names, except
that it deduplicates equal-valued initializers: a dropped parameter comes back as the output of
an ``Identity`` node named after it. The dynamo exporter pre-transposes weights and folds
constant expressions of parameters (BERT's token-type embedding becomes a gathered constant),
so it is given the parameters as explicit inputs through ``torch.func.functional_call`` (the
way DESIGN.md prescribes); the exported inputs carry the torch names and get the initial values
as initializers, which marks them as the parameters. Either way a torch parameter ``P`` is the
ONNX value ``P`` and its gradient is the step graph's output ``grad/P``; a torch parameter with
a gradient but no ``grad/P`` output is an error (``inf``).

BatchNorm: both exporters write inference-mode BatchNorm (TorchScript exports in eval mode; the
dynamo export is taken in eval mode too), and the step graph turns it into batch statistics
(``batchnorm="train"``, the default), which is what torch's train mode computes.
"""

from __future__ import annotations

import copy
import io
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import numpy_helper

from mpgraph.convert import convert
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner

from .models import Case

EXPORTERS = ("torchscript", "dynamo")
GRAD_TOL = 1e-4
GRAD_FLOOR = 1e-6
LOSS_TOL = 1e-4
LOWP_TOL = 1e-2
STEPS = 5
LR = 1e-3
ADAMW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


class ExportFailed(Exception):
    """torch could not export the case with this exporter (the case is skipped)."""


@dataclass
class Exported:
    case: Case
    exporter: str
    model: onnx.ModelProto
    loss: str
    seconds: float


@dataclass
class Result:
    """Measured numbers of one case and exporter (``None``: not measured)."""

    grad_errors: dict[str, GradError] = field(default_factory=dict)
    loss_error: LossError | None = None
    lowp_deltas: dict[str, float] = field(default_factory=dict)
    lowp_skipped: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def worst_grad(self) -> tuple[str, float]:
        """The parameter whose gradient is furthest from torch fp32's, and that error."""
        name = max(self.grad_errors, key=lambda k: self.grad_errors[k].vs_torch)
        return name, self.grad_errors[name].vs_torch

    @property
    def bad_grads(self) -> dict[str, GradError]:
        return {k: e for k, e in self.grad_errors.items() if not e.ok}


class Functional(torch.nn.Module):
    """``module`` with its parameters as leading forward arguments (for the dynamo exporter)."""

    def __init__(self, module: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.module = module
        self.names = names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        params = dict(zip(self.names, args[: len(self.names)], strict=True))
        return torch.func.functional_call(self.module, params, args[len(self.names):])


def param_names(module: torch.nn.Module) -> list[str]:
    """Parameter names as torch lists them (a tied parameter once, under its first name)."""
    return [n for n, _ in module.named_parameters()]


def export(case: Case, exporter: str) -> Exported:
    """Export ``case`` (on a copy of its module) with ``exporter``; the loss is the only output."""
    module = copy.deepcopy(case.module).eval()
    f = io.BytesIO()
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "torchscript":
                torch.onnx.export(module, case.inputs, f, dynamo=False, opset_version=18,
                                  do_constant_folding=False, input_names=list(case.input_names))
                proto = onnx.load_from_string(f.getvalue())
            else:
                names = param_names(module)
                params = tuple(p.detach() for p in module.parameters())
                program = torch.onnx.export(Functional(module, names), params + case.inputs, dynamo=True,
                                            opset_version=18, input_names=names + list(case.input_names),
                                            verbose=False)
                proto = program.model_proto
                values = dict(zip(names, params, strict=True))
                present = {i.name for i in proto.graph.input}
                proto.graph.initializer.extend(numpy_helper.from_array(values[n].numpy(), n)
                                               for n in names if n in present)
    except Exception as e:  # noqa: BLE001 - torch raises many exception types from its exporters
        raise ExportFailed(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") from None
    seconds = time.perf_counter() - start
    if len(proto.graph.output) != 1:
        raise AssertionError(f"{case.name}/{exporter}: expected one output (the loss), got {len(proto.graph.output)}")
    return Exported(case, exporter, proto, proto.graph.output[0].name, seconds)


def _feeds(case: Case) -> dict[str, np.ndarray]:
    return {n: t.numpy() for n, t in zip(case.input_names, case.inputs, strict=True)}


def _rel(a: np.ndarray, b: np.ndarray, floor: float = 1e-30) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), floor))


def _session(model: ir.Model | onnx.ModelProto, custom_ops: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if custom_ops is not None:
        options.register_custom_ops_library(custom_ops)
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _double(case: Case) -> Case:
    module = copy.deepcopy(case.module).double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in case.inputs)
    return Case(case.name, module, inputs, case.input_names)


def torch_gradients(case: Case) -> tuple[float, dict[str, np.ndarray | None]]:
    module = copy.deepcopy(case.module).train()
    loss = module(*case.inputs)
    loss.backward()
    return loss.item(), {n: (None if p.grad is None else p.grad.numpy()) for n, p in module.named_parameters()}


@dataclass(frozen=True)
class GradError:
    """One parameter's gradient: ours against torch fp32 (the measure), ours and torch fp32
    against torch float64 (the fp32 rounding noise of this gradient)."""

    vs_torch: float
    vs_fp64: float = 0.0
    torch_vs_fp64: float = 0.0

    @property
    def ok(self) -> bool:
        """Within GRAD_TOL of torch, or, for a gradient whose fp32 value torch itself gets
        wrong by more than GRAD_TOL / 2, no further from float64 than twice torch's error."""
        return self.vs_torch <= GRAD_TOL or self.vs_fp64 <= 2 * self.torch_vs_fp64


@dataclass(frozen=True)
class GradientRun:
    """The gradient graph (the step graph without an optimizer: the loss and ``grad/P`` for each
    parameter) and what one ORT CPU run of it gives on the case's batch, which both the grad and
    the kernels check compare with: ``outputs`` holds the graph's outputs (``names``, in order)
    and every named bool value its nodes make (the activation backwards' masks: ``Clip``'s
    ``And(x >= lo, x <= hi)``, ``Relu``'s ``x > 0``). Nothing may modify it."""

    graph: ir.Model
    proto: onnx.ModelProto
    names: list[str]
    outputs: dict[str, np.ndarray]


def gradient_run(exported: Exported) -> GradientRun:
    """The gradient graph of ``exported``, built, serialized and run once."""
    graph = build_training_graph(exported.model, optimizer=None, loss=exported.loss)
    proto = ir.to_proto(graph)
    session = _session(_with_outputs(proto, _masks(graph)))
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, _feeds(exported.case)), strict=True))
    return GradientRun(graph, proto, [o.name for o in proto.graph.output], outputs)


def gradient_errors(exported: Exported, run: GradientRun | None = None) -> dict[str, GradError]:
    """Every torch parameter's gradient error; ``vs_torch = inf``: no ``grad/`` output for it.

    ``run``: ``gradient_run(exported)`` when the caller has it."""
    case = exported.case
    run = run if run is not None else gradient_run(exported)
    outs = run.outputs
    loss, expected = torch_gradients(case)
    errors = {"<loss>": GradError(abs(float(outs[run.names[0]]) - loss) / max(1.0, abs(loss)))}
    # A gradient that is zero in exact arithmetic (an attention key bias shifts every score of
    # a query equally, and softmax ignores that: BERT's is 4e-13 against 0.8 for the largest)
    # is rounding noise in torch and in ORT; its error is measured against GRAD_FLOOR times
    # the model's largest parameter-gradient norm instead of its own norm.
    floor = GRAD_FLOOR * max(float(np.linalg.norm(g)) for g in expected.values() if g is not None)
    exact: dict[str, np.ndarray | None] = {}
    for name, grad in expected.items():
        got = outs.get(f"grad/{name}")
        if grad is None:
            # torch gives it no gradient: a graph gradient, if any, must be zero.
            errors[name] = GradError(0.0 if got is None else float(np.abs(got).max()))
        elif got is None:
            errors[name] = GradError(math.inf, math.inf, 0.0)
        elif (error := _rel(got, grad, floor)) <= GRAD_TOL:
            errors[name] = GradError(error)
        else:
            exact = exact or torch_gradients(_double(case))[1]
            errors[name] = GradError(error, _rel(got, exact[name], floor), _rel(grad, exact[name], floor))
    return errors


def _masks(model: ir.Model) -> list[str]:
    """The named bool values ``model``'s nodes make (the activation backwards' masks)."""
    return list(dict.fromkeys(v.name for node in model.graph for v in node.outputs if v.name and v.dtype == ir.DataType.BOOL))


# The two helpers below edit serialized copies: a graph of a few thousand nodes serializes in a
# tenth of a second, and reading it back into onnx-ir takes several times that.


def _with_outputs(proto: onnx.ModelProto, masks: list[str]) -> onnx.ModelProto:
    """A copy of ``proto`` that also outputs the bool values ``masks``."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    have = {o.name for o in out.graph.output}
    out.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.BOOL, None) for n in masks if n not in have)
    return out


def _pinned(proto: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``proto`` whose values named in ``masks`` are graph inputs ``<name>/pinned``
    (fed those masks): every node that reads one reads the input instead."""
    pinned = onnx.ModelProto()
    pinned.CopyFrom(proto)
    graph = pinned.graph
    # A subgraph could read a mask from the outer scope, which this renaming would not reach.
    assert not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in masks:
                node.input[i] = f"{name}/pinned"
    for output in graph.output:
        if output.name in masks:
            output.name = f"{output.name}/pinned"
    graph.input.extend(onnx.helper.make_tensor_value_info(f"{n}/pinned", onnx.TensorProto.BOOL, list(v.shape))
                       for n, v in masks.items())
    return pinned


def _worst(plain: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> float:
    """The worst ``max|other - plain|`` over the outputs, each over its own largest value (over the
    largest output's where its own is under ``GRAD_FLOOR`` of that: see ``kernel_errors``)."""
    top = max(float(np.max(np.abs(v))) for v in plain.values() if v.size)
    worst = 0.0
    for name, value in plain.items():
        if value.size:
            own = float(np.max(np.abs(value)))
            worst = max(worst, float(np.max(np.abs(other[name].astype(np.float64) - value))) / (own if own >= GRAD_FLOOR * top else top))
    return worst


def kernel_errors(exported: Exported, run: GradientRun | None = None,
                  tolerance: float = 0.0) -> tuple[dict[str, int], float, float | None]:
    """The kernel lowering (``mpgraph.lowering.lower``, as the CUDA Trainer runs it, with the
    CPU library's float32 kernels) on the gradient graph: the ops it made, and the worst
    ``max|lowered - plain| / max|plain|`` over the outputs. A gradient under ``GRAD_FLOOR``
    times the largest is measured against the largest instead, as in ``gradient_errors``: it is
    zero in exact arithmetic and rounding noise in float32 (MobileNet's and SegFormer's biases
    of a normalization that feeds another, 1e-9 to 2.5e-9 of the largest, whose noise changes
    with any summation order, e.g. the NCHWc convolutions').

    An activation's backward mask is a step function of the forward: where the two graphs'
    rounding puts a pre-activation on either side of a kink, one mask element flips and its
    whole gradient term moves. On the 16-block MobileNetV2 of e6c2b92 (batch 2, BatchNorm over a
    few values a channel in the late layers) the NCHWc stem conv's 1.5e-7 relative rounding grew
    to 1.3e-5 at the last ReLU6's input and flipped one of its 10,240 elements (-1.07e-5 against
    2.6e-6): 3% on ``conv_1x1``'s weight gradient. So where masks that both graphs compute
    differ, the plain graph is run again with the lowered graph's masks, and the outputs are
    compared with the same kinks taken: what is left is the lowering's own error. Masks a fused kernel computes
    inside itself (``ReluGrad``) are not seen; none flipped in the corpus.

    Returns ``(ops made, worst error, noise floor)``: the floor is how far the plain graph's
    own outputs move when its float inputs are rounded differently (each times ``1 + 2**-24 z``,
    ``z`` standard normal, masks pinned to the unperturbed ones): the error float32 rounding
    alone makes in this graph. That MobileNetV2's was 3.5e-5 (the rest of the corpus: far under
    1e-5), which is why its lowering's 4.3e-5 is rounding, not a wrong rewrite. It takes a
    session of its own, so it is measured only where the worst error exceeds ``tolerance``
    (``None`` otherwise: an error within tolerance needs no excuse).

    ``run``: ``gradient_run(exported)`` when the caller has it."""
    from mpgraph import lowering as kernels
    from mpgraph.runtime.probe import nchwc_block

    run = run if run is not None else gradient_run(exported)
    lowered = ir.from_proto(run.proto)
    kernels.lower(lowered, "cpu", nchwc_block=nchwc_block())
    made = Counter(n.op_type for n in lowered.graph if n.domain in ("ai.mpgraph", "com.microsoft", "com.microsoft.nchwc"))
    feeds = _feeds(exported.case)
    names = run.names
    plain = run.outputs
    session = _session(_with_outputs(ir.to_proto(lowered), _masks(lowered)), custom_ops=str(kernels.library("cpu")))
    fused = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    masks = {n: v for n, v in plain.items() if v.dtype == np.bool_}
    unpinned = {n: plain[n] for n in names}
    flipped = {n: fused[n] for n, v in masks.items() if n in fused and not np.array_equal(v, fused[n])}
    if flipped:
        pinned = _session(_pinned(run.proto, flipped))
        plain = dict(zip([o.name for o in pinned.get_outputs()],
                         pinned.run(None, {**feeds, **{f"{n}/pinned": v for n, v in flipped.items()}}), strict=True))
        made["flipped mask elements"] = sum(int(np.sum(masks[n] != fused[n])) for n in flipped)
    worst = _worst({n: plain[n] for n in names}, fused)
    if worst <= tolerance:
        return dict(made), worst, None
    rng = np.random.default_rng(0)
    jitter = {n: (v * (1 + 2.0**-24 * rng.standard_normal(v.shape))).astype(v.dtype) if v.dtype == np.float32 else v
              for n, v in feeds.items()}
    nudged = _session(_pinned(run.proto, masks))
    moved = dict(zip([o.name for o in nudged.get_outputs()],
                     nudged.run(None, {**jitter, **{f"{n}/pinned": v for n, v in masks.items()}}), strict=True))
    return dict(made), worst, _worst(unpinned, moved)


def adamw_step_graph(exported: Exported) -> ir.Model:
    """The AdamW step graph. ``CpuRunner`` given an ``ir.Model`` binds its initializers' memory
    as state buffers and overwrites them while it runs: one runner per graph."""
    return build_training_graph(exported.model, optimizer="adamw", loss=exported.loss, lr=LR,
                                optimizer_options=dict(ADAMW))


def adamw_step(exported: Exported) -> bytes:
    """The AdamW step graph, serialized, for runners that each read their own copy."""
    return ir.to_proto(adamw_step_graph(exported)).SerializeToString()


def run_steps(step: bytes | ir.Model, case: Case, steps: int = STEPS) -> list[float]:
    """Losses of ``steps + 1`` steps on the case's batch: the last is the loss after ``steps`` updates."""
    runner = CpuRunner(step, threads=1, spin=False)
    feeds = _feeds(case)
    return [runner.step(feeds) for _ in range(steps + 1)]


def torch_adamw_losses(case: Case, steps: int = STEPS) -> list[float]:
    module = copy.deepcopy(case.module).train()
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], foreach=False)
    losses = []
    for _ in range(steps + 1):
        opt.zero_grad()
        loss = module(*case.inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass(frozen=True)
class LossError:
    """The worst per-step loss error over ``STEPS`` AdamW steps (relative to max(1, |loss|)):
    ours against torch fp32 (the measure), ours and torch fp32 against torch float64."""

    vs_torch: float
    vs_fp64: float
    torch_vs_fp64: float

    @property
    def ok(self) -> bool:
        """Within LOSS_TOL of torch, or, where fp32 torch itself leaves the float64 trajectory
        (Adam turns a gradient component's rounding noise into a full lr step: the 16-block
        MobileNetV2's fp32 torch loss was 1e-3 off float64 after one step), no further from
        float64 than twice torch's distance."""
        return self.vs_torch <= LOSS_TOL or self.vs_fp64 <= 2 * self.torch_vs_fp64


def adamw_errors(exported: Exported, step: bytes | ir.Model | None = None) -> tuple[LossError, list[float]]:
    """Loss errors of ``STEPS`` AdamW steps against torch.optim.AdamW, and our losses."""
    ours = run_steps(step if step is not None else adamw_step(exported), exported.case)
    theirs = torch_adamw_losses(exported.case)

    def worst(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True))

    if (error := worst(ours, theirs)) <= LOSS_TOL:
        return LossError(error, 0.0, 0.0), ours
    exact = torch_adamw_losses(_double(exported.case))
    return LossError(error, worst(ours, exact), worst(theirs, exact)), ours


def run_updates(step: bytes | ir.Model, case: Case, updates: int = STEPS, max_skips: int = 12) -> tuple[float, int]:
    """The loss after ``updates`` applied updates, and how many steps dynamic loss scaling
    skipped on the way (an fp16 step that overflows at GradScaler's initial scale of 65536 is
    skipped and the scale halved, as torch.amp does: counting steps would compare fp16 one
    update behind fp32)."""
    runner = CpuRunner(step, threads=1, spin=False)
    feeds = _feeds(case)
    counter = "optim/step" if any(name == "optim/step" for name, _ in runner.pairs) else None
    for i in range(updates + max_skips):
        runner.step(feeds)
        done = i + 1 if counter is None else int(runner.state[counter].ravel()[0])
        if done >= updates:
            return runner.step(feeds), i + 1 - updates
    raise AssertionError(f"{case.name}: more than {max_skips} of {updates + max_skips} steps skipped")


def lowp_deltas(step: bytes, case: Case, fp32_losses: list[float]) -> tuple[dict[str, float], dict[str, int]]:
    """|loss after 5 updates| of the emulated bf16 and fp16 step graphs minus fp32's, and the
    number of steps each skipped."""
    deltas, skipped = {}, {}
    for policy in ("bf16", "fp16"):
        low = convert(ir.from_proto(onnx.load_from_string(step)), policy, emulate=True)
        # The runner takes ``low`` itself, not a serialized copy: it overwrites the initializers
        # it binds as state, and ``low`` is this loop's own.
        loss, skipped[policy] = run_updates(low, case)
        deltas[policy] = abs(loss - fp32_losses[-1])
    return deltas, skipped


def measure(case: Case, exporter: str) -> tuple[Result, dict[str, str]]:
    """Every check of one case and exporter. A failing check is recorded (its error message
    under its name) and the later checks that do not depend on it still run.

    Raises:
        ExportFailed: torch cannot export the case with this exporter.
    """
    result, failures = Result(), {}
    exported = export(case, exporter)
    result.seconds["export"] = exported.seconds
    start = time.perf_counter()
    try:
        result.grad_errors = gradient_errors(exported)
    except Exception as e:  # noqa: BLE001 - recorded for the report
        failures["grad"] = _message(e)
    result.seconds["grad"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        step = adamw_step(exported)
        result.loss_error, losses = adamw_errors(exported, step)
    except Exception as e:  # noqa: BLE001
        failures["adamw"] = failures["lowp"] = _message(e)
        return result, failures
    finally:
        result.seconds["adamw"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        result.lowp_deltas, result.lowp_skipped = lowp_deltas(step, case, losses)
    except Exception as e:  # noqa: BLE001
        failures["lowp"] = _message(e)
    result.seconds["lowp"] = time.perf_counter() - start
    return result, failures


def _message(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"
