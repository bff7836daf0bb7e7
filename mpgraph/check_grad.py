"""Check a model's training gradients against central finite differences, without torch.

``check_grad`` answers "does the step graph mpgraph builds for *my* model compute the right
gradients?" on the user's own model, with ONNX Runtime alone:

1. **Gradient graph.** ``build_training_graph(model, optimizer=None, loss=...)``: outputs the
   loss and ``grad/<param>`` for every parameter. Dropout runs in inference mode for the check
   (a random mask has no finite difference; the training-mode rule has its own table case).
2. **Inputs.** Generated with a fixed seed: floats standard normal; integer inputs valid for
   what consumes them (token ids below the rows of the ``Gather`` table they index, labels below
   the class count of the loss op that reads them, ``*mask*`` inputs all ones). An ``.npz``
   (``inputs=``) replaces them; its keys must be exactly the model's data inputs.
3. **Precision.** The forward (for finite differences) and the gradient graph run in float64
   where ORT's CPU provider has float64 kernels. An op without one runs in float32 between
   Casts, except a 2-D ``Conv`` (and ``GlobalAveragePool``/``GlobalMaxPool``), which is
   rewritten into float64 ops: a float32 Conv's rounding would swamp every CNN's finite
   differences. The report says which ops stayed float32; the step and the tolerance follow
   (``STEP``, ``RTOL``).
4. **Per parameter.** A direction ``d`` of unit norm, half random and half along the analytic
   gradient (so ``|<g, d>|`` is of the order of ``|g|`` even for a million-element tensor and the
   finite difference resolves it), then ``<g, d>`` against
   ``(L(p + h d) - L(p - h d)) / 2h``, with ``h`` chosen to move the loss by a fixed fraction.
   A disagreement is retried at 1/4 and 1/16 of the step: kinks (Relu, MaxPool) and curvature
   shrink with the step and rounding grows, so an error that changes 2x over those steps, or
   is within 4x their spread, is the finite difference's own (``noisy``); one that stays put
   is a wrong gradient (``fail``).
5. **Localization.** When a parameter fails, every node on the backward path is checked alone,
   closest to the loss first: its gradient rule is applied to the node's real forward values and
   a random output cotangent, and each input cotangent is compared with finite differences of
   ``<cotangent, node(x)>``. The failing node closest to the loss is where the backward pass
   first goes wrong (``GradCheckReport.first_bad_node``). Ops with ties or kinks (MaxPool,
   Relu, Max, ...) are checked at slightly jittered inputs, where a derivative exists.

Example:
    >>> report = check_grad("models/onnx/tiny_mlp.loss.onnx")  # doctest: +SKIP
    >>> report.passed, report.dtype, [p.name for p in report.params][:2]  # doctest: +SKIP
    (True, 'float64', ['fc1.weight', 'fc1.bias'])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mpgraph.autodiff import registry
from mpgraph.autodiff.driver import FLOAT_TYPES, GradContext, input_gradients
from mpgraph.data import read_npz
from mpgraph.errors import MpgraphError
from mpgraph._ir.meta import MODEL_LOSS, NODE_ROLE

__all__ = ["check_grad", "GradCheckReport", "ParamCheck", "NodeCheck", "InputsError"]

logger = logging.getLogger(__name__)

#: Step (the fraction of the loss a step moves it by) and pass threshold, by precision:
#: ``float64`` both graphs in float64; ``analytic32`` finite differences in float64, some
#: gradient ops (ConvTranspose) in float32; ``mixed`` finite differences through float32 ops
#: (Erf, LRN, AveragePool); ``float32``. Measured on the zoo: worst errors 6e-10 (tiny_mlp,
#: wide_mlp), 9e-8 (resnet, analytic32), 3e-6 (gpt, mixed); a planted 2% error reads 2e-2.
STEP = {"float64": 1e-7, "analytic32": 1e-7, "mixed": 1e-4, "float32": 1e-3}
RTOL = {"float64": 1e-5, "analytic32": 1e-4, "mixed": 1e-3, "float32": 5e-3}
#: Node-level checks: the same, for the objective ``<cotangent, node(x)>``.
NODE_STEP = {"float64": 1e-7, "float32": 1e-3}
NODE_RTOL = {"float64": 1e-5, "float32": 5e-3}
_EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps)}
#: Default size of a symbolic dimension: the leading one (the batch) and the others.
BATCH = 2
OTHER_DIM = 8
_SHAPE_PRESERVING = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity", "Transpose"})
#: Ops that round nothing when run in float32 inside a float64 graph (their float input is
#: only copied or used as 0/1 values).
_EXACT_IN_FLOAT32 = frozenset({"OneHot", "Shape", "Size", "Identity", "Reshape", "Transpose", "Gather", "Where"})
#: Ops whose derivative jumps at ties or kinks: node checks run at a jittered point.
_KINKS = frozenset({"MaxPool", "GlobalMaxPool", "ReduceMax", "ReduceMin", "Max", "Min", "Relu", "LeakyRelu",
                    "PRelu", "Clip", "Abs", "TopK", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Sign"})
_LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})


class InputsError(MpgraphError):
    """An ``--inputs`` file does not match the model's data inputs."""


@dataclasses.dataclass(frozen=True)
class ParamCheck:
    """One parameter: analytic ``<g, d>`` against the finite difference along ``d``.

    Attributes:
        name: Parameter name.
        size: Elements.
        analytic: ``<g, d>`` from the gradient graph.
        numeric: Central finite difference of the loss along ``d``.
        rel_error: ``|analytic - numeric| / max(|analytic|, |numeric|)``.
        uncertainty: Relative spread of the finite difference between two steps.
        status: ``pass``, ``fail`` or ``noisy`` (see ``passed``).
    """

    name: str
    size: int
    analytic: float
    numeric: float
    rel_error: float
    uncertainty: float
    status: str

    @property
    def passed(self) -> bool:
        """``pass``, or ``noisy``: the finite differences are too uncertain to tell (the
        analytic value is within three times their spread over two steps)."""
        return self.status != "fail"


@dataclasses.dataclass(frozen=True)
class NodeCheck:
    """A node whose gradient rule disagrees with finite differences through that node alone.

    Attributes:
        name: Node name in the gradient graph (the forward model's name where it had one).
        op_type: ONNX op type.
        rule: Registry key of the rule (``ai.onnx::Relu@1-``).
        input: The input whose cotangent disagrees.
        analytic: ``<x_bar, d>`` from the rule.
        numeric: Finite difference of ``<y_bar, node(x + t d)>``.
        rel_error: Relative error between the two.
        dtype: Precision the node was checked in.
    """

    name: str
    op_type: str
    rule: str
    input: str
    analytic: float
    numeric: float
    rel_error: float
    dtype: str


@dataclasses.dataclass(frozen=True)
class GradCheckReport:
    """Result of ``check_grad``.

    Attributes:
        loss: Name of the loss output.
        dtype: Precision of the finite differences (``float64`` or ``float32``).
        analytic_dtype: Precision the gradient graph ran in.
        dtype_note: Why float32 was used, when it was.
        step: Relative finite-difference step.
        rtol: Pass threshold on the relative error.
        seed: Seed of inputs and directions.
        inputs: ``(name, shape, dtype)`` of every data input fed.
        params: One ``ParamCheck`` per parameter, in graph order.
        bad_nodes: Nodes whose rule disagrees, closest to the loss first (empty when every
            parameter passed or localization was off).
        nodes_checked: Nodes checked alone during localization.
        notes: Things the user should know (Dropout in inference mode, unchecked nodes).
    """

    loss: str
    dtype: str
    analytic_dtype: str
    dtype_note: str
    step: float
    rtol: float
    seed: int
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    params: tuple[ParamCheck, ...]
    bad_nodes: tuple[NodeCheck, ...] = ()
    nodes_checked: int = 0
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether every parameter passed."""
        return all(p.passed for p in self.params)

    @property
    def failed(self) -> tuple[ParamCheck, ...]:
        """The parameters that failed."""
        return tuple(p for p in self.params if not p.passed)

    @property
    def first_bad_node(self) -> NodeCheck | None:
        """The node closest to the loss whose rule disagrees (where backward first goes wrong)."""
        return self.bad_nodes[0] if self.bad_nodes else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``passed`` and ``first_bad_node`` included)."""
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        d["first_bad_node"] = dataclasses.asdict(self.first_bad_node) if self.first_bad_node else None
        d["inputs"] = [{"name": n, "shape": list(s), "dtype": t} for n, s, t in self.inputs]
        return d

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)


Progress = Callable[[str, int, int], None]


def check_grad(
    model: ir.Model | onnx.ModelProto | str | os.PathLike[str],
    loss: str | None = None,
    inputs: str | os.PathLike[str] | Mapping[str, np.ndarray] | None = None,
    *,
    seed: int = 0,
    batch: int = BATCH,
    freeze: Sequence[str] = (),
    batchnorm: str = "train",
    localize: bool = True,
    float64: bool = True,
    step: float | None = None,
    rtol: float | None = None,
    random_weights: bool = False,
    progress: Progress | None = None,
) -> GradCheckReport:
    """Compare every parameter's gradient with central finite differences of the loss.

    Args:
        model: Forward model (onnx-ir, protobuf or path), as for ``build_training_graph``.
        loss: As ``build_training_graph``'s ``loss`` (an output name, ``cross_entropy``, ``mse``).
        inputs: Data inputs (an ``.npz`` path or a dict); default: generated from ``seed``.
        seed: Seed of generated inputs, directions and cotangents.
        batch: Size of symbolic leading dimensions of generated inputs.
        freeze: Parameters to leave out (fnmatch patterns).
        batchnorm: As ``build_training_graph``.
        localize: When a parameter fails, check each node on the backward path alone.
        float64: Try float64 first (``False``: float32 only).
        step: Relative finite-difference step (default by precision, ``STEP``).
        rtol: Pass threshold on the relative error (default by precision, ``RTOL``).
        random_weights: Check at seeded random parameters instead of the model's own: for
            files whose weights are placeholders (the onnx test "light" models hold constant
            weights, which make every logit equal and most gradients zero).
        progress: ``progress(phase, done, total)`` after each parameter or node.

    Returns:
        The report; ``report.passed`` is false when some parameter disagrees.

    Raises:
        InputsError: ``inputs`` lacks a data input or has a key the model does not take.
        MpgraphError: The gradient graph cannot be built or ONNX Runtime cannot run it.
    """
    from mpgraph.training import build_training_graph

    fwd = _load(model)
    notes: list[str] = []
    dropped = _inference_dropout(fwd.graph)
    if dropped:
        notes.append(f"Dropout ran in inference mode ({dropped} node(s)): a random mask has no finite difference")
    step_model = build_training_graph(fwd, optimizer=None, loss=loss, freeze=freeze, batchnorm=batchnorm)
    graph = step_model.graph
    loss_name = step_model.metadata_props.get(MODEL_LOSS) or graph.outputs[0].name or "loss"
    params = [o.name[len("grad/"):] for o in graph.outputs if o.name and o.name.startswith("grad/")]
    inits = graph.initializers
    base = {p: np.asarray(inits[p].const_value.numpy()) for p in params}  # type: ignore[union-attr]
    if random_weights:
        base = _random_weights(base, np.random.default_rng([seed, 3]))
        notes.append("parameters replaced by seeded random values (--random-weights)")
    data_specs = [v for v in graph.inputs if v.name not in inits]
    rng = np.random.default_rng([seed, 0])
    if inputs is None:
        feeds = _generate_inputs(graph, data_specs, rng, batch)
    else:
        feeds = _read_inputs(inputs, data_specs)

    # Precision: float64 where ORT has every kernel, for the forward and the gradient graph alike.
    grad_proto = ir.to_proto(step_model)
    fwd_proto = _forward_proto(step_model, [loss_name])
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    shapes.update(_probe_conv_shapes(grad_proto, {**feeds, **base}))
    fwd_prec, fwd_session = _session_in_best_dtype(fwd_proto, float64, shapes)
    grad_prec, grad_session = _session_in_best_dtype(grad_proto, float64, shapes)
    dtype, analytic_dtype = fwd_prec.dtype, grad_prec.dtype
    dtype_note = fwd_prec.note or (f"gradient graph: {grad_prec.note}" if grad_prec.note else "")
    kind = _kind(fwd_prec, grad_prec)

    grad_outputs = [loss_name] + [f"grad/{p}" for p in params]
    base_feeds = {**feeds, **base}
    results = _run(grad_session, grad_outputs, _cast_feeds(base_feeds, analytic_dtype))
    grads = dict(zip(params, results[1:], strict=True))
    loss0 = float(np.asarray(results[0], np.float64).sum())

    rtol = RTOL[kind] if rtol is None else rtol
    rel_step = STEP[_kind(fwd_prec, fwd_prec)] if step is None else step
    eps = _EPS[dtype]
    checks: list[ParamCheck] = []
    for i, p in enumerate(params):
        g = np.asarray(grads[p], np.float64)
        d = _direction(g, np.random.default_rng([seed, 1, i]))
        x = base[p].astype(np.float64)

        def loss_at(t: float, p: str = p, x: np.ndarray = x, d: np.ndarray = d) -> float:
            shifted = dict(base_feeds)
            shifted[p] = (x + t * d).astype(x.dtype if dtype == "float64" else base[p].dtype)
            out = _run(fwd_session, [loss_name], _cast_feeds(shifted, dtype))[0]
            return float(np.asarray(out, np.float64).sum())

        analytic = float(np.dot(g.reshape(-1), d.reshape(-1)))
        # Step sized so the loss moves by ``rel_step`` of itself: rounding noise and kinks
        # (Relu, MaxPool) then cost the same relative error for a tensor of any size or scale.
        h0 = rel_step * max(abs(loss0), 1.0) / max(abs(analytic), 1e-12)
        # ... but not so far that the loss stops being smooth around p (a small gradient next to
        # a large loss would ask for a step of the size of p itself).
        h0 = min(h0, 3 * np.sqrt(rel_step) * max(float(np.linalg.norm(x)), 1.0))
        noise = 100 * eps * max(abs(loss0), 1.0)
        numeric, rel = _central(loss_at, analytic, h0, noise)
        status, spread = "pass", 0.0
        if rel > rtol:
            # Retry at 1/4 and 1/16 of the step. Kinks (Relu, MaxPool) and curvature shrink
            # with the step and rounding noise grows, so an error that changes by 2x or more
            # over the three steps is the finite difference's own ("noisy"); a wrong rule's
            # error stays put ("fail").
            tries = [(rel, numeric)] + [_central(loss_at, analytic, h0 / k, noise)[::-1] for k in (4.0, 16.0)]
            rel, numeric = min(tries)
            numerics = [n for _, n in tries]
            spread = (max(numerics) - min(numerics)) / max(abs(numeric), noise / h0)
            errors = [r for r, _ in tries]
            if rel > rtol:
                systematic = max(errors) < 2 * min(errors) and rel > 4 * spread
                status = "fail" if systematic else "noisy"
        checks.append(ParamCheck(p, int(x.size), analytic, numeric, rel, spread, status))
        if progress is not None:
            progress("parameters", i + 1, len(params))

    if checks and all(c.analytic == 0.0 for c in checks):
        notes.append("every gradient is exactly zero: nothing was checked (a constant loss? try another --loss "
                     "or --random-weights)")
    bad: list[NodeCheck] = []
    checked = 0
    if localize and any(not c.passed for c in checks):
        bad, checked, skipped = _localize(step_model, loss_name, params, base_feeds, dtype, seed, progress)
        if skipped:
            notes.append(f"{len(skipped)} node(s) could not be checked alone: {', '.join(skipped[:5])}")
    return GradCheckReport(
        loss=loss_name, dtype=fwd_prec.label, analytic_dtype=grad_prec.label, dtype_note=dtype_note, step=rel_step, rtol=rtol,
        seed=seed, inputs=tuple((k, tuple(int(s) for s in v.shape), str(v.dtype)) for k, v in feeds.items()),
        params=tuple(checks), bad_nodes=tuple(bad), nodes_checked=checked, notes=tuple(notes),
    )


# -- model preparation -----------------------------------------------------------------------


def _load(model: ir.Model | onnx.ModelProto | str | os.PathLike[str]) -> ir.Model:
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model))  # a copy: Dropout is edited below
    if isinstance(model, onnx.ModelProto):
        return ir.from_proto(model)
    from mpgraph.io import load_model

    return load_model(model)


def _inference_dropout(graph: ir.Graph) -> int:
    """Drop Dropout's ``training_mode`` input (inference: identity). Returns how many changed."""
    changed = 0
    for node in graph:
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            tensor = ir.convenience.get_const_tensor(node.inputs[2])
            if tensor is None or bool(tensor.numpy().reshape(-1)[0]):
                changed += 1
            node.resize_inputs(2)
    return changed


def _forward_proto(step: ir.Model, outputs: Sequence[str]) -> onnx.ModelProto:
    """The forward part of the gradient graph computing ``outputs`` (backward pruned)."""
    proto = ir.to_proto(step)
    copy = ir.from_proto(proto)
    values = {v.name: v for node in copy.graph for v in node.outputs}
    values.update({v.name: v for v in copy.graph.inputs})
    copy.graph.outputs.clear()
    for name in outputs:
        value = values[name]
        if value.is_graph_input():
            value = _identity(copy.graph, value, f"check/{name}")
        copy.graph.outputs.append(value)
    live: set[ir.Value] = set(copy.graph.outputs)
    for node in reversed(list(copy.graph)):
        if any(o in live for o in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            copy.graph.remove(node, safe=False)
    for name, value in list(copy.graph.initializers.items()):
        if value not in live and not value.is_graph_input():
            del copy.graph.initializers[name]
    return ir.to_proto(copy)


def _identity(graph: ir.Graph, value: ir.Value, name: str) -> ir.Value:
    node = ir.Node("", "Identity", [value], name=name)
    node.outputs[0].name = name
    node.outputs[0].dtype = value.dtype
    node.outputs[0].shape = value.shape
    graph.append(node)
    return node.outputs[0]


def _to_float64(proto: onnx.ModelProto, keep32: frozenset[str] = frozenset(),
                input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> tuple[onnx.ModelProto, set[str]]:
    """A copy computing in float64 instead of float32, and the op types left in float32.

    Ops in ``keep32`` (no float64 kernel in ORT) run in float32 between Casts, except a 2-D
    ``Conv`` with static channels and spatial dims, which becomes float64 Slices and a MatMul
    (``_conv_as_matmul``): a float32 Conv's rounding would otherwise dominate the finite
    differences of every CNN. Types of intermediates are re-inferred.
    """
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for v in out.graph.input:  # the check feeds one shape: make it static
        if input_shapes and v.name in input_shapes:
            v.type.tensor_type.shape.CopyFrom(onnx.helper.make_tensor_type_proto(1, list(input_shapes[v.name])).tensor_type.shape)
    if "Conv" in keep32:  # static shapes of backward Convs too (weight gradients), for _conv_as_matmul
        del out.graph.value_info[:]
        try:
            out = onnx.shape_inference.infer_shapes(out, data_prop=True)
        except Exception as e:  # noqa: BLE001 - inference is best effort here
            logger.debug("shape inference before float64 conversion failed: %s", e)
    f32, f64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE
    g = out.graph
    is_f32 = {v.name for v in [*g.input, *g.value_info, *g.output] if v.type.tensor_type.elem_type == f32}
    is_f32 |= {t.name for t in g.initializer if t.data_type == f32}
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in [*g.input, *g.value_info, *g.output] if v.type.tensor_type.HasField("shape")}
    shapes.update({t.name: list(t.dims) for t in g.initializer})
    shapes.update({k: list(v) for k, v in (input_shapes or {}).items()})
    islands: set[str] = set()

    def tensor64(t: onnx.TensorProto) -> None:
        if t.data_type == f32:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float64), t.name))

    del g.value_info[:]
    for t in g.initializer:
        tensor64(t)
    for v in g.input:
        if v.type.tensor_type.elem_type == f32:
            v.type.tensor_type.elem_type = f64
    for v in g.output:
        v.type.tensor_type.elem_type = 0  # re-inferred: some outputs stay float32 (LayerNorm mean)
        v.type.tensor_type.ClearField("shape")
    nodes = []
    for node in g.node:
        if node.op_type == "Conv" and "Conv" in keep32:
            emulated = _conv_as_matmul(node, shapes)
            if emulated is not None:
                nodes += emulated
                continue
        if node.op_type in ("GlobalAveragePool", "GlobalMaxPool") and node.op_type in keep32:
            rank = len(shapes.get(node.input[0]) or ())
            if rank > 2:
                reduce = "ReduceMean" if node.op_type == "GlobalAveragePool" else "ReduceMax"
                axes = f"{node.name or node.output[0]}/f64pool/axes"
                nodes += [onnx.helper.make_node("Constant", [], [axes], value=onnx.helper.make_tensor(
                              axes, onnx.TensorProto.INT64, [rank - 2], list(range(2, rank)))),
                          onnx.helper.make_node(reduce, [node.input[0], axes], [node.output[0]], keepdims=1)]
                continue
        if node.op_type in keep32:
            islands.add(node.op_type)
            for k, name in enumerate(node.input):
                if name in is_f32:
                    nodes.append(onnx.helper.make_node("Cast", [name], [f"{name}/f32/{node.name}"], to=f32))
                    node.input[k] = f"{name}/f32/{node.name}"
            after = []
            for k, name in enumerate(node.output):
                if name in is_f32:
                    node.output[k] = f"{name}/f32"
                    after.append(onnx.helper.make_node("Cast", [f"{name}/f32"], [name], to=f64))
            nodes += [node, *after]
            continue
        for a in node.attribute:
            if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == f32:
                a.i = f64
            elif a.type == onnx.AttributeProto.TENSOR:
                tensor64(a.t)
            elif node.op_type == "Constant" and a.name == "value_float":
                a.CopyFrom(onnx.helper.make_attribute("value", np.array(a.f, np.float64)))
            elif node.op_type == "Constant" and a.name == "value_floats":
                a.CopyFrom(onnx.helper.make_attribute("value", np.array(list(a.floats), np.float64)))
        nodes.append(node)
        if node.op_type == "LayerNormalization":
            # Its mean and inverse deviation are float32 by schema (stash_type) for any input.
            for k in range(1, len(node.output)):
                if node.output[k]:
                    name, node.output[k] = node.output[k], f"{node.output[k]}/f32"
                    nodes.append(onnx.helper.make_node("Cast", [node.output[k]], [name], to=f64))
    del g.node[:]
    g.node.extend(nodes)
    out = onnx.shape_inference.infer_shapes(out, strict_mode=True)
    if any(v.type.tensor_type.elem_type == 0 for v in out.graph.output):
        raise ValueError("the float64 graph's output types cannot be inferred")
    return out, islands


def _probe_conv_shapes(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Runtime shapes of every Conv input (one float32 run): shape inference does not reach
    every backward Conv, and ``_conv_as_matmul`` needs them static."""
    names = sorted({i for n in proto.graph.node if n.op_type == "Conv" for i in n.input[:2] if i})
    have = {v.name for v in proto.graph.output}
    names = [n for n in names if n not in have and n not in feeds]
    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    try:
        session = _new_session(probe)
        arrays = session.run(names, {i.name: feeds[i.name] for i in session.get_inputs() if i.name in feeds})
    except Exception as e:  # noqa: BLE001 - best effort: without shapes, Convs stay float32
        logger.debug("conv shape probe failed: %s", e)
        return {}
    return {n: tuple(a.shape) for n, a in zip(names, arrays, strict=True)}


def _conv_as_matmul(node: onnx.NodeProto, shapes: Mapping[str, list[int | None]]) -> list[onnx.NodeProto] | None:
    """A 2-D Conv as Pad, one strided Slice per kernel tap, Concat and a grouped MatMul (all
    with float64 kernels in ORT CPU); ``None`` when a shape it needs is not static."""
    x_shape, w_shape = shapes.get(node.input[0]), shapes.get(node.input[1])
    if x_shape is None or w_shape is None or len(x_shape) != 4 or len(w_shape) != 4 or None in x_shape[1:] or None in w_shape:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    _, c, h, w = x_shape
    m, cg, kh, kw = w_shape
    group = int(attrs.get("group", 1))
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0, 0, 0, 0]
        for axis, (size, k, st, dl) in enumerate(((h, kh, sh, dh), (w, kw, sw, dw))):
            total = max((-(-size // st) - 1) * st + (k - 1) * dl + 1 - size, 0)
            small, big = total // 2, total - total // 2
            pads[axis], pads[axis + 2] = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        pads = [0, 0, 0, 0]
    assert h is not None and w is not None and c is not None
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    p = f"{node.name or node.output[0]}/f64conv"
    i64 = onnx.TensorProto.INT64

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return onnx.helper.make_node("Constant", [], [f"{p}/{name}"], value=onnx.helper.make_tensor(f"{p}/{name}", i64, [len(values)], values))

    nodes = [const("pads", [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]), const("axes", [2, 3]),
             const("steps", [sh, sw]), const("unsq", [2]),
             const("cols_shape", [-1, group, (c // group) * kh * kw, oh * ow]),
             const("w_shape", [group, m // group, cg * kh * kw]), const("y_shape", [-1, m, oh, ow]),
             onnx.helper.make_node("Pad", [node.input[0], f"{p}/pads"], [f"{p}/padded"])]
    taps = []
    for i in range(kh):
        for j in range(kw):
            start = [i * dh, j * dw]
            end = [start[0] + sh * (oh - 1) + 1, start[1] + sw * (ow - 1) + 1]
            nodes += [const(f"s{i}_{j}", start), const(f"e{i}_{j}", end),
                      onnx.helper.make_node("Slice", [f"{p}/padded", f"{p}/s{i}_{j}", f"{p}/e{i}_{j}", f"{p}/axes", f"{p}/steps"], [f"{p}/tap{i}_{j}"]),
                      onnx.helper.make_node("Unsqueeze", [f"{p}/tap{i}_{j}", f"{p}/unsq"], [f"{p}/tapu{i}_{j}"])]
            taps.append(f"{p}/tapu{i}_{j}")
    # [N, C, taps, OH, OW] -> [N, G, C/G * taps, OH * OW]: channel-major, tap-minor like W.
    nodes += [onnx.helper.make_node("Concat", taps, [f"{p}/cols5"], axis=2),
              onnx.helper.make_node("Reshape", [f"{p}/cols5", f"{p}/cols_shape"], [f"{p}/cols"]),
              onnx.helper.make_node("Reshape", [node.input[1], f"{p}/w_shape"], [f"{p}/w"]),
              onnx.helper.make_node("MatMul", [f"{p}/w", f"{p}/cols"], [f"{p}/y4"])]
    y = node.output[0]
    if len(node.input) > 2 and node.input[2]:
        nodes += [onnx.helper.make_node("Reshape", [f"{p}/y4", f"{p}/y_shape"], [f"{p}/y"]),
                  const("b_shape", [m, 1, 1]),
                  onnx.helper.make_node("Reshape", [node.input[2], f"{p}/b_shape"], [f"{p}/b"]),
                  onnx.helper.make_node("Add", [f"{p}/y", f"{p}/b"], [y])]
    else:
        nodes.append(onnx.helper.make_node("Reshape", [f"{p}/y4", f"{p}/y_shape"], [y]))
    return nodes


def _new_session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # ORT warns once per initializer that is also a graph input (every parameter here).
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


#: Op types ORT CPU loads in float64 but cannot run in it (checked on ORT 1.32).
_FLOAT64_FAILS_AT_RUN = frozenset({"LSTM", "GRU", "RNN"})

_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")


@dataclasses.dataclass(frozen=True)
class _Precision:
    dtype: str  # float64 or float32
    keep32: tuple[str, ...]  # op types run in float32 inside a float64 graph
    note: str

    @property
    def label(self) -> str:
        return self.dtype + (f" ({', '.join(self.keep32)} in float32)" if self.keep32 else "")


def _session_in_best_dtype(proto: onnx.ModelProto, float64: bool,
                           input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> tuple[_Precision, ort.InferenceSession]:
    """A session in float64 when ORT CPU has the kernels; ops without a float64 kernel run in
    float32 between Casts (found by asking ORT, one op type at a time); float32 as a last resort."""
    note = "float64 not requested"
    # Ops whose float64 kernel ORT registers but refuses at run time ("LSTM operator does
    # not support double yet"): run them in float32 from the start.
    keep32: set[str] = {n.op_type for n in proto.graph.node if n.op_type in _FLOAT64_FAILS_AT_RUN}
    while float64 and len(keep32) < 12:
        try:
            converted, islands = _to_float64(proto, frozenset(keep32), input_shapes)
            session = _new_session(converted)
            return _Precision("float64", tuple(sorted(islands)), ""), session
        except Exception as e:  # noqa: BLE001 - ORT raises its own Fail/NotImplemented types
            note = f"no float64: {_ort_first_line(e)}"
            missing = _NO_KERNEL.search(str(e))
            if missing is None or missing.group(1) in keep32:
                break
            keep32.add(missing.group(1))
    logger.info("falling back to float32: %s", note)
    try:
        return _Precision("float32", (), note), _new_session(proto)
    except Exception as e:  # noqa: BLE001
        raise MpgraphError(f"onnxruntime cannot load the gradient graph: {_ort_first_line(e)}") from None


def _ort_first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.replace("[ONNXRuntimeError] : ", "")


def _run(session: ort.InferenceSession, outputs: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    # Parameters are initializers that are also graph inputs: ORT lists them apart.
    names = {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}
    try:
        return list(session.run(list(outputs), {k: v for k, v in feeds.items() if k in names}))
    except Exception as e:  # noqa: BLE001
        raise MpgraphError(f"onnxruntime failed to run the gradient check: {_ort_first_line(e)}") from None


def _cast_feeds(feeds: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    want = np.float64 if dtype == "float64" else np.float32
    return {k: (v.astype(want) if v.dtype in (np.float32, np.float64) else v) for k, v in feeds.items()}


def _central(f: Callable[[float], float], analytic: float, h: float, noise: float) -> tuple[float, float]:
    """Central difference ``(f(h) - f(-h)) / 2h`` and its relative error against ``analytic``;
    differences below the rounding ``noise`` of ``f`` count as agreement."""
    numeric = (f(h) - f(-h)) / (2 * h)
    return numeric, abs(analytic - numeric) / max(abs(analytic), abs(numeric), noise / h)


def _kind(fwd: _Precision, grad: _Precision) -> str:
    """``float64`` (both graphs fully float64), ``analytic32`` (finite differences in float64,
    some gradient ops in float32), ``mixed`` (finite differences through float32 ops) or
    ``float32``."""
    if fwd.dtype == "float32":
        return "float32"
    if set(fwd.keep32) - _EXACT_IN_FLOAT32:
        return "mixed"
    if grad.dtype == "float32" or set(grad.keep32) - _EXACT_IN_FLOAT32:
        return "analytic32"
    return "float64"


def _random_weights(base: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Matrices and kernels ``N(0, 1/fan_in)``; vectors (biases, norm scales) their mean plus
    ``N(0, 0.1^2)``, so a norm scale of ones stays near one."""
    out = {}
    for name, value in base.items():
        if value.ndim >= 2:
            fan_in = int(np.prod(value.shape[1:]))
            out[name] = (rng.standard_normal(value.shape) / np.sqrt(fan_in)).astype(value.dtype)
        else:
            out[name] = (np.mean(value) + 0.1 * rng.standard_normal(value.shape)).astype(value.dtype)
    return out


def _direction(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vector: a random one plus the normalized gradient (see the module docstring)."""
    r = rng.standard_normal(g.shape)
    r /= max(float(np.linalg.norm(r)), 1e-300)
    norm = float(np.linalg.norm(g))
    d = r + (g / norm if norm > 0 and np.isfinite(norm) else 0.0)
    return d / max(float(np.linalg.norm(d)), 1e-300)


# -- inputs -------------------------------------------------------------------------------------


def _read_inputs(inputs: str | os.PathLike[str] | Mapping[str, np.ndarray], specs: Sequence[ir.Value]) -> dict[str, np.ndarray]:
    if isinstance(inputs, Mapping):
        arrays, where = {k: np.asarray(v) for k, v in inputs.items()}, "inputs"
    else:
        path = Path(inputs)
        where = str(path)
        if not path.is_file():
            raise InputsError(f"{path}: no such inputs file (an .npz keyed by the model's input names)")
        arrays = read_npz(path, InputsError)
    need = [v.name or "" for v in specs]
    missing = [n for n in need if n not in arrays]
    extra = [k for k in arrays if k not in need]
    if missing or extra:
        what = "; ".join(
            part for part in (
                f"missing {', '.join(repr(n) for n in missing)}" if missing else "",
                f"unknown {', '.join(repr(k) for k in extra)}" if extra else "",
            ) if part
        )
        raise InputsError(
            f"{where}: {what} (the file has: {', '.join(sorted(arrays)) or 'nothing'}; "
            f"the model needs: {', '.join(need)})"
        )
    out = {}
    for v in specs:
        a, want = arrays[v.name or ""], np.dtype(v.dtype.numpy()) if v.dtype is not None else None
        if want is not None and a.dtype != want:
            if a.dtype.kind == "f" and want.kind in "iub":
                raise InputsError(f"{where}: '{v.name}' is {a.dtype}, the model wants {want}")
            a = a.astype(want)
        out[v.name or ""] = a
    return out


def _generate_inputs(graph: ir.Graph, specs: Sequence[ir.Value], rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    """Seeded inputs; symbolic dims of the same name get the same size."""
    sizes: dict[str, int] = {}
    feeds = {}
    for v in specs:
        dims = []
        for axis, d in enumerate(v.shape or ()):
            if isinstance(d, int):
                dims.append(d)
            else:
                key = str(d) if d is not None and str(d) not in ("None", "") else f"{v.name}:{axis}"
                dims.append(sizes.setdefault(key, batch if axis == 0 else OTHER_DIM))
        dtype = np.dtype(v.dtype.numpy()) if v.dtype is not None else np.dtype(np.float32)
        if dtype.kind == "f":
            feeds[v.name or ""] = rng.standard_normal(dims).astype(dtype)
        elif dtype.kind == "b":
            feeds[v.name or ""] = np.ones(dims, dtype)
        else:
            bound = _index_bound(v)
            if bound is None:
                # A mask of ones is valid; other integers of unknown meaning are zeros.
                fill = 1 if "mask" in (v.name or "").lower() else 0
                feeds[v.name or ""] = np.full(dims, fill, dtype)
            else:
                feeds[v.name or ""] = rng.integers(0, bound, dims).astype(dtype)
    return feeds


def _index_bound(value: ir.Value) -> int | None:
    """Exclusive upper bound of an integer input: rows of a Gather table, classes of a loss."""
    frontier, seen = [value], set()
    while frontier:
        v = frontier.pop()
        if v in seen:
            continue
        seen.add(v)
        for node, slot in v.uses():
            if node.op_type in _SHAPE_PRESERVING and slot == 0:
                frontier.extend(node.outputs)
            elif node.op_type in ("Gather", "GatherElements") and slot == 1:
                table = node.inputs[0]
                axis = int(node.attributes["axis"].value) if "axis" in node.attributes else 0
                dims = list(table.shape or ()) if table is not None else []
                if dims and isinstance(dims[axis], int):
                    return int(dims[axis])
            elif node.op_type in _LOSS_OPS and slot == 1:
                scores = node.inputs[0]
                dims = list(scores.shape or ()) if scores is not None else []
                if len(dims) > 1 and isinstance(dims[1], int):
                    return int(dims[1])
    return None


# -- localization -----------------------------------------------------------------------------


def _backward_path(graph: ir.Graph, loss: ir.Value, params: set[str]) -> tuple[list[tuple[ir.Node, registry.GradientRule]], set[ir.Value], set[ir.Value]]:
    """Forward nodes the backward pass differentiates, closest to the loss first (as the
    driver prunes: active from the parameters, needed by the loss)."""
    forward = [n for n in graph if n.metadata_props.get(NODE_ROLE, "forward") in ("forward", "loss")]
    active: set[ir.Value] = {v for v in graph.inputs if v.name in params}
    for node in forward:
        if any(v in active for v in node.inputs if v is not None) and not registry.is_non_differentiable(node.domain, node.op_type):
            active.update(o for o in node.outputs if o.dtype in FLOAT_TYPES)
    needed: set[ir.Value] = {loss}
    path = []
    opset = graph.opset_imports.get("", 18)
    for node in reversed(forward):
        if not any(o in needed for o in node.outputs):
            continue
        rule = registry.lookup_rule(node.domain, node.op_type, graph.opset_imports.get(node.domain or "", opset), node.name or "")
        if not isinstance(rule, registry.GradientRule):
            continue
        path.append((node, rule))
        needed.update(v for v in node.inputs if v is not None and v in active)
    return path, active, needed


def _localize(step: ir.Model, loss_name: str, params: Sequence[str], feeds: Mapping[str, np.ndarray], dtype: str,
              seed: int, progress: Progress | None) -> tuple[list[NodeCheck], int, list[str]]:
    graph = step.graph
    loss = next(v for v in graph.outputs if v.name == loss_name)
    path, active, needed = _backward_path(graph, loss, set(params))
    # One forward run exposes every value the checked nodes read or write.
    wanted: list[str] = []
    for node, _ in path:
        for v in [*node.inputs, *node.outputs]:
            if v is not None and v.name and v.producer() is not None and v.producer().op_type != "Constant" and v.name not in wanted:
                wanted.append(v.name)
    fwd = _forward_proto(step, [loss_name, *wanted])
    prec, session = _session_in_best_dtype(fwd, dtype == "float64", {k: tuple(v.shape) for k, v in feeds.items()})
    run_dtype = prec.dtype
    values = dict(zip([loss_name, *wanted], _run(session, [loss_name, *wanted], _cast_feeds(feeds, run_dtype)), strict=True))
    values.update(_cast_feeds(feeds, run_dtype))
    for v in graph.inputs:  # state inputs the check does not feed (running statistics)
        if v.name not in values and v.const_value is not None:
            values[v.name or ""] = _cast_feeds({"_": np.asarray(v.const_value.numpy())}, run_dtype)["_"]
    bad: list[NodeCheck] = []
    skipped: list[str] = []
    for k, (node, rule) in enumerate(path):
        try:
            result = _check_node(node, rule, active & needed, needed, values, graph.opset_imports, seed + k)
        except Exception as e:  # noqa: BLE001 - a node that cannot be isolated is reported, not fatal
            logger.info("node %s not checked alone: %s", node.name, e)
            skipped.append(f"{node.name} ({_ort_first_line(e)[:80]})")
            result = None
        if result is not None:
            bad.append(result)
        if progress is not None:
            progress("nodes", k + 1, len(path))
    return bad, len(path), skipped


def _check_node(node: ir.Node, rule: registry.GradientRule, wrt: set[ir.Value], needed: set[ir.Value],
                values: Mapping[str, np.ndarray], opsets: Mapping[str, int], seed: int) -> NodeCheck | None:
    """Check ``rule`` on ``node`` alone; the first disagreeing input, or ``None`` if all agree."""
    rng = np.random.default_rng([seed, 2])
    proto, wrt_names, cot_names, out_names = _node_model(node, rule, wrt, needed, values, opsets)
    prec, session = _session_in_best_dtype(proto, True)
    dtype = prec.dtype
    if prec.keep32:  # the node itself has no float64 kernel: check it in float32
        dtype, session = "float32", _new_session(proto)
    feeds = _cast_feeds({i.name: values[i.name] for i in session.get_inputs() if i.name in values}, dtype)
    if node.op_type in _KINKS:
        # At a tie (MaxPool over a window of Relu zeros) or a kink there is no derivative to
        # compare with; a rule must be right at any point, so check it at a jittered one.
        for w in wrt_names:
            x = feeds[w]
            scale = float(np.sqrt(np.mean(np.square(x[np.isfinite(x)])))) if np.isfinite(x).any() else 1.0
            jitter = 1e-3 * max(scale, 1e-3) * rng.standard_normal(x.shape)
            feeds[w] = np.where(np.isfinite(x), x + jitter, x).astype(x.dtype)
    cots = {}
    for c, o in zip(cot_names, out_names, strict=True):
        cots[c] = rng.standard_normal(values[o].shape).astype(np.float64 if dtype == "float64" else np.float32)
    outputs = [*out_names, *(f"check/grad/{w}" for w in wrt_names)]
    base = _run(session, outputs, {**feeds, **cots})
    grads = dict(zip(wrt_names, base[len(out_names):], strict=True))

    def objective(shifted: Mapping[str, np.ndarray]) -> float:
        ys = _run(session, out_names, {**shifted, **cots})
        total = 0.0
        for y, c in zip(ys, cot_names, strict=True):
            y = np.asarray(y, np.float64)
            # -inf entries (masked attention scores) stay -inf under the perturbation: skip them.
            total += float(np.sum(np.where(np.isfinite(y), y, 0.0) * cots[c].astype(np.float64)))
        return total

    eps, rtol = _EPS[dtype], NODE_RTOL[dtype]
    f0 = abs(objective(feeds))
    for w in wrt_names:
        x = np.asarray(feeds[w], np.float64)
        finite = np.isfinite(x)  # attention masks hold -inf: leave those entries alone
        g = np.where(finite, np.nan_to_num(np.asarray(grads[w], np.float64)), 0.0)
        d = np.where(finite, _direction(g, rng), 0.0)
        analytic = float(np.dot(g.reshape(-1), d.reshape(-1)))
        # As for parameters: the step moves the objective by a fixed fraction (an input with a
        # large common offset, like equal logits of 1e11, must not be stepped by its norm).
        h = NODE_STEP[dtype] * max(f0, 1.0) / max(abs(analytic), 1e-12)
        h = min(h, 0.1 * max(float(np.linalg.norm(np.where(finite, x, 0.0))), 1.0))

        def f(t: float, w: str = w, x: np.ndarray = x, d: np.ndarray = d) -> float:
            return objective({**feeds, w: (x + t * d).astype(feeds[w].dtype)})

        noise = 100 * eps * max(f0, 1.0)
        numeric, rel = _central(f, analytic, h, noise)
        if rel <= rtol:
            continue
        other, _ = _central(f, analytic, h / 4, noise)
        spread = abs(numeric - other) / max(abs(numeric), abs(other), noise / h)
        if not rel <= 3 * spread:  # a NaN is a disagreement too
            return NodeCheck(node.name or "", node.op_type, rule.key, w, analytic, numeric, rel, dtype)
    return None


def _node_model(node: ir.Node, rule: registry.GradientRule, wrt: set[ir.Value], needed: set[ir.Value],
                values: Mapping[str, np.ndarray], opsets: Mapping[str, int]) -> tuple[onnx.ModelProto, list[str], list[str], list[str]]:
    """One forward node, its rule applied to cotangent inputs, and every gradient as an output."""
    mapping: dict[ir.Value, ir.Value] = {}
    graph_inputs: list[ir.Value] = []
    initializers: list[ir.Value] = []
    for v in node.inputs:
        if v is None or v in mapping:
            continue
        const = None if v.is_graph_input() else ir.convenience.get_const_tensor(v)
        if const is not None:
            array = np.asarray(const.numpy())
            new = ir.Value(name=v.name, const_value=ir.tensor(array, name=v.name),
                           type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=ir.Shape(array.shape))
            initializers.append(new)
        else:
            array = values[v.name or ""]
            new = ir.Value(name=v.name, type=ir.TensorType(v.dtype or ir.DataType.from_numpy(array.dtype)),
                           shape=ir.Shape(array.shape))
            graph_inputs.append(new)
        mapping[v] = new
    copy = ir.Node(node.domain, node.op_type, [mapping.get(v) if v is not None else None for v in node.inputs],
                   attributes=list(node.attributes.values()), num_outputs=len(node.outputs), name=node.name)
    out_names, cot_names, dys = [], [], []
    for old, new in zip(node.outputs, copy.outputs, strict=True):
        new.name, new.dtype = old.name, old.dtype
        if old.name in values:
            new.shape = ir.Shape(values[old.name].shape)
        if old in needed and old.dtype in FLOAT_TYPES and old.name in values:
            cot = ir.Value(name=f"check/cot/{old.name}", type=ir.TensorType(old.dtype), shape=new.shape)
            graph_inputs.append(cot)
            out_names.append(old.name or "")
            cot_names.append(cot.name or "")
            dys.append(cot)
        else:
            dys.append(None)
    graph = ir.Graph(graph_inputs, [], nodes=[copy], initializers=initializers, opset_imports=dict(opsets), name="check_node")
    ctx = GradContext(graph, scope="check")
    ctx.node = copy
    ctx.needed = [v is not None and v in wrt for v in node.inputs]
    per_value: dict[ir.Value, list[ir.Value]] = {}
    for inp, grad in input_gradients(ctx, copy, rule, dys):
        per_value.setdefault(inp, []).append(grad)
    for v in copy.outputs:
        if v.name in out_names:
            graph.outputs.append(v)
    wrt_names = []
    for inp, parts in per_value.items():
        total = parts[0] if len(parts) == 1 else ctx.op("Sum", *parts)
        out = _identity(graph, total, f"check/grad/{inp.name}")
        graph.outputs.append(out)
        wrt_names.append(inp.name or "")
    model = ir.Model(graph, ir_version=10)
    return ir.to_proto(model), wrt_names, cot_names, out_names
