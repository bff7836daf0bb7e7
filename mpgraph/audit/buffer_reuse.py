"""Outputs that ORT's allocation planner writes into one of the node's input buffers.

A kernel may declare that an output may take an input's buffer (``MayInplace``; the kernel
library's ops through ``OrtCustomOp.GetMayInplace``, ``lowering/csrc/kernels.cc``). ORT's
planner walks the nodes in execution order and gives the output that buffer when:

1. the node is the last reader of the buffer (its use count is down to this node), and
2. the input and the output have the same element size and the same known shape, and
3. the buffer is an intermediate: no graph input, initializer or graph output.

Example: ``d = SoftmaxCrossEntropyRowsGrad(logits, ...)`` with no reader of ``logits`` after it
writes ``d`` over ``logits``: GPT-2 small's padded bfloat16 logits at batch 8 are 786 MiB, and
the step's transient peak is at that node, so the peak drops by as much.

``MAY_INPLACE`` mirrors what the library declares (``tests/test_free_memory.py`` checks it
against a built library); ORT's own kernels' in-place pairs (``Relu``, ``Add``...) are not
modelled, so the estimate stays an upper bound there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import onnx_ir as ir

__all__ = ["MAY_INPLACE", "share_input_buffers"]

#: (domain, op type) -> (input index, output index) pairs the kernel declares ``MayInplace``.
MAY_INPLACE: Mapping[tuple[str, str], tuple[tuple[int, int], ...]] = {
    ("ai.mpgraph", "SoftmaxCrossEntropyRowsGrad"): ((0, 0),),
}


def _same_size(a: ir.Value, b: ir.Value) -> bool:
    """ORT's ``SameSize``: equal element sizes and equal, fully known shapes."""
    if a.dtype is None or b.dtype is None or a.shape is None or b.shape is None:
        return False
    if not (a.shape.is_static() and b.shape.is_static()):
        return False
    return a.dtype.itemsize == b.dtype.itemsize and tuple(a.shape.numpy()) == tuple(b.shape.numpy())


def share_input_buffers(nodes: list[ir.Node], owner: Mapping[str, str],
                        reads: Callable[[ir.Node], Iterable[ir.Value | None]], outputs: set[str | None]) -> dict[str, str]:
    """``owner`` (value name -> the buffer it lives in) with every output that ORT's planner puts
    into an input's buffer (the module's rules) moved into that buffer, as are its views.

    ``nodes`` are in execution order; ``reads(node)`` is what a node reads in ORT (a folded
    transpose reads its source); ``outputs`` are the graph's output names.
    """
    owner = dict(owner)
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for value in reads(node):
            if value is not None and value.name in owner:
                last[owner[value.name]] = i
    held = {owner[name] for name in outputs if name in owner}
    for i, node in enumerate(nodes):
        for k, o in MAY_INPLACE.get((node.domain, node.op_type), ()):
            src = node.inputs[k] if k < len(node.inputs) else None
            out = node.outputs[o] if o < len(node.outputs) else None
            if src is None or out is None or not src.name or not out.name or owner.get(out.name) != out.name:
                continue
            buf = owner.get(src.name)
            if buf is None or buf in held or out.name in held or last.get(buf) != i or not _same_size(src, out):
                continue
            for name, b in owner.items():
                if b == out.name:
                    owner[name] = buf
            last[buf] = max(i, last.pop(out.name, i))
    return owner
