"""A constant ``Pad`` of a type ORT CUDA has no Pad kernel for, as ``Concat`` with constant blocks.

ONNX Runtime's CUDA provider registers ``Pad`` (opset 18+, so an opset-23 Pad too) for bool,
float32, float64 and float16 only (its ``docs/OperatorKernels.md``, ``core/providers/cuda/tensor/
pad.cc``; bfloat16 probed ``no`` on 1.31.1 in ``mpgraph/kernel_table.py``).
Any other Pad runs on the CPU provider, and one CPU node is enough for ORT to refuse the session
as a CUDA graph ("all compute graph nodes have not been partitioned to the
CUDAExecutionProvider"). A causal LM's loss has one: HF's ``ForCausalLMLoss`` pads the int64
labels with ``ignore_index`` (``F.pad(labels, (0, 1), value=-100)``) before shifting them.

With a static input shape (a session specialised to its batch, ``PlanOptions.shapes``),
constant pads >= 0 and ``mode="constant"``, the Pad is the input concatenated with constant
blocks of the pad value along each padded axis: the same elements, so the same bits
(``Concat`` has a CUDA kernel for every fixed-size type). Anything else (a symbolic shape, a
computed pad, a crop, edge or reflect) is left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import constant, hand_over

__all__ = ["CUDA_PAD_TYPES", "pads_as_concat"]

#: The element types ORT 1.31 CUDA has a ``Pad`` kernel for.
CUDA_PAD_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BOOL})


def _static_shape(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return [int(d) for d in value.shape]


def _plan(pad: ir.Node) -> tuple[list[int], list[tuple[int, int, int]], np.ndarray] | None:
    """``(input shape, [(axis, before, after)] for each padded axis, fill value)`` of a Pad
    this rule rewrites; else ``None``."""
    data = pad.inputs[0] if pad.inputs else None
    mode = pad.attributes.get("mode")
    if data is None or data.dtype is None or data.dtype in CUDA_PAD_TYPES or len(pad.inputs) < 2 \
            or (mode is not None and mode.as_string() != "constant") or "pads" in pad.attributes:
        return None
    shape = _static_shape(data)
    pads = constant(pad.inputs[1])
    if shape is None or pads is None:
        return None
    rank = len(shape)
    axes = list(range(rank))
    if len(pad.inputs) > 3 and pad.inputs[3] is not None:
        given = constant(pad.inputs[3])
        if given is None:
            return None
        axes = [int(a) % rank for a in given.reshape(-1)]
    pads = [int(p) for p in pads.reshape(-1)]
    if len(pads) != 2 * len(axes) or any(p < 0 for p in pads):
        return None
    fill = np.zeros((), data.dtype.numpy())
    if len(pad.inputs) > 2 and pad.inputs[2] is not None:
        value = constant(pad.inputs[2])
        if value is None or value.size != 1:
            return None
        fill = value.reshape(()).astype(data.dtype.numpy())
    sides = [(a, pads[i], pads[i + len(axes)]) for i, a in enumerate(axes) if pads[i] or pads[i + len(axes)]]
    return (shape, sides, fill) if sides else None


def _rewrite(graph: ir.Graph, pad: ir.Node, names: NameScope) -> bool:
    found = _plan(pad)
    if found is None:
        return False
    shape, sides, fill = found
    rw = Rewrite(graph, pad.name or "pad", names=names)
    x = pad.inputs[0]
    for k, (axis, before, after) in enumerate(sides):
        parts = []
        for side, width in (("before", before), ("after", after)):
            if width:
                block = list(shape)
                block[axis] = width
                parts.append((side, rw.constant(f"{side}{axis}", np.full(block, fill))))
        blocks = [v for s, v in parts if s == "before"] + [x] + [v for s, v in parts if s == "after"]
        last = k == len(sides) - 1
        node = rw.node("Concat", *blocks, name="as_concat", axis=axis, like=pad if last else None)
        shape[axis] += before + after
        node.outputs[0].dtype, node.outputs[0].shape = x.dtype, ir.Shape(list(shape))  # type: ignore[union-attr]
        x = node.outputs[0]
    for node in rw.nodes:
        graph.insert_before(pad, node)
    hand_over((pad.outputs[0],), (x,))
    graph.remove(pad, safe=True)
    return True


def pads_as_concat(model: ir.Model) -> int:
    """Rewrite every Pad of ``model``'s main graph that ORT CUDA would run on CPU and that has a
    static shape and constant pads (see the module) as Concats, in place; how many."""
    graph = model.graph
    names = NameScope(graph)
    pads = [n for n in graph if n.op_type == "Pad" and n.domain in ("", "ai.onnx")]
    return sum(_rewrite(graph, pad, names) for pad in pads)
