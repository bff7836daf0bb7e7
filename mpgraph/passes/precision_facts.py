"""Phase 0 of ``AssignPrecisionPass``: the facts that fix a node's precision whatever the
policy's categories say.

``PrecisionFacts.fixed`` tests one node: its types and schema, its training role, whether it
feeds shape arithmetic, policy pins, the opset's type constraints, constants beyond the low
dtype's range (``constant_range``) and calibrated activations beyond it / ``CALIBRATION_MARGIN``.
The pass (``assign_precision.py``) records what it returns; ``insert_casts`` and
``emulate_precision`` read constants through ``constant_tensor``. ``assign_precision``
re-exports the public names.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.meta import PRECISION_OF_DTYPE, Category, Phase, Precision, Role
from mpgraph.dtypes import finite_max, is_float, smallest_subnormal
from mpgraph.optypes import CONTROL_FLOW_OPS, SHAPE_SLOTS, NodeTyping, opset_version
from mpgraph.passes.calibrate_range import ABSMAX_META
from mpgraph.policy.schema import Policy

__all__ = [
    "CALIBRATION_MARGIN",
    "DEFAULT_DOMAINS",
    "PrecisionFacts",
    "constant_range",
    "constant_tensor",
]

#: Activations must stay below the low dtype's max / this factor on calibration data.
CALIBRATION_MARGIN = 2.0

DEFAULT_DOMAINS = ("", "ai.onnx")


def constant_range(value: ir.Value, low: ir.DataType) -> tuple[float, int, int]:
    """``(max finite |x|, values beyond low's range, nonzeros that flush to zero)`` of a constant.

    Computed once per (constant, dtype) and kept in ``value.meta`` (never saved).
    """
    key = f"mpgraph.range.{low.name}"
    cached = value.meta.get(key)
    if cached is not None:
        return cached
    tensor = constant_tensor(value)
    assert tensor is not None
    array = np.abs(tensor.numpy().astype(np.float32, copy=False))
    finite = array[np.isfinite(array)] if not np.isfinite(array).all() else array
    absmax = float(finite.max()) if finite.size else 0.0
    overflow = int((finite > finite_max(low)).sum()) if absmax > finite_max(low) else 0
    underflow = int(((finite > 0) & (finite < smallest_subnormal(low) / 2)).sum())
    value.meta[key] = result = (absmax, overflow, underflow)
    return result


def constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor behind a value that is a true constant (initializer or Constant node)."""
    if value.is_initializer() and not value.is_graph_input():
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.value
    return None


class PrecisionFacts:
    """Phase 0's tests of one node: its types, its role, shape arithmetic, pins, ranges."""

    def __init__(self, policy: Policy, nodes: list[ir.Node], opsets: dict[str, int],
                 typings: dict[ir.Node, NodeTyping], twins: dict[ir.Node, ir.Node]) -> None:
        self.policy = policy
        self.opsets = opsets
        self.typings = typings
        self.protected = _shape_protected_nodes(nodes)
        self.twins = twins
        # Training graphs: backward nodes of deny ops (norms, softmax, losses) stay float32.
        self.deny_forward = {
            n for n in nodes
            if n.metadata_props.get(md.NODE_ROLE, Role.FORWARD) in (Role.FORWARD, Role.LOSS)
            and policy.category(n.op_type, n.domain)[0] == Category.DENY
        }

    def fixed(self, node: ir.Node) -> tuple[Precision, Phase, str] | None:
        """The phase-0 decision of ``node``, or ``None`` when the policy's rules decide it."""
        typing = self.typings[node]
        found = self._types(node, typing)
        if found is not None or self.policy.is_identity:
            return found
        found = self._policy(node, typing)
        if found is not None:
            return Precision.FLOAT32, Phase.FIXED, found
        override = self.policy.override_for(node.name or "")
        if override is not None and override.precision != Precision.FLOAT32:
            return None
        why = self._range_reason(node, typing)
        if why is not None:
            return Precision.FLOAT32, Phase.FIXED, why
        why = self._activation_reason(node, typing)
        return None if why is None else (Precision.FLOAT32, Phase.CALIBRATION, why)

    def _types(self, node: ir.Node, typing: NodeTyping) -> tuple[Precision, Phase, str] | None:
        """What the node's types and schema allow, whatever the policy."""
        low = self.policy.dtype.name.lower()
        if not any(is_float(v.dtype) for v in (*node.inputs, *node.outputs) if v is not None):
            return Precision.NONE, Phase.FIXED, "no float tensors"
        if typing.schema is None:
            why = f"no ONNX schema for {_label(node)} (opset {opset_version(node, self.opsets)}); kept float32"
            return Precision.FLOAT32, Phase.FIXED, why
        if node.op_type in CONTROL_FLOW_OPS:
            return Precision.FLOAT32, Phase.FIXED, "control flow (bodies stay float32)"
        if not typing.compute_vars:
            if any(v is not None and is_float(typing.bound.get(v)) for v in typing.output_vars):
                return Precision.FLOAT32, Phase.FIXED, "output dtype set by an attribute or fixed by the schema"
            return Precision.NONE, Phase.FIXED, "no float compute (float inputs only read for shape or dtype-neutral)"
        bound = {typing.bound[v].name.lower() for v in typing.compute_vars}
        if bound == {"float"}:
            return None
        if bound == {low}:
            return PRECISION_OF_DTYPE[self.policy.dtype], Phase.INPUT_DTYPE, f"already computes in {low}"
        why = f"computes in {'/'.join(sorted(bound))}; only float32 ops are lowered"
        return Precision.FLOAT32, Phase.INPUT_DTYPE, why

    def _policy(self, node: ir.Node, typing: NodeTyping) -> str | None:
        """Why a float32 node stays float32 under the policy: its role, shapes, pins, opset."""
        if node.metadata_props.get(md.NODE_ROLE) == Role.OPTIMIZER:
            return "optimizer step and its state stay float32"
        twin = self.twins.get(node)
        if twin is not None and twin in self.deny_forward:
            return f"backward of deny op {twin.op_type} '{twin.name}' stays float32"
        if node in self.protected:
            return self.protected[node]
        for slot, why in self.policy.pinned_slots(node.op_type, node.domain).items():
            if slot < len(typing.input_vars) and typing.input_vars[slot] in typing.compute_vars:
                return f"input {slot} pinned to float32: {why}"
        low = self.policy.dtype
        if not typing.allows(low):
            version = opset_version(node, self.opsets)
            return f"{_label(node)} in opset {version} has no {low.name.lower()} type; upgrade the opset to lower it"
        return None

    def _activation_reason(self, node: ir.Node, typing: NodeTyping) -> str | None:
        if self.policy.category(node.op_type, node.domain)[0] == Category.DENY:
            return None  # float32 anyway; its deny reason says why
        limit = finite_max(self.policy.dtype) / CALIBRATION_MARGIN
        slots = [node.inputs[i] for i in typing.compute_inputs()] + [node.outputs[i] for i in typing.compute_outputs()]
        for value in slots:
            if value is None:
                continue
            absmax = value.meta.get(ABSMAX_META)
            if absmax is not None and absmax > limit:
                return (
                    f"calibration: '{value.name}' reaches |x| = {absmax:.4g}, beyond "
                    f"{self.policy.dtype.name.lower()}'s range / {CALIBRATION_MARGIN:g}"
                )
        return None

    def _range_reason(self, node: ir.Node, typing: NodeTyping) -> str | None:
        ranges = self.policy.initializers
        if ranges.overflow != "keep_fp32" and ranges.underflow != "keep_fp32":
            return None
        low = self.policy.dtype
        for i in typing.compute_inputs():
            value = node.inputs[i]
            if value is None:
                continue
            tensor = constant_tensor(value)
            if tensor is None or not is_float(tensor.dtype):
                continue
            absmax, overflow, tiny = constant_range(value, low)
            if ranges.overflow == "keep_fp32" and overflow:
                return (
                    f"constant '{value.name}' exceeds {low.name.lower()} range "
                    f"(max |x| = {absmax:.4g} > {finite_max(low):.4g})"
                )
            if ranges.underflow == "keep_fp32" and tiny:
                return f"constant '{value.name}' has {tiny} nonzeros that flush to zero in {low.name.lower()}"
        return None


def _label(node: ir.Node) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def _shape_protected_nodes(nodes: list[ir.Node]) -> dict[ir.Node, str]:
    """Nodes that compute float tensors feeding shape/index slots, with the reason."""
    protected: dict[ir.Node, str] = {}
    stack: list[tuple[ir.Value, str]] = []
    for node in nodes:
        for slot in SHAPE_SLOTS.get(node.op_type, ()):
            if slot < len(node.inputs):
                value = node.inputs[slot]
                if value is not None and is_float(value.dtype):
                    why = f"feeds shape arithmetic ({node.op_type} '{node.name}' input {slot})"
                    stack.append((value, why))
                    if node.op_type == "Range":
                        protected.setdefault(node, why)
    while stack:
        value, why = stack.pop()
        producer = value.producer()
        if producer is None or producer in protected:
            continue
        protected[producer] = why
        for inp in producer.inputs:
            if inp is not None and is_float(inp.dtype):
                stack.append((inp, why))
    return protected
