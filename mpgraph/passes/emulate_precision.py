"""EmulatePrecisionPass: compute in float32, round like the low dtype at every boundary."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import make_cast
from mpgraph._ir.names import NameScope
from mpgraph.dtypes import short_name
from mpgraph.passes.precision_facts import constant_tensor

__all__ = ["EmulatePrecisionPass"]


class EmulatePrecisionPass(ir.passes.InPlacePass):
    """Turns a lowered graph into one ONNX Runtime's CPU provider runs with the same rounding.

    ORT's CPU provider has no bfloat16 kernels and runs float16 ops as float32 behind casts it
    inserts (and may drop). The emulated graph computes every op in float32 but keeps every
    value that the lowered graph holds in the low dtype *rounded* to it, with an explicit
    ``Cast(to=low) -> Cast(to=float)`` pair, which ORT keeps (a test checks an fp16 underflow
    gives zeros). Runs after ``InsertCastsPass``; ``FoldCastsPass`` afterwards removes the
    casts back to float32 that became identities.

    Rules:
        1. A low value produced by a ``Cast(to=low)`` gets a ``Cast(to=float)`` named
           ``round/<value>``; readers read that.
        2. A low value produced by any other node is recomputed in float32 and rounded by a
           ``Cast(to=low)``/``Cast(to=float)`` pair (``round/<value>_<bf16>``, ``round/<value>``).
        3. A low constant is stored back as float32; its values are already rounded.
        4. A low graph input stays low and is widened once; low graph outputs become float32
           holding rounded values.
        5. A value nothing reads (an omitted optional output among them) is only retyped.
    """

    def __init__(self, low: ir.DataType) -> None:
        super().__init__()
        self.low = low

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        low = self.low
        names = NameScope(model)
        modified = False
        values: list[ir.Value] = [v for v in graph.inputs if v.dtype == low]
        values.extend(v for v in graph.initializers.values() if v.dtype == low and v not in values)
        for node in list(graph):
            values.extend(v for v in node.outputs if v.dtype == low)
        for value in values:
            tensor = constant_tensor(value)
            if tensor is not None:
                widened = ir.Tensor(tensor.numpy().astype(np.float32), name=value.name)
                producer = value.producer()
                if producer is not None and producer.op_type == "Constant":
                    producer.attributes["value"] = ir.AttrTensor("value", widened)
                else:
                    value.const_value = widened
                value.type = ir.TensorType(ir.DataType.FLOAT)  # a new type: clones share it
                modified = True
                continue
            producer = value.producer()
            computed = producer is not None and producer.op_type != "Cast"
            if computed:
                value.type = ir.TensorType(ir.DataType.FLOAT)  # a new type: clones share it
                modified = True
            if not value.uses() and not value.is_graph_output():
                # Nothing reads it, so there is no rounding to show; an omitted optional output
                # (Attention's present_key, named "") would get a Cast reading "", which ORT refuses.
                continue
            rounded = value
            new_nodes: list[ir.Node] = []
            if computed:
                down = _cast(names.fresh(f"round/{value.name}_{short_name(low)}"), value, low)
                new_nodes.append(down)
                rounded = down.outputs[0]
            up = _cast(names.fresh(f"round/{value.name}"), rounded, ir.DataType.FLOAT)
            new_nodes.append(up)
            final = up.outputs[0]
            for use in list(value.uses()):
                if use.node is not new_nodes[0]:
                    use.node.replace_input_with(use.idx, final)
            if value.is_graph_output():
                index = list(graph.outputs).index(value)
                name = value.name
                value.name = names.fresh(f"{name}_unrounded")
                final.name = name
                graph.outputs[index] = final
            if producer is not None and producer.graph is graph:
                graph.insert_after(producer, new_nodes)
            else:
                first = next(iter(graph))
                graph.insert_before(first, new_nodes)
            modified = True
        model.metadata_props[md.MODEL_EMULATED] = "true"
        return ir.passes.PassResult(model, modified)


def _cast(name: str, value: ir.Value, to: ir.DataType) -> ir.Node:
    target = short_name(to) if to != ir.DataType.FLOAT else "the low dtype"
    return make_cast(name, value, to, "round", f"emulation: round to {target}")
