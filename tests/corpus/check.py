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
import glob
import io
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import numpy_helper

from mpgraph.convert import convert
from mpgraph.runtime.cpu_runner import CpuRunner
from mpgraph.train_graph import build_training_graph

from .models import Case

EXPORTERS = ("torchscript", "dynamo")
GRAD_TOL = 1e-4
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

    grad_errors: dict[str, float] = field(default_factory=dict)
    loss_errors: list[float] = field(default_factory=list)
    lowp_deltas: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grad_errors, key=lambda k: self.grad_errors[k])
        return name, self.grad_errors[name]


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


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-30))


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def torch_gradients(case: Case) -> tuple[float, dict[str, np.ndarray | None]]:
    module = copy.deepcopy(case.module).train()
    loss = module(*case.inputs)
    loss.backward()
    return loss.item(), {n: (None if p.grad is None else p.grad.numpy()) for n, p in module.named_parameters()}


def gradient_errors(exported: Exported) -> dict[str, float]:
    """Relative L2 error of every torch parameter's gradient (``inf``: no ``grad/`` output)."""
    case = exported.case
    step = build_training_graph(exported.model, optimizer=None, loss=exported.loss)
    session = _session(step)
    names = [o.name for o in session.get_outputs()]
    outs = dict(zip(names, session.run(None, _feeds(case)), strict=True))
    loss, expected = torch_gradients(case)
    errors = {"<loss>": abs(float(outs[names[0]]) - loss) / max(1.0, abs(loss))}
    for name, grad in expected.items():
        got = outs.get(f"grad/{name}")
        if grad is None:
            # torch gives it no gradient: a graph gradient, if any, must be zero.
            errors[name] = 0.0 if got is None else float(np.abs(got).max())
        elif got is None:
            errors[name] = math.inf
        else:
            errors[name] = _rel(got, grad)
    return errors


def adamw_step(exported: Exported) -> bytes:
    """The AdamW step graph, serialized: ``CpuRunner`` given an ``ir.Model`` binds its
    initializers' memory as state buffers and overwrites them while it runs, so each runner
    gets its own copy."""
    step = build_training_graph(exported.model, optimizer="adamw", loss=exported.loss, lr=LR,
                                optimizer_options=dict(ADAMW))
    return ir.to_proto(step).SerializeToString()


def run_steps(step: bytes, case: Case, steps: int = STEPS) -> list[float]:
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


def adamw_errors(exported: Exported, step: bytes | None = None) -> tuple[list[float], list[float]]:
    """Per-step loss errors (relative to max(1, |loss|)) against torch.optim.AdamW, and our losses."""
    ours = run_steps(step if step is not None else adamw_step(exported), exported.case)
    theirs = torch_adamw_losses(exported.case)
    return [abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, theirs, strict=True)], ours


def lowp_deltas(step: bytes, case: Case, fp32_losses: list[float]) -> dict[str, float]:
    """|loss after 5 steps| of the emulated bf16 and fp16 step graphs minus fp32's."""
    deltas = {}
    for policy in ("bf16", "fp16"):
        low = convert(ir.from_proto(onnx.load_from_string(step)), policy, emulate=True)
        deltas[policy] = abs(run_steps(ir.to_proto(low).SerializeToString(), case)[-1] - fp32_losses[-1])
    return deltas


def measure(case: Case, exporter: str) -> tuple[Exported, Result]:
    """Every check of one case and exporter; exceptions propagate (the caller records them)."""
    result = Result()
    exported = export(case, exporter)
    result.seconds["export"] = exported.seconds
    start = time.perf_counter()
    result.grad_errors = gradient_errors(exported)
    result.seconds["grad"] = time.perf_counter() - start
    start = time.perf_counter()
    step = adamw_step(exported)
    result.loss_errors, losses = adamw_errors(exported, step)
    result.seconds["adamw"] = time.perf_counter() - start
    start = time.perf_counter()
    result.lowp_deltas = lowp_deltas(step, case, losses)
    result.seconds["lowp"] = time.perf_counter() - start
    return exported, result
