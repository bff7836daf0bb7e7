"""Localization: when a parameter fails, which node's gradient rule is wrong.

Every node on the backward path is checked alone, closest to the loss first: its rule is
applied to the node's real forward values and a random output cotangent, and each input
cotangent is compared with finite differences of ``<cotangent, node(x)>``. The failing node
closest to the loss is where the backward pass first goes wrong. Ops with ties or kinks
(MaxPool, Relu, Max, ...) are checked at slightly jittered inputs, where a derivative exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE
from mpgraph.autodiff import registry
from mpgraph.autodiff.driver import GradContext, input_gradients
from mpgraph.check_grad.fd import central, direction
from mpgraph.check_grad.graphs import forward_model, identity
from mpgraph.check_grad.precision import (
    EPS,
    NODE_RTOL,
    NODE_STEP,
    cast_feeds,
    session_in_best_dtype,
)
from mpgraph.check_grad.report import NodeCheck, Progress
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.runtime.check_runs import CheckSession, ort_message

__all__ = ["localize"]

logger = logging.getLogger(__name__)

#: Ops whose derivative jumps at ties or kinks: node checks run at a jittered point.
_KINKS = frozenset({"MaxPool", "GlobalMaxPool", "ReduceMax", "ReduceMin", "Max", "Min", "Relu", "LeakyRelu",
                    "PRelu", "Clip", "Abs", "TopK", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Sign"})
_Path = list[tuple[ir.Node, registry.GradientRule]]


def localize(step: ir.Model, loss_name: str, params: Sequence[str], feeds: Mapping[str, np.ndarray], dtype: str,
             seed: int, progress: Progress | None) -> tuple[list[NodeCheck], int, list[str]]:
    """Check every node on the backward path alone.

    Returns:
        The disagreeing nodes (closest to the loss first), how many nodes were checked, and
        the nodes that could not be checked alone (with why).
    """
    graph = step.graph
    loss = next(v for v in graph.outputs if v.name == loss_name)
    path, active, needed = _backward_path(graph, loss, set(params))
    values = _forward_values(step, loss_name, path, feeds, dtype)
    bad: list[NodeCheck] = []
    skipped: list[str] = []
    for k, (node, rule) in enumerate(path):
        try:
            result = _check_node(node, rule, active & needed, needed, values, graph.opset_imports, seed + k)
        except Exception as e:  # noqa: BLE001 - a node that cannot be isolated is reported, not fatal
            logger.info("node %s not checked alone: %s", node.name, e)
            skipped.append(f"{node.name} ({ort_message(e)[:80]})")
            result = None
        if result is not None:
            bad.append(result)
        if progress is not None:
            progress("nodes", k + 1, len(path))
    return bad, len(path), skipped


def _backward_path(graph: ir.Graph, loss: ir.Value, params: set[str]) -> tuple[_Path, set[ir.Value], set[ir.Value]]:
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


def _forward_values(step: ir.Model, loss_name: str, path: _Path, feeds: Mapping[str, np.ndarray],
                    dtype: str) -> dict[str, np.ndarray]:
    """One forward run exposing every value the checked nodes read or write."""
    wanted: list[str] = []
    for node, _ in path:
        for v in [*node.inputs, *node.outputs]:
            if v is not None and v.name and v.producer() is not None and v.producer().op_type != "Constant" and v.name not in wanted:
                wanted.append(v.name)
    names = [loss_name, *wanted]
    fwd = forward_model(step, names)
    prec, session = session_in_best_dtype(fwd, dtype == "float64", {k: tuple(v.shape) for k, v in feeds.items()})
    fed = cast_feeds(feeds, prec.dtype)
    values = dict(zip(names, session.run(names, fed), strict=True))
    values.update(fed)
    for v in step.graph.inputs:  # state inputs the check does not feed (running statistics)
        if v.name not in values and v.const_value is not None:
            values[v.name or ""] = cast_feeds({"_": np.asarray(v.const_value.numpy())}, prec.dtype)["_"]
    return values


def _check_node(node: ir.Node, rule: registry.GradientRule, wrt: set[ir.Value], needed: set[ir.Value],
                values: Mapping[str, np.ndarray], opsets: Mapping[str, int], seed: int) -> NodeCheck | None:
    """Check ``rule`` on ``node`` alone; the first disagreeing input, or ``None`` if all agree."""
    rng = np.random.default_rng([seed, 2])
    model, wrt_names, cot_names, out_names = _node_model(node, rule, wrt, needed, values, opsets)
    prec, session = session_in_best_dtype(model, True)
    dtype = prec.dtype
    if prec.keep32:  # the node itself has no float64 kernel: check it in float32
        dtype, session = "float32", CheckSession(model)
    fed = [v.name or "" for v in model.graph.inputs if v.name in values]
    feeds = cast_feeds({name: values[name] for name in fed}, dtype)
    if node.op_type in _KINKS:
        _jitter(feeds, wrt_names, rng)
    cots = {c: rng.standard_normal(values[o].shape).astype(np.float64 if dtype == "float64" else np.float32)
            for c, o in zip(cot_names, out_names, strict=True)}
    base = session.run([*out_names, *(f"check/grad/{w}" for w in wrt_names)], {**feeds, **cots})
    grads = dict(zip(wrt_names, base[len(out_names):], strict=True))

    def objective(shifted: Mapping[str, np.ndarray]) -> float:
        total = 0.0
        for y, c in zip(session.run(out_names, {**shifted, **cots}), cot_names, strict=True):
            y = np.asarray(y, np.float64)
            # -inf entries (masked attention scores) stay -inf under the perturbation: skip them.
            total += float(np.sum(np.where(np.isfinite(y), y, 0.0) * cots[c].astype(np.float64)))
        return total

    f0 = abs(objective(feeds))
    for w in wrt_names:
        rel = _input_error(objective, feeds, w, np.asarray(grads[w], np.float64), f0, dtype, rng)
        if rel is not None:
            return NodeCheck(node.name or "", node.op_type, rule.key, w, *rel, dtype)
    return None


def _jitter(feeds: dict[str, np.ndarray], names: Sequence[str], rng: np.random.Generator) -> None:
    """At a tie (MaxPool over a window of Relu zeros) or a kink there is no derivative to
    compare with; a rule must be right at any point, so check it at a jittered one."""
    for w in names:
        x = feeds[w]
        scale = float(np.sqrt(np.mean(np.square(x[np.isfinite(x)])))) if np.isfinite(x).any() else 1.0
        jitter = 1e-3 * max(scale, 1e-3) * rng.standard_normal(x.shape)
        feeds[w] = np.where(np.isfinite(x), x + jitter, x).astype(x.dtype)


def _input_error(objective: Callable[[Mapping[str, np.ndarray]], float], feeds: Mapping[str, np.ndarray], w: str, grad: np.ndarray,
                 f0: float, dtype: str, rng: np.random.Generator) -> tuple[float, float, float] | None:
    """``(analytic, numeric, rel_error)`` when input ``w``'s cotangent disagrees with finite
    differences of ``objective`` beyond their own spread; ``None`` when it agrees."""
    x = np.asarray(feeds[w], np.float64)
    finite = np.isfinite(x)  # attention masks hold -inf: leave those entries alone
    g = np.where(finite, np.nan_to_num(grad), 0.0)
    d = np.where(finite, direction(g, rng), 0.0)
    analytic = float(np.dot(g.reshape(-1), d.reshape(-1)))
    # As for parameters: the step moves the objective by a fixed fraction (an input with a
    # large common offset, like equal logits of 1e11, must not be stepped by its norm).
    h = NODE_STEP[dtype] * max(f0, 1.0) / max(abs(analytic), 1e-12)
    h = min(h, 0.1 * max(float(np.linalg.norm(np.where(finite, x, 0.0))), 1.0))

    def f(t: float) -> float:
        return objective({**feeds, w: (x + t * d).astype(feeds[w].dtype)})

    noise = 100 * EPS[dtype] * max(f0, 1.0)
    numeric, rel = central(f, analytic, h, noise)
    if rel <= NODE_RTOL[dtype]:
        return None
    other, _ = central(f, analytic, h / 4, noise)
    spread = abs(numeric - other) / max(abs(numeric), abs(other), noise / h)
    return None if rel <= 3 * spread else (analytic, numeric, rel)  # a NaN is a disagreement too


def _node_model(node: ir.Node, rule: registry.GradientRule, wrt: set[ir.Value], needed: set[ir.Value],
                values: Mapping[str, np.ndarray], opsets: Mapping[str, int]) -> tuple[ir.Model, list[str], list[str], list[str]]:
    """One forward node, its rule applied to cotangent inputs, and every gradient as an output."""
    graph = ir.Graph([], [], nodes=[], opset_imports=dict(opsets), name="check_node")
    mapping = _node_inputs(node, graph, values)
    copy = ir.Node(node.domain, node.op_type, [mapping.get(v) if v is not None else None for v in node.inputs],
                   attributes=list(node.attributes.values()), num_outputs=len(node.outputs), name=node.name)
    graph.append(copy)
    out_names, cot_names, dys = [], [], []
    for old, new in zip(node.outputs, copy.outputs, strict=True):
        new.name, new.dtype = old.name, old.dtype
        if old.name in values:
            new.shape = ir.Shape(values[old.name].shape)
        dy = None
        if old in needed and old.dtype in FLOAT_TYPES and old.name in values:
            dy = ir.Value(name=f"check/cot/{old.name}", type=ir.TensorType(old.dtype), shape=new.shape)
            graph.inputs.append(dy)
            graph.outputs.append(new)
            out_names.append(old.name or "")
            cot_names.append(dy.name or "")
        dys.append(dy)
    ctx = GradContext(graph, scope="check")
    ctx.node = copy
    ctx.needed = [v is not None and v in wrt for v in node.inputs]
    per_value: dict[ir.Value, list[ir.Value]] = {}
    for inp, grad in input_gradients(ctx, copy, rule, dys):
        per_value.setdefault(inp, []).append(grad)
    wrt_names = []
    for inp, parts in per_value.items():
        total = parts[0] if len(parts) == 1 else ctx.op("Sum", *parts)
        graph.outputs.append(identity(graph, total, f"check/grad/{inp.name}"))
        wrt_names.append(inp.name or "")
    return ir.Model(graph, ir_version=10), wrt_names, cot_names, out_names


def _node_inputs(node: ir.Node, graph: ir.Graph, values: Mapping[str, np.ndarray]) -> dict[ir.Value, ir.Value]:
    """Copies of ``node``'s inputs in ``graph``: constants as initializers, the rest as graph
    inputs shaped like their forward values."""
    mapping: dict[ir.Value, ir.Value] = {}
    for v in node.inputs:
        if v is None or v in mapping:
            continue
        const = None if v.is_graph_input() else ir.convenience.get_const_tensor(v)
        if const is not None:
            array = np.asarray(const.numpy())
            new = ir.Value(name=v.name, const_value=ir.tensor(array, name=v.name),
                           type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=ir.Shape(array.shape))
            graph.register_initializer(new)
        else:
            array = values[v.name or ""]
            new = ir.Value(name=v.name, type=ir.TensorType(v.dtype or ir.DataType.from_numpy(array.dtype)),
                           shape=ir.Shape(array.shape))
            graph.inputs.append(new)
        mapping[v] = new
    return mapping
