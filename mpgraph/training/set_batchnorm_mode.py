"""BatchNormalization in a training step: batch statistics, running statistics as state."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role
from mpgraph.errors import GradientError, UnsupportedModelError

__all__ = ["BATCHNORM_MODES", "SetBatchNormModePass", "StateResult", "training_batchnorms"]

logger = logging.getLogger(__name__)

#: ``batchnorm=`` choices of ``build_training_graph`` and ``train-graph --batchnorm``.
BATCHNORM_MODES = ("train", "train-ops", "eval")


@dataclasses.dataclass
class StateResult(ir.passes.PassResult):
    """``PassResult`` with ``(running statistic input, its update)`` pairs: step state."""

    state: list[tuple[ir.Value, ir.Value]] = dataclasses.field(default_factory=list)


class SetBatchNormModePass(ir.passes.InPlacePass):
    """Run every BatchNormalization in training mode (or eval mode), as the step needs.

    Rules, per BatchNormalization node:

    1. ``eval``: ``training_mode=0``; unused statistics outputs are dropped. No state.
    2. ``train``: ``training_mode=1`` with three outputs. Its running mean and variance
       become graph inputs, each paired as state with the updated statistic (ONNX semantics:
       the running variance is updated with the biased batch variance).
    3. A running statistic that another node, slot or graph output shares is copied to an
       initializer of the node's own (``<node>/running_mean``); a shared graph input without
       a value, or one statistic computed and the other not, is an error.
    3a. A node whose mean and variance are both computed stays in eval form, with no state:
       they are batch statistics (torch's dynamo exporter writes a BatchNorm without running
       statistics, ``track_running_stats=False``, as ReduceMeans feeding the eval-form node),
       and the gradient flows through them.
    4. ``train-ops``: as ``train``, then the node is replaced by the ops of its definition
       (ReduceMean, Sub, Mul, Sqrt...): ONNX Runtime's CUDA provider refuses
       ``BatchNormalization(training_mode=1)`` at opset >= 14.
    5. In a model torch wrote (producer ``pytorch``), the running variance is updated as torch
       updates it, with the unbiased batch variance (``n / (n - 1)`` times the biased one, ``n``
       the values per channel). Both torch exporters write a train-mode BatchNorm in eval form
       (one output, no ``training_mode``); rule 2 gives it back its batch statistics, this rule
       its torch running statistics. On HF ResNet's 2x16x16 stem the ONNX update is 9e-5 off
       torch's, on its 2x4x4 layers up to 6e-3.

    Example:
        >>> import numpy as np
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 2]))
        >>> stats = [ir.Value(name=n, const_value=ir.tensor(np.float32([0, 1]), name=n)) for n in "sbmv"]
        >>> bn = ir.Node("", "BatchNormalization", [x, *stats], name="bn")
        >>> bn.outputs[0].name = "y"
        >>> graph = ir.Graph([x], bn.outputs, nodes=[bn], initializers=stats, opset_imports={"": 18})
        >>> result = SetBatchNormModePass("train")(ir.Model(graph, ir_version=8))
        >>> result.modified, [(a.name, b.name) for a, b in result.state]
        (True, [('m', 'bn/output_1'), ('v', 'bn/output_2')])
    """

    def __init__(self, mode: str = "train") -> None:
        super().__init__()
        if mode not in BATCHNORM_MODES:
            raise GradientError(f"batchnorm must be 'train', 'train-ops' or 'eval', got '{mode}'")
        self.mode = mode

    def call(self, model: ir.Model) -> StateResult:
        graph = model.graph
        # Copies and constants are named loss/..., the names step graphs have always had.
        ctx = Builder(graph, role=Role.FORWARD, scope="loss")
        state: list[tuple[ir.Value, ir.Value]] = []
        modified = False
        unbiased = model.producer_name == "pytorch"
        for node in list(graph):
            if node.op_type != "BatchNormalization":
                continue
            if self.mode == "eval" or _computed_statistics(node):
                modified = _eval(node) or modified
                continue
            before = _footprint(graph, node)
            modified = _set_training_mode(node, 1) or modified
            pairs = _train(graph, node, ctx)
            modified = modified or before != _footprint(graph, node)
            if self.mode == "train-ops":
                pairs = _decompose_batchnorm(graph, node, ctx, unbiased)
                modified = True
            elif unbiased:
                pairs[1] = (pairs[1][0], _unbias_running_var(graph, node, ctx))
                modified = True
            state.extend((stat, out) for stat, out in pairs if stat is not None)
        return StateResult(model, modified, state)


def training_batchnorms(model: ir.Model) -> int:
    """How many BatchNormalization nodes of ``model`` run in training mode (ORT CPU only)."""
    return sum(n.op_type == "BatchNormalization" and n.attributes.get_int("training_mode", 0) == 1 for n in model.graph)


def _computed_statistics(node: ir.Node) -> bool:
    """Rule 3a: both statistics are computed by nodes (neither initializer nor graph input)."""
    stats = node.inputs[3:5]
    return len(stats) == 2 and all(v is not None and not v.is_initializer() and not v.is_graph_input() for v in stats)


def _footprint(graph: ir.Graph, node: ir.Node) -> tuple[object, ...]:
    """What rules 2 and 3 may change besides the attribute: outputs, inputs, initializers."""
    return [o.name for o in node.outputs], list(node.inputs), len(graph.inputs), len(graph.initializers)


def _set_training_mode(node: ir.Node, mode: int) -> bool:
    """Set ``training_mode``; returns whether the node changed."""
    before = node.attributes.get("training_mode")
    node.attributes["training_mode"] = ir.AttrInt64("training_mode", mode)
    return before is None or before.value != mode


def _eval(node: ir.Node) -> bool:
    """Rule 1; returns whether the node changed."""
    changed = _set_training_mode(node, 0)
    if len(node.outputs) > 1 and not any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        node.resize_outputs(1)
        changed = True
    return changed


def _train(graph: ir.Graph, node: ir.Node, ctx: Builder) -> list[tuple[ir.Value | None, ir.Value]]:
    """Rules 2 and 3: three outputs, named statistics, running statistics as graph inputs."""
    if len(node.outputs) < 3:
        node.resize_outputs(3)
    for k, what in ((1, "mean"), (2, "var")):
        out, stat = node.outputs[k], _own_running_stat(node, k + 2, what, ctx)
        if not out.name:
            out.name = ctx.unique(f"{node.name}/output_{k}")
        if not stat.is_graph_input():
            graph.inputs.append(stat)
    return [(node.inputs[3], node.outputs[1]), (node.inputs[4], node.outputs[2])]


def _own_running_stat(node: ir.Node, slot: int, what: str, ctx: Builder) -> ir.Value:
    """The running statistic at input ``slot`` of ``node``, as a value only this node uses.

    Every training-mode BatchNormalization needs its running statistics as state: ONNX Runtime
    computes a wrong normalization when the updated statistics are unused (with its default
    optimizations) or when a running statistic is the same tensor as the scale or bias (even
    with none), and a statistic shared with a parameter or another node would be updated twice.
    So a shared initializer is copied, and a computed statistic is refused.
    """
    stat = node.inputs[slot]
    if stat is None:
        raise UnsupportedModelError(f"BatchNormalization node '{node.name}' has no running {what}")
    if not stat.is_initializer() and not stat.is_graph_input():
        raise UnsupportedModelError(
            f"BatchNormalization node '{node.name}': its running {what} '{stat.name}' is computed, not an "
            "initializer or graph input; export it as an initializer, or pass --batchnorm eval"
        )
    shared = stat.is_graph_output() or any(user is not node or index != slot for user, index in stat.uses())
    if not shared:
        return stat
    if stat.const_value is None:
        raise UnsupportedModelError(
            f"BatchNormalization node '{node.name}': its running {what} '{stat.name}' is a graph input that "
            "other nodes use too; give the node its own running statistics"
        )
    name = ctx.unique(f"{node.name}/running_{what}")
    own = ctx.tape.initializer(ir.tensor(stat.const_value.numpy(), name=name))
    node.replace_input_with(slot, own)
    logger.info("BatchNormalization '%s': running %s '%s' is shared; it gets its own state '%s'", node.name, what, stat.name, name)
    return own


def _momentum(node: ir.Node) -> float:
    """The weight of the old running statistic (ONNX's default 0.9)."""
    momentum = node.attributes.get("momentum")
    return float(momentum.value) if momentum is not None else 0.9


def _bessel(ops: Builder, x: ir.Value, scale: ir.Value) -> ir.Value:
    """``n / (n - 1)`` with ``n`` the values per channel of ``x``: ``Size(x) / Size(scale)``."""
    dtype = x.dtype or ir.DataType.FLOAT
    n = ops.op("Cast", ops.op("Div", ops.op("Size", x), ops.op("Size", scale)), to=dtype)
    return ops.op("Div", n, ops.op("Sub", n, ops.const(np.array(1, dtype=dtype.numpy()))))


def _unbias_running_var(graph: ir.Graph, node: ir.Node, ctx: Builder) -> ir.Value:
    """Rule 5 for a BatchNormalization node: its running variance update as torch makes it.

    The node's update is ``old * m + var * (1 - m)`` with the biased batch variance; torch's
    is ``old * m + (update - old * m) * n / (n - 1)``, written after the node. ONNX Runtime's
    CPU kernel writes an updated running variance that is not a graph output into its input's
    buffer (the caller's feed, too: ``tests/test_dynamo_vision.py``), so a node that read
    ``old`` after it ran would read the update: the node gets a copy (``old * 1``) of its own,
    made before it.
    """
    x, scale, var_in = node.inputs[0], node.inputs[1], node.inputs[4]
    assert x is not None and scale is not None and var_in is not None
    ops = Builder(graph, role=Role.FORWARD, scope=f"{node.name}/torch_running_var", names=ctx.names)
    dtype = (x.dtype or ir.DataType.FLOAT).numpy()
    copy = ops.op("Mul", var_in, ops.const(np.array(1, dtype=dtype)), name="copy")
    copy.shape, copy.dtype = var_in.shape, var_in.dtype
    graph.remove(copy.producer())
    graph.insert_before(node, copy.producer())
    node.replace_input_with(4, copy)
    kept = ops.op("Mul", var_in, ops.const(np.array(_momentum(node), dtype=dtype)))
    return ops.op("Add", kept, ops.op("Mul", ops.op("Sub", node.outputs[2], kept), _bessel(ops, x, scale)))


def _decompose_batchnorm(graph: ir.Graph, node: ir.Node, ctx: Builder,
                         unbiased: bool) -> list[tuple[ir.Value | None, ir.Value]]:
    """Replace a training-mode BatchNormalization with the ops of its definition (ONNX opset 15).

    ``Y = (X - mean) / sqrt(var + eps) * scale + B`` with the batch mean and biased variance
    over every axis but 1; ``running = running * momentum + batch * (1 - momentum)``, with the
    batch variance unbiased when ``unbiased`` (rule 5).
    """
    x, scale, bias, mean_in, var_in = node.inputs[:5]
    assert x is not None and scale is not None and bias is not None and mean_in is not None and var_in is not None
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise UnsupportedModelError(f"BatchNormalization node '{node.name}': train-ops needs the input rank")
    eps = node.attributes.get("epsilon")
    eps_v = float(eps.value) if eps is not None else 1e-5
    mom_v = _momentum(node)
    reduce_axes = ctx.const(np.array([0, *range(2, rank)], dtype=np.int64))
    channel_axes = ctx.const(np.array([0, *range(2, rank)], dtype=np.int64))
    flat = ctx.const(np.array([-1], dtype=np.int64))
    ops = Builder(graph, role=Role.FORWARD, scope=f"{node.name}/bn", names=ctx.names)

    def op(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        return ops.op(op_type, *inputs, name=op_type, **attrs)

    def scalar(value: float) -> ir.Value:
        return ctx.const(np.array(value, dtype=(x.dtype or ir.DataType.FLOAT).numpy()))

    mean = op("ReduceMean", x, reduce_axes, keepdims=1)
    centered = op("Sub", x, mean)
    var = op("ReduceMean", op("Mul", centered, centered), reduce_axes, keepdims=1)
    normed = op("Mul", centered, op("Reciprocal", op("Sqrt", op("Add", var, scalar(eps_v)))))
    y = op("Add", op("Mul", normed, op("Unsqueeze", scale, channel_axes)), op("Unsqueeze", bias, channel_axes))
    rm = op("Add", op("Mul", mean_in, scalar(mom_v)), op("Mul", op("Reshape", mean, flat), scalar(1 - mom_v)))
    batch_var = op("Reshape", var, flat)
    if unbiased:
        batch_var = op("Mul", batch_var, _bessel(ops, x, scale))
    rv = op("Add", op("Mul", var_in, scalar(mom_v)), op("Mul", batch_var, scalar(1 - mom_v)))
    # The Builder appends; the definition goes where the node was.
    graph.remove(ops.tape.nodes)
    graph.insert_before(node, ops.tape.nodes)
    for old, new in zip(node.outputs, (y, rm, rv)):
        name = old.name
        new.shape = old.shape
        dtype = old.dtype or x.dtype
        if dtype is not None:
            new.dtype = dtype
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = None
        new.name = name
    graph.remove(node, safe=True)
    return [(mean_in, rm), (var_in, rv)]
