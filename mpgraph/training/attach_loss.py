"""Find the loss of a forward model, or attach a built-in one."""

from __future__ import annotations

import dataclasses
import logging

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.contract import LOSS_OPS
from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import GradientError

__all__ = ["BUILTIN_LOSSES", "LOSS_OPS", "AttachLossPass", "LossResult", "find_logits"]

logger = logging.getLogger(__name__)

BUILTIN_LOSSES = ("cross_entropy", "mse")


@dataclasses.dataclass
class LossResult(ir.passes.PassResult):
    """``PassResult`` with the scalar loss value."""

    loss: ir.Value | None = None


class AttachLossPass(ir.passes.InPlacePass):
    """Pick the loss of a forward model, attaching a built-in loss when asked.

    Rules:

    1. ``loss=None`` picks the output named ``loss``, else the only output when it is a float
       scalar; otherwise it is an error listing the outputs.
    2. ``loss="<output name>"`` picks that output, which must be float.
    3. ``cross_entropy`` attaches ``SoftmaxCrossEntropyLoss`` (mean) to the first float output:
       classes on the last axis, and a new int64 input ``label`` shaped like the output
       without that axis (rank > 2 logits are flattened to ``[positions, classes]``).
    4. ``mse`` attaches ``ReduceMean((out - label)^2)`` with a new float input ``label``
       shaped like the first float output.
    5. Any other name is an error listing the outputs and the built-in losses.
    6. Roles: every node is ``forward``, except the attached loss nodes, or for a loss output
       the loss op (``LOSS_OPS``) and the nodes between it and the output, which are ``loss``.
       The graph outputs are left as they are.

    Example:
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 3]))
        >>> neg = ir.Node("", "Neg", [x], name="neg")
        >>> neg.outputs[0].name, neg.outputs[0].dtype = "y", ir.DataType.FLOAT
        >>> graph = ir.Graph([x], neg.outputs, nodes=[neg], opset_imports={"": 18})
        >>> result = AttachLossPass("mse")(ir.Model(graph, ir_version=8))
        >>> result.loss.name, [v.name for v in graph.inputs], [n.op_type for n in graph]
        ('loss', ['x', 'label'], ['Neg', 'Sub', 'Mul', 'ReduceMean'])
    """

    def __init__(self, loss: str | None = None) -> None:
        super().__init__()
        self.loss = loss

    def call(self, model: ir.Model) -> LossResult:
        graph = model.graph
        roles = [n.metadata_props.get(NODE_ROLE) for n in graph]
        for node in graph:
            node.metadata_props[NODE_ROLE] = Role.FORWARD
        loss = self.loss if self.loss is not None else _default_loss(graph)
        outputs = {v.name: v for v in graph.outputs}
        if loss in outputs:
            value = outputs[loss]
            if value.dtype not in FLOAT_TYPES:
                raise GradientError(f"loss output '{loss}' is {value.dtype}, not a float tensor")
            loss_nodes = _loss_nodes(value)
        else:
            before = len(graph)
            value = _attach_builtin(graph, loss, Builder(graph, role=Role.LOSS, scope="loss"))
            loss_nodes = list(graph)[before:]
        for node in loss_nodes:
            node.metadata_props[NODE_ROLE] = Role.LOSS
        modified = len(roles) != len(graph) or roles != [n.metadata_props.get(NODE_ROLE) for n in graph]
        return LossResult(model, modified, value)


def find_logits(graph: ir.Graph) -> str | None:
    """The logits of a step graph: the value named ``logits``, else the scores of the loss op.

    ``None`` when the graph has neither (an mse loss on an output not named ``logits``).

    Example:
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 3]))
        >>> label = ir.Value(name="label", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["N"]))
        >>> ce = ir.Node("", "SoftmaxCrossEntropyLoss", [x, label], name="ce")
        >>> find_logits(ir.Graph([x, label], ce.outputs, nodes=[ce]))
        'x'
    """
    if any(v.name == "logits" for node in graph for v in node.outputs):
        return "logits"
    for node in graph:
        if node.op_type in LOSS_OPS and node.inputs[0] is not None and node.inputs[0].name:
            return node.inputs[0].name
    return None


def _attach_builtin(graph: ir.Graph, loss: str, ctx: Builder) -> ir.Value:
    """Rules 3 to 5: the attached loss value, named ``loss`` (or ``loss_<k>``)."""
    if loss not in BUILTIN_LOSSES:
        raise GradientError(
            f"unknown loss '{loss}'; pass --loss with one of the outputs ({_listing(graph)}), "
            "or --loss cross_entropy / --loss mse to attach one to the first float output"
        )
    logits = next((v for v in graph.outputs if v.dtype in FLOAT_TYPES), None)
    if logits is None:
        raise GradientError("cannot attach a loss: the model has no float output")
    rank = len(logits.shape) if logits.shape is not None else None
    label_name = ctx.unique("label")
    if loss == "cross_entropy":
        if rank is None or rank < 2:
            raise GradientError(f"cross_entropy needs logits of rank >= 2; '{logits.name}' has rank {rank}")
        # Classes on the last axis (torch/Keras convention: [batch, ..., classes]); the label
        # holds one class index per position, shaped like the logits without that axis.
        label = ir.Value(name=label_name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(list(logits.shape or ())[:-1]))
        scores, target = logits, label
        if rank > 2:
            scores = ctx.op("Flatten", logits, axis=rank - 1)
            target = ctx.op("Reshape", label, ctx.ints([-1]))
        value = ctx.op("SoftmaxCrossEntropyLoss", scores, target, reduction="mean")
    else:
        label = ir.Value(name=label_name, type=ir.TensorType(logits.dtype or ir.DataType.FLOAT), shape=logits.shape)
        diff = ctx.op("Sub", logits, label)
        value = ctx.op("ReduceMean", ctx.op("Mul", diff, diff), keepdims=0)
    graph.inputs.append(label)
    value.name = ctx.unique("loss")
    return value


def _listing(graph: ir.Graph) -> str:
    return ", ".join(f"{v.name} {_describe(v)}" for v in {v.name: v for v in graph.outputs}.values() if v.name)


def _describe(value: ir.Value) -> str:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    return f"{dtype}[{', '.join(str(d) for d in value.shape)}]" if value.shape is not None else dtype


def _is_scalar(value: ir.Value) -> bool:
    return value.shape is not None and all(d == 1 for d in value.shape)


def _default_loss(graph: ir.Graph) -> str:
    """Rule 1: the output named ``loss``, else the only output when it is a float scalar.

    Neither torch exporter names a loss output ``loss`` (TorchScript numbers it, ``233``;
    dynamo names it after the op, ``cross_entropy_loss``), so a model whose only output is a
    float scalar is taken at its word.
    """
    if any(v.name == "loss" for v in graph.outputs):
        return "loss"
    only = graph.outputs[0] if len(graph.outputs) == 1 else None
    if only is not None and only.name and only.dtype in FLOAT_TYPES and _is_scalar(only):
        logger.info("using the only output '%s' (a float scalar) as the loss", only.name)
        return only.name
    raise GradientError(
        f"no loss: the model has no output named 'loss' and no single float scalar output; pass "
        f"--loss NAME with one of its outputs ({_listing(graph)}), or --loss cross_entropy / "
        "--loss mse to attach one to the first float output"
    )


def _loss_nodes(loss: ir.Value) -> list[ir.Node]:
    """The loss op that produces ``loss`` and the nodes between it and the loss output."""
    chain, node = [], loss.producer()
    while node is not None:
        chain.append(node)
        if node.op_type in LOSS_OPS:
            return chain
        floats = [v for v in node.inputs if v is not None and v.dtype in FLOAT_TYPES]
        node = floats[0].producer() if len(floats) == 1 else None
    return chain[:1]
