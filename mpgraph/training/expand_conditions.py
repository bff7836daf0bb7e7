"""Give ``Where`` a full-size condition where ORT CUDA would broadcast it per element."""

from __future__ import annotations

import logging

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role
from mpgraph.optypes import NONDETERMINISTIC_OPS

__all__ = ["ExpandWhereConditionsPass"]

logger = logging.getLogger(__name__)


def _dims(value: ir.Value) -> tuple[object, ...] | None:
    if value.shape is None:
        return None
    dims = tuple(d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in value.shape)
    return None if any(d is None for d in dims) else dims


#: How deep ``_structure`` follows producers before it stops calling two values equal.
_DEPTH = 24


def _attr_key(attr: ir.Attr) -> object:
    if attr.type == ir.AttributeType.TENSOR:
        tensor = attr.as_tensor()
        return (tensor.dtype, tuple(tensor.shape), tensor.tobytes())
    return repr(attr.value)


def _structure(value: ir.Value, memo: dict[ir.Value, object], depth: int = _DEPTH) -> object:
    """A key equal for two values exactly when they are computed the same way from the same
    graph inputs, initializers and constants (one key per value otherwise): each layer of an
    exported decoder slices its own copy of the causal mask from the same buffer.

    ``memo`` is keyed by the values themselves, not their ids: it keeps them alive, so no
    value the pass removes can pass its id on to a new one."""
    if value in memo:
        return memo[value]
    node = value.producer()
    key: object
    if node is None or depth == 0 or node.op_type in NONDETERMINISTIC_OPS or any(
        attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()
    ):
        key = ("value", id(value))
    else:
        attrs = tuple(sorted((name, _attr_key(attr)) for name, attr in node.attributes.items()))
        inputs = tuple(None if v is None else _structure(v, memo, depth - 1) for v in node.inputs)
        key = (node.op_type, node.domain, attrs, inputs, list(node.outputs).index(value))
    memo[value] = key
    return key


def _remove_dead(graph: ir.Graph, value: ir.Value) -> None:
    """Remove ``value``'s producer and, in turn, its producers, while nothing reads them."""
    outputs = set(graph.outputs)
    stack = [value]
    while stack:
        node = stack.pop().producer()
        if node is None or node.graph is not graph or any(o.uses() or o in outputs for o in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        stack += inputs


def _is_scalar(dims: tuple[object, ...]) -> bool:
    return all(d == 1 for d in dims)


def _full_input(node: ir.Node) -> ir.Value | None:
    """The data input with the output's shape, when the condition is the only input that
    ORT CUDA's ``Where`` must broadcast element by element; else ``None``.

    The data inputs must each be a scalar or of the output's shape (ORT's kernel reads
    those without index arithmetic), and the condition neither.
    """
    cond, x, y = node.inputs
    out = node.outputs[0]
    if cond is None or x is None or y is None:
        return None
    out_dims, cond_dims = _dims(out), _dims(cond)
    if out_dims is None or cond_dims is None or _is_scalar(cond_dims) or cond_dims == out_dims:
        return None
    full = None
    for value in (x, y):
        dims = _dims(value)
        if dims is None or not (_is_scalar(dims) or dims == out_dims):
            return None
        if dims == out_dims:
            full = value
    return full


class ExpandWhereConditionsPass(ir.passes.InPlacePass):
    """Expand a broadcast ``Where`` condition to the output's shape, once per condition.

    ORT CUDA's ``Where`` takes its index-free kernel only when each input is a scalar or of
    the output's shape. A causal mask ``[T, T]`` selecting over attention scores
    ``[B, H, T, T]`` takes the per-element broadcast path instead: 0.094 ms a call for the
    GPT benchmark's bfloat16 scores (``benchmarks/results/kernel_names_bf16_fp16.txt``).
    One ``Expand(cond, Shape(scores))`` before the first such ``Where`` serves every
    ``Where`` whose condition is computed the same way (``_structure``) and whose output has
    the same shape; conditions left unread are removed. Same values.

    Example: ``Where(mask_i[T,T], -inf, s_i[B,H,T,T])`` in each of 8 layers, each ``mask_i``
    sliced from the same buffer, becomes one ``Expand(mask_0, Shape(s_0))`` and 8
    ``Where(expanded, -inf, s_i)``: one Expand a step where shapes stay symbolic, none once
    ``Trainer`` fixes them for CUDA graph capture (ORT folds it into a constant).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        expanded: dict[tuple[object, tuple[object, ...]], ir.Value] = {}
        memo: dict[ir.Value, object] = {}
        b = Builder(graph, role=Role.FORWARD, scope="expand")
        for node in [n for n in graph if n.op_type == "Where" and n.domain in ("", "ai.onnx")]:
            full = _full_input(node)
            if full is None:
                continue
            cond = node.inputs[0]
            out_dims = _dims(node.outputs[0])
            assert cond is not None and out_dims is not None
            key = (_structure(cond, memo), out_dims)
            if key not in expanded:
                value = b.op("Expand", cond, b.op("Shape", full), name=f"{node.name}/condition")
                value.shape, value.dtype = ir.Shape(node.outputs[0].shape), ir.DataType.BOOL
                made = b.tape.nodes[-2:]
                for made_node in made:
                    graph.remove(made_node)
                graph.insert_before(node, made)
                expanded[key] = value
            node.replace_input_with(0, expanded[key])
            _remove_dead(graph, cond)
        logger.debug("expanded %d Where conditions", len(expanded))
        return ir.passes.PassResult(model, modified=bool(expanded))
