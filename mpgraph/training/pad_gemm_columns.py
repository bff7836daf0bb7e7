"""Pad the output columns of a weight GEMM to a multiple of 64 where tensor cores need it."""

from __future__ import annotations

import logging
import math

import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role

__all__ = ["ALIGN_TO", "MIN_COLUMNS", "PadGemmColumnsPass"]

logger = logging.getLogger(__name__)

#: The padded column count is a multiple of this (Inductor's ``pad_mm`` pads to the tensor-core
#: alignment; 64 also keeps every tile of a 64- or 128-wide kernel full but the last).
ALIGN_TO = 64
#: Column counts already a multiple of this need nothing: a 16-byte-aligned leading dimension
#: of 2-byte elements, what cuBLAS's aligned tensor-core kernels ask of every operand.
ALIGNED = 8
#: Narrower outputs are left alone: their GEMMs are small and padding adds up to 63 columns.
MIN_COLUMNS = 1024

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _static(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None or value.dtype not in _FLOATS:
        return None
    dims = [d if isinstance(d, int) else None for d in value.shape]
    return None if any(d is None for d in dims) else dims  # type: ignore[return-value]


def _columns(node: ir.Node) -> tuple[int, int] | None:
    """``(weight axis of the output columns, columns)`` of a GEMM whose weight operand is a
    static matrix with too many, unaligned columns; else ``None``."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    dims = _static(node.inputs[1])
    if dims is None or len(dims) != 2 or len(node.outputs[0].uses()) == 0 and not node.outputs[0].is_graph_output():
        return None
    axis = 1
    if node.op_type == "Gemm":
        trans_b = node.attributes.get("transB")
        axis = 0 if trans_b is not None and trans_b.as_int() else 1
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and (_static(bias) is None or len(_static(bias) or []) > 2):
            return None
    n = dims[axis]
    return (axis, n) if n >= MIN_COLUMNS and n % ALIGNED else None


def _bias_add(node: ir.Node, n: int) -> tuple[ir.Node, int] | None:
    """``(the Add, the slot of its bias)`` when ``node``'s output is read by that ``Add`` alone
    and its other operand is a static bias row of ``n`` columns of the output's type."""
    out = node.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output() or out.shape is None:
        return None
    add, index = uses[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2 or index not in (0, 1):
        return None
    bias = add.inputs[1 - index]
    dims = _static(bias)
    if bias is None or dims is None or not 1 <= len(dims) <= len(out.shape) or dims[-1] != n \
            or any(d != 1 for d in dims[:-1]) or bias.dtype != out.dtype:
        return None
    return add, 1 - index


def _list_before(b: Builder, graph: ir.Graph, start: int, anchor: ir.Node) -> None:
    """Move the nodes ``b`` made since its tape held ``start`` to just before ``anchor``."""
    made = b.tape.nodes[start:]
    for node in made:
        graph.remove(node)
    graph.insert_before(anchor, made)


class PadGemmColumnsPass(ir.passes.InPlacePass):
    """Give a GEMM whose weight has an unaligned column count zero columns up to a multiple
    of 64, and slice them off its output: the loss and everything after it see the same tensor.

    cuBLAS runs a GEMM with a 2-byte leading dimension that is not a multiple of 8 elements on
    its ``align1`` kernels, which skip the tensor cores' wide loads. GPT-2's vocabulary (50257
    columns) puts three such GEMMs in a step (the logits, and through the logits' gradient the
    hidden state's and the embedding's gradients): about 15 ms of an 85 ms bf16 step on the
    H200 (issue 30's profile). Inductor pads such dimensions the same way (``pad_mm``).

    Rules, for ``MatMul(A, B)`` and ``Gemm(A, B, C)`` with ``B`` a static float matrix of
    ``N >= MIN_COLUMNS`` output columns, ``N`` not a multiple of ``ALIGNED``:

    1. ``B`` gets ``N' - N`` zero columns, ``N' = ceil(N / 64) * 64``; when ``B`` is
       ``Transpose(W)`` (a tied embedding, a Linear as exported), ``W`` gets zero rows before
       its Transpose, so the Transpose still folds into the GEMM; a ``Gemm`` bias over the
       columns gets zero columns too.
    2. The GEMM's output, ``N'`` columns wide, is sliced back to its ``N`` columns under the
       output's own name.
    3. Where a ``MatMul``'s one reader is an ``Add`` of a bias row ``[N]`` (a Linear with bias
       as the dynamo exporter writes it: BERT's masked-LM decoder), the bias gets the zero
       columns too and the Slice goes after the ``Add``, as for a ``Gemm``'s bias: the loss
       head then reads the padded sum through one Slice (``lowering/cross_entropy.py`` reads
       it in place), not a sliced copy of the product and a second, unpadded sum.

    The parameters keep their shapes: the zeros are made in the graph every step and are no
    trained state. Differentiated, the Slice becomes a zero Pad of the output's gradient, so
    both backward GEMMs run over ``N'`` as well, and the Pad of ``W`` becomes a Slice of its
    gradient; the real rows' gradients are the same sums (within float rounding, the GEMM's
    order of accumulation). The price is two copies of the output a step (the Slice forward,
    the Pad backward), ``4 * rows * N'`` bytes in 2-byte floats.

    Example: GPT-2's ``MatMul(h[8,1024,768], Transpose(wte[50257,768]))`` becomes
    ``Slice(MatMul(h, Transpose(Pad(wte) [50304,768])), 0:50257 on the last axis)``.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        b = Builder(graph, role=Role.FORWARD, scope="align")
        padded = 0
        for node in [n for n in graph if _columns(n) is not None]:
            axis, n = _columns(node)  # type: ignore[misc]
            wide = math.ceil(n / ALIGN_TO) * ALIGN_TO
            before = len(b.tape.nodes)
            node.replace_input_with(1, self._pad_weight(b, node.inputs[1], axis, wide - n))  # type: ignore[arg-type]
            bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
            if bias is not None and bias.shape is not None and bias.shape[-1] == n:
                node.replace_input_with(2, self._pad(b, bias, len(bias.shape) - 1, wide - n))
            _list_before(b, graph, before, node)
            found = _bias_add(node, n) if node.op_type == "MatMul" else None
            if found is None:
                self._slice_output(b, graph, node, n, wide)
            else:  # the bias padded too, and the Slice after its Add (rule 3)
                add, slot = found
                bias = add.inputs[slot]
                before = len(b.tape.nodes)
                add.replace_input_with(slot, self._pad(b, bias, len(bias.shape) - 1, wide - n))  # type: ignore[arg-type]
                _list_before(b, graph, before, add)
                out = node.outputs[0]
                out.shape = ir.Shape([*list(out.shape)[:-1], wide]) if out.shape is not None else None
                self._slice_output(b, graph, add, n, wide)
            padded += 1
            logger.debug("%s: %d output columns padded to %d", node.name, n, wide)
        return ir.passes.PassResult(model, modified=padded > 0)

    @staticmethod
    def _pad(b: Builder, value: ir.Value, axis: int, extra: int) -> ir.Value:
        rank = len(value.shape)  # type: ignore[arg-type]
        pads = [0] * (2 * rank)
        pads[rank + axis] = extra
        out = b.op("Pad", value, b.ints(pads), name=f"{value.name}/pad")
        dims = list(value.shape)  # type: ignore[arg-type]
        dims[axis] = dims[axis] + extra
        out.shape, out.dtype = ir.Shape(dims), value.dtype
        return out

    def _pad_weight(self, b: Builder, weight: ir.Value, axis: int, extra: int) -> ir.Value:
        node = weight.producer()
        perm = node.attributes.get("perm") if node is not None and node.op_type == "Transpose" else None
        if node is not None and perm is not None and list(perm.as_ints()) == [1, 0] and node.domain in ("", "ai.onnx"):
            source = node.inputs[0]
            assert source is not None
            out = b.op("Transpose", self._pad(b, source, 1 - axis, extra), perm=[1, 0], name=f"{weight.name}/pad")
            dims = list(weight.shape)  # type: ignore[arg-type]
            dims[axis] += extra
            out.shape, out.dtype = ir.Shape(dims), weight.dtype
            return out
        return self._pad(b, weight, axis, extra)

    @staticmethod
    def _slice_output(b: Builder, graph: ir.Graph, node: ir.Node, n: int, wide: int) -> None:
        """The GEMM writes ``<name>/padded``; a Slice writes the original value's name."""
        out = node.outputs[0]
        name, shape = out.name, out.shape
        sliced = b.op("Slice", out, b.ints([0]), b.ints([n]), b.ints([-1]), name=f"{name}/columns")
        sliced.shape, sliced.dtype = (ir.Shape(shape) if shape is not None else None), out.dtype
        slice_node = b.tape.nodes[-1]
        graph.remove(slice_node)
        graph.insert_after(node, slice_node)
        for user, index in list(out.uses()):
            if user is not slice_node:
                user.replace_input_with(index, sliced)
        if out.is_graph_output():
            outputs = graph.outputs
            outputs[list(outputs).index(out)] = sliced
        out.name = b.unique(f"{name}/padded")
        sliced.name = name
        if shape is not None:
            dims = list(shape)
            dims[-1] = wide
            out.shape = ir.Shape(dims)
