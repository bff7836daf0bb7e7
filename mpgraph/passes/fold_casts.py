"""FoldCastsPass: remove the Casts that provably change nothing."""

from __future__ import annotations

import onnx_ir as ir

from mpgraph.dtypes import is_float, is_lossless

__all__ = ["FoldCastsPass"]


def _cast_target(node: ir.Node) -> ir.DataType | None:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    attr = node.attributes.get("to")
    return ir.DataType(attr.value) if attr is not None else None


def _dtype(value: ir.Value) -> ir.DataType | None:
    """A value's dtype, read from its producing Cast when type inference left it unset."""
    if value.dtype is not None:
        return value.dtype
    producer = value.producer()
    return _cast_target(producer) if producer is not None else None


class FoldCastsPass(ir.passes.InPlacePass):
    """Folds cast chains that are lossless and merges duplicate Casts.

    Rules (main graph; a value that is a graph output keeps its name):
        1. ``Cast(x: a -> a)`` is an identity: its readers read ``x``.
        2. ``Cast(Cast(x: a -> b) -> c)`` reads ``x`` directly when ``a -> b`` is lossless
           (``b`` holds every value of ``a``). ``fp16 -> fp32 -> fp16`` folds;
           ``fp32 -> fp16 -> fp32`` does not (it rounds).
        3. Two Casts of one tensor to one dtype become one (the one that is a graph output,
           if either is).
        4. A Cast left without readers is removed.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        changed = True
        while changed:
            changed = False
            seen: dict[tuple[ir.Value, ir.DataType], ir.Node] = {}
            for node in list(graph):
                to = _cast_target(node)
                if to is None or node.inputs[0] is None:
                    continue
                src = node.inputs[0]
                out = node.outputs[0]
                # Rule 2: skip a lossless first cast.
                first = src.producer()
                first_to = _cast_target(first) if first is not None else None
                if first is not None and first_to is not None and first.inputs[0] is not None:
                    origin = first.inputs[0]
                    origin_dtype = _dtype(origin)
                    if origin_dtype is not None and is_float(origin_dtype) and is_lossless(origin_dtype, first_to) and is_float(to):
                        node.replace_input_with(0, origin)
                        src = origin
                        changed = True
                # Rule 1: identity.
                if _dtype(src) == to and not out.is_graph_output():
                    out.replace_all_uses_with(src)
                    changed = True
                # Rule 3: duplicates.
                key = (src, to)
                twin = seen.get(key)
                if twin is not None and not out.is_graph_output():
                    out.replace_all_uses_with(twin.outputs[0])
                    changed = True
                elif twin is not None and not twin.outputs[0].is_graph_output():
                    # The graph output keeps its name: this Cast takes the twin's place (so
                    # the twin's readers still come after it) and the twin's readers.
                    graph.remove(node)
                    graph.insert_before(twin, node)
                    twin.outputs[0].replace_all_uses_with(out)
                    seen[key] = node
                    changed = True
                elif twin is None:
                    seen[key] = node
            # Rule 4: dead casts.
            for node in list(graph):
                if _cast_target(node) is not None and not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
                    graph.remove(node, safe=True)
                    changed = True
            modified |= changed
        return ir.passes.PassResult(model, modified)
