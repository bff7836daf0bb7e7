"""Give ``Where`` a full-size condition where ORT CUDA would broadcast it per element."""

from __future__ import annotations

import logging

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role

__all__ = ["ExpandWhereConditionsPass"]

logger = logging.getLogger(__name__)


def _dims(value: ir.Value) -> tuple[object, ...] | None:
    if value.shape is None:
        return None
    dims = tuple(d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in value.shape)
    return None if any(d is None for d in dims) else dims


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
    ``Where`` with the same condition and output shape (one per layer). Same values.

    Example: ``Where(mask[T,T], -inf, s[B,H,T,T])`` in each of 8 layers becomes one
    ``Expand(mask, Shape(s_0))`` and 8 ``Where(expanded, -inf, s_i)``.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        expanded: dict[tuple[int, tuple[object, ...]], ir.Value] = {}
        b = Builder(graph, role=Role.FORWARD, scope="expand")
        for node in [n for n in graph if n.op_type == "Where" and n.domain in ("", "ai.onnx")]:
            full = _full_input(node)
            if full is None:
                continue
            cond = node.inputs[0]
            assert cond is not None
            out_dims = _dims(node.outputs[0])
            assert out_dims is not None
            key = (id(cond), out_dims)
            if key not in expanded:
                value = b.op("Expand", cond, b.op("Shape", full), name=f"{node.name}/condition")
                value.shape, value.dtype = ir.Shape(node.outputs[0].shape), ir.DataType.BOOL
                made = b.tape.nodes[-2:]
                for made_node in made:
                    graph.remove(made_node)
                graph.insert_before(node, made)
                expanded[key] = value
            node.replace_input_with(0, expanded[key])
        logger.debug("expanded %d Where conditions", len(expanded))
        return ir.passes.PassResult(model, modified=bool(expanded))
