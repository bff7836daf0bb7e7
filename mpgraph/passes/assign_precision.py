"""AssignPrecisionPass: decide, per node, whether it computes in the low dtype.

The algorithm is TensorFlow AMP's, written as named phases over the graph's float edges. Each
node ends with ``mpgraph.precision`` (a dtype name, or ``none`` for nodes that compute on no
float tensor) and ``mpgraph.reason`` in its metadata; no types change here.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.dtypes import finite_max, is_float, smallest_subnormal
from mpgraph.errors import MpgraphError
from mpgraph.optypes import CONTROL_FLOW_OPS, SHAPE_SLOTS, NodeTyping, node_typing, opset_version
from mpgraph.passes.calibrate_range import ABSMAX_META
from mpgraph.policy.schema import Policy

__all__ = ["AssignPrecisionPass", "constant_tensor", "constant_range", "CALIBRATION_MARGIN"]

#: Activations must stay below the low dtype's max / this factor on calibration data.
CALIBRATION_MARGIN = 2.0

logger = logging.getLogger(__name__)

_LOW, _FP32, _NONE = "low", "float32", "none"

#: Deny ops whose low-precision kernels compute in float32 inside (ORT CUDA's Softmax and
#: LogSoftmax accumulate in float for bfloat16 and float16 I/O, ``AccumulationType_t``; the
#: CPU emulation computes float32 and rounds the output): between low ops (input a low op's
#: output, every forward consumer low) they take low I/O (phase 7), which is the float32
#: result rounded once, as the low consumer would have rounded it. The backward still reads
#: the output, now low, through a cast to float32. On the H200 GPT that drops two casts and
#: half the softmax's bytes, about 0.5 GB a layer.
LOW_IO_FLOAT32_KERNELS = frozenset({"Softmax", "LogSoftmax"})

#: Sums whose low-precision kernels accumulate in float32 (ORT CUDA's reductions use
#: ``AccumulationType_t``: float for bfloat16): the sum of a value a low op produced takes
#: bfloat16 I/O (phase 7), the float32 sum rounded once, as autocast's bias gradients are.
#: Only for bfloat16, whose range is float32's (a float16 sum can overflow). On the H200 GPT
#: the bias gradients then read the bfloat16 gradient instead of a float32 copy of it, about
#: 0.4 GB a layer.
LOW_IO_FLOAT32_SUMS = frozenset({"ReduceSum"})

#: Elementwise ops a gradient rule writes for its forward op: when that forward op computes
#: low, they compute low too (phase 5), as autocast runs a low op's backward in its dtype.
#: The backward then moves half the bytes: on the H200 GPT the erf GELU's backward and the
#: attention scale's backward were float32 between two low ops, about 1 GB a layer.
FOLLOW_FORWARD_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Exp", "Pow", "Sqrt", "Reciprocal", "Where", "Erf", "Tanh", "Sigmoid"})


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


class AssignPrecisionPass(ir.passes.InPlacePass):
    """Decides every node's precision from a policy and records why.

    Phases, in order (a node decided by an earlier phase keeps its decision):

    0. **Fixed.** Nodes that cannot be lowered stay float32 with the reason: no float tensor
       (precision ``none``), no ONNX schema, control flow (bodies stay float32), an output
       type set by an attribute, a schema that does not admit the low dtype in this opset,
       a float input feeding shape arithmetic (``Reshape``'s shape, ``Resize``'s scales, …,
       and everything computing it), a policy pin on a compute-typed slot, or a constant
       input outside the low dtype's range when the policy says ``keep_fp32``, or (after
       ``CalibrateRangePass``) an activation beyond the low dtype's range / 2 on sample
       inputs. Node-name overrides apply here too.
       Example: ``MatMul`` in an opset-9 model has no ``tensor(bfloat16)`` -> float32.
    1. **Allow.** ``allow`` ops become low. Example: every ``MatMul``/``Conv``.
    2. **Deny spreads forward.** From every ``deny`` op, forward through ``infer``/``clear``
       ops: those stay float32. Example: ``Softmax -> Mul -> MatMul``: the Mul stays fp32.
    3. **Between allow.** ``infer``/``clear`` ops on a path from a low op to a low op, through
       ``infer``/``clear`` ops only, become low (no casts in between).
       Example: ``MatMul -> Add -> Relu -> MatMul``: Add and Relu become low.
    4. **Follow allow.** ``infer``/``clear`` ops whose float inputs all come from low ops (or
       constants, which are stored low) become low, in topological order.
       Example: ``MatMul -> Add(bias)`` at the end of the graph: the Add becomes low.
    5. **Backward follows forward.** In training graphs, the elementwise nodes a gradient
       rule wrote for a low forward op (``mpgraph.grad_of``) become low, even where a deny
       op among them would paint them float32: autocast runs a low op's backward in its
       dtype too. Example: the erf GELU's backward (``Pow``, ``Exp``, ``Div``, ...) of a
       bfloat16 GELU.
    6. **Clear backward.** ``clear`` ops whose every float consumer is a low op become low,
       so data movement happens in the low dtype; this includes clear ops that deny spread
       painted, as moving data is exact in any dtype. Example: ``Softmax -> Transpose ->
       MatMul`` (the attention backward's ``P^T``): the Transpose reads the Softmax output's
       existing low cast instead of transposing float32 and casting again.

    Training graphs (nodes carry ``mpgraph.role``): optimizer nodes stay float32, and backward
    nodes emitted for a ``deny`` forward op (``mpgraph.grad_of``) stay float32, in phase 0;
    backward MatMul/Gemm/Conv are ``allow`` ops like their forward twins.

    Everything else stays float32 with the reason (``infer op with float32 inputs``, …).
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        self._deny_forward: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        policy = self.policy
        low = policy.dtype
        previous = model.metadata_props.get(md.MODEL_DTYPE)
        if previous is not None and previous != low.name.lower() and not policy.is_identity:
            raise MpgraphError(
                f"model was already converted to {previous} (policy "
                f"{model.metadata_props.get(md.MODEL_POLICY, '?')}); convert the original float32 model instead"
            )
        graph = model.graph
        opsets = dict(model.opset_imports)
        nodes = [n for n in graph if md.NODE_INSERTED not in n.metadata_props]
        typings = {n: node_typing(n, opsets) for n in nodes}
        state: dict[ir.Node, str] = {}
        reason: dict[ir.Node, str] = {}
        category: dict[ir.Node, str] = {}

        def decide(node: ir.Node, precision: str, why: str) -> None:
            state[node] = precision
            reason[node] = why

        for node in nodes:
            recorded = node.metadata_props.get(md.NODE_PRECISION)
            if recorded is not None:
                state[node] = _LOW if recorded == low.name.lower() else (_NONE if recorded == "none" else _FP32)
                reason[node] = node.metadata_props.get(md.NODE_REASON, "recorded earlier")
        protected = _shape_protected_nodes(nodes)
        # Training graphs: backward nodes of deny ops (norms, softmax, losses) stay float32.
        self._deny_forward = {
            n.name: n.op_type
            for n in nodes
            if n.name
            and n.metadata_props.get(md.NODE_ROLE, "forward") in ("forward", "loss")
            and policy.category(n.op_type, n.domain)[0] == "deny"
        }

        # Phase 0: fixed decisions and overrides.
        for node in nodes:
            if node in state:
                continue
            fixed = self._fixed_reason(node, typings[node], opsets, protected)
            if fixed is not None:
                precision, why = fixed
                decide(node, precision, why)
                if precision == _FP32 and why.startswith("override"):
                    category[node] = "deny"
                continue
            override = policy.override_for(node.name or "")
            if override is not None:
                why = f"override '{override.pattern}'" + (f": {override.reason}" if override.reason else "")
                if override.precision == "low":
                    decide(node, _LOW, why)
                else:
                    decide(node, _FP32, why)
                    category[node] = "deny"
                continue
            category[node], cat_reason = policy.category(node.op_type, node.domain)
            reason[node] = cat_reason

        if policy.is_identity:
            for node in nodes:
                if node not in state:
                    decide(node, _FP32, "identity policy (float32)")
            return self._record(model, nodes, state, reason)

        fixed = set(state)
        candidates = [n for n in nodes if n not in state]
        # Phase 1: allow list.
        for node in candidates:
            if category[node] == "allow":
                decide(node, _LOW, f"allow list: {reason[node] or node.op_type}")
        # Phase 2: deny spreads forward through infer/clear.
        flexible = {n for n in candidates if n not in state and category[n] in ("infer", "clear")}
        painted: dict[ir.Node, ir.Node] = {}
        queue = collections.deque(n for n in nodes if category.get(n) == "deny")
        while queue:
            src = queue.popleft()
            origin = painted.get(src, src)
            for consumer in _float_consumers(src):
                if consumer in flexible and consumer not in painted:
                    painted[consumer] = origin
                    queue.append(consumer)
        for node, origin in painted.items():
            decide(node, _FP32, f"deny spreads forward from {origin.op_type} '{origin.name}' ({category[node]} op)")
        flexible -= painted.keys()
        # Phase 3: infer/clear between low nodes.
        lows = [n for n in nodes if state.get(n) == _LOW]
        downstream = _reach(lows, flexible, _float_consumers)
        upstream = _reach(lows, flexible, _float_producers)
        for node in candidates:
            if node in downstream and node in upstream:
                decide(node, _LOW, f"between low-precision ops ({category[node]} op)")
        flexible = {n for n in flexible if n not in state}
        # Phase 4: follow allow, in topological order.
        for node in nodes:
            if node not in flexible:
                continue
            sources = [_input_source(v) for v in _float_inputs(node, typings[node])]
            from_low = [s for s in sources if isinstance(s, ir.Node) and state.get(s) == _LOW]
            if from_low and all(s == "const" or (isinstance(s, ir.Node) and state.get(s) == _LOW) for s in sources):
                decide(node, _LOW, f"inputs come from low-precision ops ({category[node]} op)")
                flexible.discard(node)
        # Phase 5: backward follows its low forward op.
        if any(n.metadata_props.get(md.NODE_ROLE) == "backward" for n in nodes):
            twins = {n.name: n for n in nodes if n.name and n.metadata_props.get(md.NODE_ROLE) in ("forward", "loss")}
            for node in nodes:
                twin = twins.get(node.metadata_props.get(md.NODE_GRAD_OF, ""))
                if (
                    node in fixed
                    or twin is None
                    or state.get(twin) != _LOW
                    or node.op_type not in FOLLOW_FORWARD_OPS
                    or node.domain not in ("", "ai.onnx")
                    or category.get(node) == "allow"
                ):
                    continue
                decide(node, _LOW, f"backward of low-precision {twin.op_type} '{twin.name}' follows it")
                flexible.discard(node)
                painted.pop(node, None)
        # Phase 6: clear ops feeding only low ops (also those deny spread painted: moving data
        # is exact in any dtype, so only the consumers matter).
        for node in reversed(nodes):
            if not (node in flexible or node in painted) or category[node] != "clear":
                continue
            outs = [v for v in node.outputs if is_float(v.dtype)]
            consumers = [u.node for v in outs for u in v.uses()]
            if (
                outs
                and consumers
                and not any(v.is_graph_output() for v in outs)
                and all(state.get(c) == _LOW for c in consumers)
            ):
                decide(node, _LOW, "clear op feeding only low-precision ops")
                flexible.discard(node)
                painted.pop(node, None)
        # Phase 7: a softmax between low ops, or a sum of a low value, keeps float32 math in a
        # low-I/O kernel.
        for node in nodes:
            if node in state or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in LOW_IO_FLOAT32_SUMS and low == ir.DataType.BFLOAT16 and category.get(node) == "deny":
                sources = [_input_source(v) for v in _float_inputs(node, typings[node])]
                if sources and all(isinstance(s, ir.Node) and state.get(s) == _LOW for s in sources):
                    decide(node, _LOW, f"{node.op_type} of a bfloat16 value: float32 accumulation in the kernel, bfloat16 out")
                continue
            if node.op_type not in LOW_IO_FLOAT32_KERNELS:
                continue
            sources = [_input_source(v) for v in _float_inputs(node, typings[node])]
            consumers = [u.node for v in node.outputs for u in v.uses()]
            if (
                category.get(node) == "deny"
                and sources
                and all(isinstance(s, ir.Node) and state.get(s) == _LOW for s in sources)
                and consumers
                and not any(v.is_graph_output() for v in node.outputs)
                and all(state.get(c) == _LOW or c.metadata_props.get(md.NODE_ROLE) == "backward" for c in consumers)
                and any(state.get(c) == _LOW for c in consumers)
            ):
                decide(node, _LOW, f"{node.op_type} between low-precision ops: float32 math in a {low.name.lower()}-in, {low.name.lower()}-out kernel")
        for node in nodes:
            if node not in state:
                cat = category[node]
                why = reason[node] if cat == "deny" else f"{cat} op with float32 inputs"
                # A target's kernel gap (mpgraph.targets) is no policy entry: its reason stands alone.
                if cat == "deny" and not why.startswith("not listed") and " kernel on " not in why:
                    why = f"deny list: {why}"
                decide(node, _FP32, why)
        return self._record(model, nodes, state, reason)

    def _record(
        self,
        model: ir.Model,
        nodes: list[ir.Node],
        state: dict[ir.Node, str],
        reason: dict[ir.Node, str],
    ) -> ir.passes.PassResult:
        low_name = self.policy.dtype.name.lower()
        modified = False
        for node in nodes:
            precision = {_LOW: low_name, _FP32: "float32", _NONE: "none"}[state[node]]
            for key, val in ((md.NODE_PRECISION, precision), (md.NODE_REASON, reason[node])):
                if node.metadata_props.get(key) != val:
                    node.metadata_props[key] = val
                    modified = True
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.graph is model.graph or md.NODE_PRECISION in node.metadata_props:
                continue
            node.metadata_props[md.NODE_PRECISION] = "float32"
            node.metadata_props[md.NODE_REASON] = "inside a control-flow body (bodies stay float32)"
            modified = True
        return ir.passes.PassResult(model, modified)

    def _fixed_reason(
        self,
        node: ir.Node,
        typing: NodeTyping,
        opsets: dict[str, int],
        protected: dict[ir.Node, str],
    ) -> tuple[str, str] | None:
        low = self.policy.dtype
        has_float = any(is_float(v.dtype) for v in (*node.inputs, *node.outputs) if v is not None)
        if not has_float:
            return _NONE, "no float tensors"
        label = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if typing.schema is None:
            return _FP32, f"no ONNX schema for {label} (opset {opset_version(node, opsets)}); kept float32"
        if node.op_type in CONTROL_FLOW_OPS:
            return _FP32, "control flow (bodies stay float32)"
        if not typing.compute_vars:
            if any(v is not None and typing.bound.get(v) is not None and is_float(typing.bound[v]) for v in typing.output_vars):
                return _FP32, "output dtype set by an attribute or fixed by the schema"
            return _NONE, "no float compute (float inputs only read for shape or dtype-neutral)"
        if any(typing.bound[v] != ir.DataType.FLOAT for v in typing.compute_vars):
            bound = {typing.bound[v].name.lower() for v in typing.compute_vars}
            if bound == {low.name.lower()}:
                return _LOW, f"already computes in {low.name.lower()}"
            return _FP32, f"computes in {'/'.join(sorted(bound))}; only float32 ops are lowered"
        if self.policy.is_identity:
            return None
        if node.metadata_props.get(md.NODE_ROLE) == "optimizer":
            return _FP32, "optimizer step and its state stay float32"
        twin = node.metadata_props.get(md.NODE_GRAD_OF)
        if twin is not None and twin in self._deny_forward:
            return _FP32, f"backward of deny op {self._deny_forward[twin]} '{twin}' stays float32"
        if node in protected:
            return _FP32, protected[node]
        for slot, why in self.policy.pinned_slots(node.op_type, node.domain).items():
            if slot < len(typing.input_vars) and typing.input_vars[slot] in typing.compute_vars:
                return _FP32, f"input {slot} pinned to float32: {why}"
        if not typing.allows(low):
            return _FP32, (
                f"{label} in opset {opset_version(node, opsets)} has no {low.name.lower()} type; "
                "upgrade the opset to lower it"
            )
        override = self.policy.override_for(node.name or "")
        if override is not None and override.precision == "low":
            return None
        return self._range_reason(node, typing) or self._activation_reason(node, typing)

    def _activation_reason(self, node: ir.Node, typing: NodeTyping) -> tuple[str, str] | None:
        if self.policy.category(node.op_type, node.domain)[0] == "deny":
            return None  # float32 anyway; its deny reason says why
        limit = finite_max(self.policy.dtype) / CALIBRATION_MARGIN
        slots = [node.inputs[i] for i in typing.compute_inputs()] + [node.outputs[i] for i in typing.compute_outputs()]
        for value in slots:
            if value is None:
                continue
            absmax = value.meta.get(ABSMAX_META)
            if absmax is not None and absmax > limit:
                return _FP32, (
                    f"calibration: '{value.name}' reaches |x| = {absmax:.4g}, beyond "
                    f"{self.policy.dtype.name.lower()}'s range / {CALIBRATION_MARGIN:g}"
                )
        return None

    def _range_reason(self, node: ir.Node, typing: NodeTyping) -> tuple[str, str] | None:
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
                return _FP32, (
                    f"constant '{value.name}' exceeds {low.name.lower()} range "
                    f"(max |x| = {absmax:.4g} > {finite_max(low):.4g})"
                )
            if ranges.underflow == "keep_fp32":
                if tiny:
                    return _FP32, f"constant '{value.name}' has {tiny} nonzeros that flush to zero in {low.name.lower()}"
        return None


def _float_inputs(node: ir.Node, typing: NodeTyping) -> list[ir.Value]:
    return [v for v in (node.inputs[i] for i in typing.compute_inputs()) if v is not None]


def _input_source(value: ir.Value) -> ir.Node | str:
    if constant_tensor(value) is not None:
        return "const"
    producer = value.producer()
    return producer if producer is not None else "input"


def _float_consumers(node: ir.Node) -> Iterable[ir.Node]:
    for out in node.outputs:
        if is_float(out.dtype):
            for use in out.uses():
                yield use.node


def _float_producers(node: ir.Node) -> Iterable[ir.Node]:
    for value in node.inputs:
        if value is not None and is_float(value.dtype):
            producer = value.producer()
            if producer is not None:
                yield producer


def _reach(starts: list[ir.Node], through: set[ir.Node], step) -> set[ir.Node]:
    """Nodes in ``through`` reachable from ``starts`` by ``step`` while staying in ``through``."""
    seen: set[ir.Node] = set()
    queue = collections.deque(starts)
    while queue:
        node = queue.popleft()
        for nxt in step(node):
            if nxt in through and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


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
