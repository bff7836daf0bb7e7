"""A narrowing ``Cast`` of a zero ``Pad`` runs before the Pad (``narrow_pad``, a session lowering).

``PadGemmColumnsPass`` pads a weight GEMM's output columns to a multiple of 64 and slices the
padding off; differentiated, the Slice is a zero ``Pad`` of the output's gradient. Under a bf16
policy that gradient is float32 (the loss head's), so the step pads it in float32 and a Cast
rounds the padded copy for the backward GEMMs: BERT-base's masked-LM head, batch 8, T 512,
vocabulary 30522 -> 30528, writes a 466 MiB float32 copy and a 233 MiB bfloat16 one, all three
live at the step's transient peak with the 466 MiB logits gradient
(``benchmarks/plan_memory.py``).

The same form pads a weight: a tied embedding read by the padded head (GPT-2's ``wte``, 50257 ->
50304 rows) is padded in float32 every step and then cast for the GEMM; the rule casts first.

``Cast(Pad(x, pads), to=low)`` is ``Pad(Cast(x, to=low), pads)`` when the pad value is zero:
the Cast rounds each element alone and zero rounds to zero, so every element of the result has
the same bits. The rule reorders the two nodes: the Cast reads x, the Pad reads the Cast's
output and makes the value the Cast made. The float32 padded copy is gone; the Pad copies
2-byte elements. Same two kernels, fewer bytes.

ORT CUDA has no bfloat16 ``Pad``; ``pad_concat`` (run again by the CUDA rule) writes it as a ``Concat``
with a zero block, which needs a static shape and constant pads, so this rule takes only Pads
that satisfy both: a float32 input of static shape, constant ``pads`` (and ``axes``), mode
``constant`` with no pad value or a zero one, read by nothing but one Cast to float16 or
bfloat16 (and no graph output). A fill of -0.0 is not zero here: the moved Pad fills +0.0.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.lowering.match import constant, hand_over, is_op
from mpgraph.lowering.pad_concat import pads_as_concat

__all__ = ["narrow_before_pad", "narrow_pads_on_cuda"]

_NARROW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _cast_of(pad: ir.Node) -> ir.Node | None:
    """The one reader of ``pad``'s output when it is a narrowing Cast and the Pad qualifies."""
    x, out = (pad.inputs[0] if pad.inputs else None), pad.outputs[0]
    mode = pad.attributes.get("mode")
    if x is None or x.dtype != ir.DataType.FLOAT or x.shape is None or not x.shape.is_static() \
            or (mode is not None and mode.as_string() != "constant") or "pads" in pad.attributes \
            or len(pad.inputs) < 2 or constant(pad.inputs[1]) is None or out.is_graph_output():
        return None
    if len(pad.inputs) > 3 and pad.inputs[3] is not None and constant(pad.inputs[3]) is None:
        return None
    if len(pad.inputs) > 2 and pad.inputs[2] is not None:
        fill = constant(pad.inputs[2])
        if fill is None or fill.size != 1 or float(fill.reshape(())) != 0.0 or np.signbit(fill).any():
            return None  # the moved Pad fills +0.0: a fill of -0.0 would lose its sign
    readers = {u.node for u in out.uses()}
    if len(readers) != 1:
        return None
    (cast,) = readers
    if not is_op(cast, "Cast") or cast.attributes.get_int("to", 0) not in {t.value for t in _NARROW}:
        return None
    return cast


def _swap(graph: ir.Graph, pad: ir.Node, cast: ir.Node) -> None:
    x, padded, low = pad.inputs[0], pad.outputs[0], cast.outputs[0]
    dtype = ir.DataType(cast.attributes.get_int("to", 0))
    narrow = ir.Node("", "Cast", [x], attributes=[ir.AttrInt64("to", dtype.value)], name=f"{cast.name}/first",
                     metadata_props=dict(cast.metadata_props))
    narrow.outputs[0].name = f"{low.name}/unpadded"
    narrow.outputs[0].dtype, narrow.outputs[0].shape = dtype, x.shape  # type: ignore[union-attr]
    inputs = [narrow.outputs[0], *pad.inputs[1:]]
    if len(inputs) > 2:
        inputs[2] = None  # the zero pad value, float32: absent means zero in any type
    moved = ir.Node("", "Pad", inputs, attributes=list(pad.attributes.values()), name=f"{pad.name}/narrow",
                    metadata_props=dict(pad.metadata_props))
    moved.outputs[0].dtype, moved.outputs[0].shape = dtype, padded.shape
    graph.insert_before(pad, [narrow, moved])
    hand_over((low,), (moved.outputs[0],))
    graph.remove(cast, safe=True)
    graph.remove(pad, safe=True)


def narrow_before_pad(model: ir.Model) -> int:
    """Reorder every qualifying ``Cast(Pad(x))`` of ``model``'s main graph (see the module) as
    ``Pad(Cast(x))``, in place; how many."""
    graph = model.graph
    done = 0
    for pad in [n for n in graph if is_op(n, "Pad")]:
        cast = _cast_of(pad)
        if cast is not None:
            _swap(graph, pad, cast)
            done += 1
    return done


def narrow_pads_on_cuda(model: ir.Model) -> int:
    """The CUDA rule: ``narrow_before_pad``, then ``pads_as_concat`` for the narrow Pads it made
    (ORT CUDA has no bfloat16 Pad; ``pad_concat`` ran before them). It runs after
    ``cross_entropy``, which takes a causal LM's whole loss-head chain, this Pad and Cast included:
    reordered first, the chain no longer matched and the float32 logits came back."""
    done = narrow_before_pad(model)
    if done:
        pads_as_concat(model)
    return done
