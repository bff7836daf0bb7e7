"""InsertCastsPass: rewrite types and insert Casts where the decided precision changes."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import make_cast
from mpgraph._ir.contract import StepContract
from mpgraph._ir.names import NameScope
from mpgraph.dtypes import finite_max, short_name
from mpgraph.errors import MpgraphError
from mpgraph.optypes import NodeTyping, node_typing, type_string
from mpgraph.passes.precision_facts import constant_range, constant_tensor
from mpgraph.policy.schema import Policy

__all__ = ["InsertCastsPass"]

logger = logging.getLogger(__name__)


class InsertCastsPass(ir.passes.InPlacePass):
    """Applies the recorded precision decisions to the graph's types.

    Requires ``AssignPrecisionPass`` to have run (``mpgraph.precision`` on every node).

    Rules:
        1. A low node's compute-typed outputs take the low dtype; its compute-typed float32
           inputs are replaced by their low version.
        2. The low version of a float32 value is one ``Cast`` named ``cast/<value>_<bf16|fp16>``,
           created once per (tensor, dtype) and placed right after the producer.
        3. A constant (initializer or ``Constant``) whose every use is a compute slot of a low
           node is stored in the low dtype instead (weights shrink); values out of range are
           handled per ``policy.initializers`` and recorded in ``mpgraph.initializer_range``.
        4. A low value read by a float32 node, a fixed-type slot, or a control-flow body gets
           one ``Cast`` back to float32 (``cast/<value>_fp32``). Input-only type variables
           that admit the low dtype (``Shape``, ``Cast``'s input) read the low value directly.
        5. With ``keep_io_types``, graph inputs and outputs keep their names and float32 type:
           a low output is computed under ``<name>_<bf16|fp16>`` and cast to ``<name>``.
           Without it, an input read only by low nodes becomes a low input, and low outputs
           stay low.
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.policy.is_identity:
            return ir.passes.PassResult(model, False)
        run = _Rewrite(model, self.policy)
        run.store_constants_low()
        run.lower_inputs()
        lowered = run.retype_outputs()
        run.keep_output_names(lowered)
        run.cast_low_inputs()
        run.cast_back(lowered)
        if run.events:
            model.metadata_props[md.MODEL_INIT_RANGE] = json.dumps(run.events, sort_keys=True)
        return ir.passes.PassResult(model, run.modified)


class _Rewrite:
    """One run of ``InsertCastsPass`` over a graph: its facts and the casts made so far."""

    def __init__(self, model: ir.Model, policy: Policy) -> None:
        self.policy = policy
        self.low = policy.dtype
        self.graph = model.graph
        self.names = NameScope(model)
        self.nodes = [n for n in self.graph if md.NODE_INSERTED not in n.metadata_props]
        opsets = dict(model.opset_imports)
        self.typings = {n: node_typing(n, opsets) for n in self.nodes}
        low_name = self.low.name.lower()
        self.is_low = {n: n.metadata_props.get(md.NODE_PRECISION) == low_name for n in self.nodes}
        self.first_node = next(iter(self.graph), None)
        # A training step's inputs and outputs are master weights and state: always float32.
        self.training = StepContract.is_training(model)
        self.modified = False
        self.to_low: dict[ir.Value, ir.Value] = {}
        self.to_f32: dict[ir.Value, ir.Value] = {}
        self.events: list[dict[str, object]] = json.loads(model.metadata_props.get(md.MODEL_INIT_RANGE, "[]"))

    def keeps_io(self, name: str) -> bool:
        return self.training or self.policy.keeps_io(name)

    def low_use(self, node: ir.Node, index: int) -> bool:
        """Whether input ``index`` of ``node`` is a compute slot of a low node."""
        typing = self.typings.get(node)
        return bool(typing and self.is_low[node] and typing.input_vars[index] in typing.compute_vars)

    def add_cast(self, value: ir.Value, dtype: ir.DataType, why: str) -> ir.Value:
        """Rule 2: one ``Cast`` of ``value`` to ``dtype``, right after its producer."""
        node = make_cast(self.names.fresh(f"cast/{value.name}_{short_name(dtype)}"), value, dtype, "cast", why)
        producer = value.producer()
        if producer is not None and producer.graph is self.graph:
            self.graph.insert_after(producer, node)
        elif self.first_node is not None:
            self.graph.insert_before(self.first_node, node)
        else:
            self.graph.append(node)
        return node.outputs[0]

    def store_constants_low(self) -> None:
        """Rule 3: constants used only by low compute slots are stored low."""
        for value in _float32_constants(self.graph, self.nodes):
            uses = list(value.uses())
            if (
                uses
                and not value.is_graph_output()
                and all(self.low_use(u.node, u.idx) for u in uses if u.node in self.typings)
                and all(u.node in self.typings for u in uses)
            ):
                self.events.extend(_store_low(value, self.low, self.policy))
                self.modified = True

    def lower_inputs(self) -> None:
        """Rule 5, inputs: without keep_io_types an input read only by low nodes becomes low."""
        for value in self.graph.inputs:
            if value.dtype != ir.DataType.FLOAT or self.keeps_io(value.name or "") or value.is_initializer():
                continue
            uses = list(value.uses())
            if uses and all(u.node in self.typings and self.low_use(u.node, u.idx) for u in uses):
                value.dtype = self.low
                self.modified = True

    def retype_outputs(self) -> list[ir.Value]:
        """Rule 1: a low node's compute-typed float32 outputs take the low dtype; returns them."""
        lowered: list[ir.Value] = []
        for node in self.nodes:
            if not self.is_low[node]:
                continue
            for i in self.typings[node].compute_outputs():
                out = node.outputs[i]
                if out.dtype == ir.DataType.FLOAT:
                    out.dtype = self.low
                    lowered.append(out)
                    self.modified = True
        return lowered

    def keep_output_names(self, lowered: list[ir.Value]) -> None:
        """Rule 5, outputs: a kept output is computed under ``<name>_<bf16>`` and cast to ``<name>``."""
        graph = self.graph
        for index, out in enumerate(list(graph.outputs)):
            if out in lowered and self.keeps_io(out.name or ""):
                original = out.name or ""
                out.name = self.names.fresh(f"{original}_{short_name(self.low)}")
                cast = self.add_cast(out, ir.DataType.FLOAT, "graph output keeps float32 (keep_io_types)")
                cast.name = original
                graph.outputs[index] = cast
                self.to_f32[out] = cast

    def cast_low_inputs(self) -> None:
        """Rules 1-2: a low node reads the low version of its compute-typed float32 inputs."""
        low_name = self.low.name.lower()
        for node in self.nodes:
            if not self.is_low[node]:
                continue
            for i in self.typings[node].compute_inputs():
                value = node.inputs[i]
                if value is None or value.dtype != ir.DataType.FLOAT:
                    continue
                if value not in self.to_low:
                    self.to_low[value] = self.add_cast(value, self.low, f"to {low_name} for low-precision consumers")
                    if constant_tensor(value) is not None:
                        self.events.extend(_range_events(value, self.low, "cast at run time (also read in float32)"))
                node.replace_input_with(i, self.to_low[value])
                self.modified = True

    def cast_back(self, lowered: list[ir.Value]) -> None:
        """Rule 4: a low value read in float32 goes through one ``Cast`` back to float32."""
        for value in [*lowered, *(v for v in self.graph.inputs if v.dtype == self.low)]:
            for use in list(value.uses()):
                node, idx = use.node, use.idx
                if md.NODE_INSERTED in node.metadata_props and node.graph is self.graph:
                    continue
                if node in self.typings and (
                    self.low_use(node, idx) or _reads_any_float(self.typings[node], idx, self.low)
                ):
                    continue
                if value not in self.to_f32:
                    self.to_f32[value] = self.add_cast(value, ir.DataType.FLOAT, "back to float32 for float32 consumers")
                node.replace_input_with(idx, self.to_f32[value])
                self.modified = True


def _reads_any_float(typing: NodeTyping, index: int, low: ir.DataType) -> bool:
    """True for an input-only type variable of one input that admits ``low`` (the node reads it
    as is; a variable shared with another input, as in a comparison, must match it instead)."""
    var = typing.input_vars[index] if index < len(typing.input_vars) else None
    if var is None or var in typing.output_vars or var in typing.compute_vars:
        return False
    return type_string(low) in typing.allowed.get(var, ())


def _float32_constants(graph: ir.Graph, nodes: list[ir.Node]) -> list[ir.Value]:
    seen: dict[ir.Value, None] = {}
    for node in nodes:
        for value in node.inputs:
            if value is not None and value.dtype == ir.DataType.FLOAT and constant_tensor(value) is not None:
                seen.setdefault(value, None)
    return list(seen)


def _range_events(value: ir.Value, low: ir.DataType, action: str) -> list[dict[str, object]]:
    _, overflow, underflow = constant_range(value, low)
    if not overflow and not underflow:
        return []
    return [{"name": value.name, "overflow": overflow, "underflow": underflow, "action": action}]


def _store_low(value: ir.Value, low: ir.DataType, policy: Policy) -> list[dict[str, object]]:
    """Re-store a float32 constant in the low dtype, applying the range policy."""
    tensor = constant_tensor(value)
    assert tensor is not None
    array = tensor.numpy().astype(np.float32)
    ranges = policy.initializers
    events = _range_events(value, low, "stored low")
    if events:
        event = events[0]
        if event["overflow"]:
            if ranges.overflow == "error":
                raise MpgraphError(
                    f"constant '{value.name}' has {event['overflow']} values beyond {low.name.lower()} range; "
                    "set initializers.overflow to keep_fp32 or clamp in the policy"
                )
            if ranges.overflow == "clamp":
                limit = finite_max(low)
                array = np.clip(array, -limit, limit)
                event["action"] = f"clamped to +-{limit:.6g}"
            else:
                event["action"] = "stored low (overflows to inf; override requested low)"
        if event["underflow"] and ranges.underflow == "error":
            raise MpgraphError(
                f"constant '{value.name}' has {event['underflow']} nonzeros that flush to zero in "
                f"{low.name.lower()}; set initializers.underflow to keep or keep_fp32 in the policy"
            )
    new_tensor = ir.Tensor(array.astype(low.numpy()), dtype=low, name=value.name)
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        producer.attributes["value"] = ir.AttrTensor("value", new_tensor)
    else:
        value.const_value = new_tensor
    value.dtype = low
    return events
