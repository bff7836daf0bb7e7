"""AssignPrecisionPass: decide, per node, whether it computes in the low dtype.

The algorithm is TensorFlow AMP's, written as named phases over the graph's float edges. Each
node ends with a ``Decision``: ``mpgraph.precision`` (a dtype name, or ``none`` for nodes that
compute on no float tensor) and ``mpgraph.reason`` in its metadata, written by
``record_decision``; no types change here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable

import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.links import forward_twins
from mpgraph._ir.meta import PRECISION_OF_DTYPE, Category, Phase, Precision, Role
from mpgraph.dtypes import is_float
from mpgraph.errors import MpgraphError
from mpgraph.optypes import NodeTyping, node_typing
from mpgraph.passes.precision_facts import (
    DEFAULT_DOMAINS,
    PrecisionFacts,
    constant_tensor,
)
from mpgraph.policy.schema import OpRule, Policy, RuleSource

__all__ = [
    "AssignPrecisionPass",
    "Decision",
    "record_decision",
]

logger = logging.getLogger(__name__)

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

_SUMS = frozenset({"ReduceSum", "ReduceMean"})

#: Elementwise ops a gradient rule writes for its forward op: when that forward op computes
#: low, they compute low too (phase 5), as autocast runs a low op's backward in its dtype.
#: The backward then moves half the bytes: on the H200 GPT the erf GELU's backward and the
#: attention scale's backward were float32 between two low ops, about 1 GB a layer.
FOLLOW_FORWARD_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Exp", "Pow", "Sqrt", "Reciprocal", "Where", "Erf", "Tanh", "Sigmoid"})

_PHASES = {phase.value: phase for phase in Phase}


@dataclasses.dataclass(frozen=True)
class Decision:
    """One node's precision: what, decided by which phase, why, and under which policy rule.

    >>> Decision(Precision.FLOAT32, Phase.DENY, "deny list: numerics").phase == "deny"
    True

    Attributes:
        precision: The dtype the node computes in (``Precision.NONE``: it touches no float).
        phase: The step that decided it. Code tests this, never ``reason``.
        reason: Why, in words for people (the audit shows it).
        rule: The policy's rule for the node (its op type's category, or the override that
            matched); ``None`` where no policy rule took part (phase 0's type facts).
    """

    precision: Precision
    phase: Phase
    reason: str
    rule: OpRule | None = None


def record_decision(node: ir.Node, decision: Decision) -> bool:
    """Write ``decision`` into ``node``'s metadata (the only writer of it); True if that changed it.

    ``mpgraph.precision``, ``mpgraph.reason`` and ``mpgraph.phase``, in that order.
    """
    changed = False
    keys = (md.NODE_PRECISION, md.NODE_REASON, md.NODE_PHASE)
    for key, value in zip(keys, (decision.precision, decision.reason, decision.phase)):
        if node.metadata_props.get(key) != value:
            node.metadata_props[key] = str(value)
            changed = True
    return changed


def _recorded_decision(node: ir.Node, low: Precision) -> Decision | None:
    """The decision an earlier run left on ``node`` (a converted model, convert's finite check)."""
    recorded = node.metadata_props.get(md.NODE_PRECISION)
    if recorded is None:
        return None
    if recorded == low or recorded == Precision.NONE:
        precision = Precision(recorded)
    else:
        precision = Precision.FLOAT32
    phase = _PHASES.get(node.metadata_props.get(md.NODE_PHASE, ""), Phase.RECORDED)
    return Decision(precision, phase, node.metadata_props.get(md.NODE_REASON, "recorded earlier"))


class AssignPrecisionPass(ir.passes.InPlacePass):
    """Decides every node's precision from a policy and records why.

    The phases are the methods of ``_Assignment``, in order; a node decided by an earlier
    phase keeps its decision (phases 5 and 6 may lower what phases 2-4 left float32, and
    phase 8 the float32 backward that phase 0 fixed for a softmax phase 7 lowered). Each
    decision is a ``Decision`` whose ``Phase`` is saved as ``mpgraph.phase``, and is logged at
    DEBUG level.

    0. **Fixed** (``fixed``): nodes that cannot be lowered, and overrides.
    1. **Allow** (``allow``): ``allow`` ops become low.
    2. **Deny spreads forward** (``deny_spreads``) through ``infer``/``clear`` ops.
    3. **Between allow** (``between_low``): ``infer``/``clear`` between low ops become low.
    4. **Follow allow** (``follow_low``): ``infer``/``clear`` fed only by low ops become low.
    5. **Backward follows forward** (``backward_follows_forward``), in training graphs.
    6. **Clear feeds low** (``clear_feeds_low``): ``clear`` ops feeding only low ops.
    7. **Low I/O kernels** (``low_io_kernels``): Softmax between low ops, bfloat16 sums.
    8. **Low-I/O backward** (``low_io_backward``): the backward of such a softmax follows it.
    9. **The rest** (``float32_rest``) stays float32 with its reason (``deny list: ...``,
       ``infer op with float32 inputs``, a target's kernel gap).

    Training graphs (nodes carry ``mpgraph.role``): optimizer nodes stay float32, and backward
    nodes emitted for a ``deny`` forward op (``mpgraph.grad_of``) stay float32, in phase 0
    (except a low-I/O softmax's, phase 8);
    backward MatMul/Gemm/Conv are ``allow`` ops like their forward twins. The identity policy
    runs phase 0 only; the rest stays float32 (``Phase.IDENTITY``).
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        _refuse_converted(model, self.policy)
        run = _Assignment(model, self.policy)
        run.fixed()
        if self.policy.is_identity:
            run.identity()
        else:
            run.allow()
            run.deny_spreads()
            run.between_low()
            run.follow_low()
            run.backward_follows_forward()
            run.clear_feeds_low()
            run.low_io_kernels()
            run.low_io_backward()
            run.float32_rest()
        return ir.passes.PassResult(model, run.record(model))


def _refuse_converted(model: ir.Model, policy: Policy) -> None:
    previous = model.metadata_props.get(md.MODEL_DTYPE)
    if previous is not None and previous != policy.dtype.name.lower() and not policy.is_identity:
        raise MpgraphError(
            f"model was already converted to {previous} (policy "
            f"{model.metadata_props.get(md.MODEL_POLICY, '?')}); convert the original float32 model instead"
        )


class _Assignment:
    """One run of the phases over a graph: the facts they read and the decisions so far."""

    def __init__(self, model: ir.Model, policy: Policy) -> None:
        self.policy = policy
        self.low = PRECISION_OF_DTYPE[policy.dtype]
        self.opsets = dict(model.opset_imports)
        self.nodes = [n for n in model.graph if md.NODE_INSERTED not in n.metadata_props]
        self.twins = forward_twins(self.nodes)  # backward node -> its forward node, by value
        self.typings = {n: node_typing(n, self.opsets) for n in self.nodes}
        self.decisions: dict[ir.Node, Decision] = {}
        #: The policy rule of every node phase 0 left open (and of overridden nodes).
        self.rules: dict[ir.Node, OpRule] = {}
        #: Nodes phase 0 decided; later phases never revisit them.
        self.fixed_nodes: set[ir.Node] = set()
        #: Undecided ``infer``/``clear`` nodes (phases 2-6 narrow it).
        self.flexible: set[ir.Node] = set()
        #: Node -> the deny node whose float32 spread to it (phase 2; phases 5-6 may undo).
        self.painted: dict[ir.Node, ir.Node] = {}

    def decide(self, node: ir.Node, precision: Precision, phase: Phase, reason: str) -> None:
        decision = Decision(precision, phase, reason, self.rules.get(node))
        self.decisions[node] = decision
        logger.debug("%s: %s '%s' -> %s (%s)", phase, node.op_type, node.name, precision, reason)

    def is_low(self, node: object) -> bool:
        decision = self.decisions.get(node) if isinstance(node, ir.Node) else None
        return decision is not None and decision.precision == self.low

    def category(self, node: ir.Node) -> Category | None:
        rule = self.rules.get(node)
        return rule.category if rule is not None else None

    def fixed(self) -> None:
        """Phase 0: nodes that cannot be lowered stay float32 (or ``none``), with the reason.

        No float tensor (precision ``none``), no ONNX schema, control flow (bodies stay
        float32), an output type set by an attribute, an input model that already computes
        the node in another float dtype (``Phase.INPUT_DTYPE``), a training role, a float
        input feeding shape arithmetic (``Reshape``'s shape, ``Resize``'s scales, ..., and
        everything computing it), a policy pin on a compute-typed slot, a schema that does
        not admit the low dtype in this opset, a constant input outside the low dtype's range
        when the policy says ``keep_fp32``, or (after ``CalibrateRangePass``) an activation
        beyond the low dtype's range / 2 on sample inputs (``Phase.CALIBRATION``). Node-name
        overrides apply here too (``Phase.OVERRIDE``). A decision already on the node (an
        earlier conversion, convert's finite check) is kept. Every other node gets its op
        type's policy rule for the phases below.

        Example: ``MatMul`` in an opset-9 model has no ``tensor(bfloat16)`` -> float32.
        """
        facts = PrecisionFacts(self.policy, self.nodes, self.opsets, self.typings, self.twins)
        for node in self.nodes:
            recorded = _recorded_decision(node, self.low)
            if recorded is not None:
                self.decisions[node] = recorded
                continue
            fixed = facts.fixed(node)
            if fixed is not None:
                self.decide(node, *fixed)
                continue
            override = self.policy.override_for(node.name or "")
            if override is None:
                self.rules[node] = self.policy.rule(node.op_type, node.domain)
                continue
            why = f"override '{override.pattern}'" + (f": {override.reason}" if override.reason else "")
            float32 = override.precision == Precision.FLOAT32
            self.rules[node] = OpRule(Category.DENY if float32 else Category.ALLOW, why, RuleSource.OVERRIDE)
            self.decide(node, Precision.FLOAT32 if float32 else self.low, Phase.OVERRIDE, why)
        self.fixed_nodes = set(self.decisions)

    def identity(self) -> None:
        """The identity policy: every node phase 0 left open stays float32."""
        for node in self.nodes:
            if node not in self.decisions:
                self.decide(node, Precision.FLOAT32, Phase.IDENTITY, "identity policy (float32)")

    def allow(self) -> None:
        """Phase 1: ``allow`` ops become low.

        Example: every ``MatMul``/``Conv`` -> ``allow list: <the policy's reason>``.
        """
        for node in self.nodes:
            if node not in self.decisions and self.category(node) == Category.ALLOW:
                why = self.rules[node].reason or node.op_type
                self.decide(node, self.low, Phase.ALLOW, f"allow list: {why}")

    def deny_spreads(self) -> None:
        """Phase 2: from every ``deny`` op, forward through ``infer``/``clear`` ops, float32.

        Example: ``Softmax -> Mul -> MatMul``: the Mul stays float32.
        """
        self.flexible = {
            n for n in self.nodes if n not in self.decisions and self.category(n) in (Category.INFER, Category.CLEAR)
        }
        queue = collections.deque(n for n in self.nodes if self.category(n) == Category.DENY)
        while queue:
            src = queue.popleft()
            origin = self.painted.get(src, src)
            for consumer in _float_consumers(src):
                if consumer in self.flexible and consumer not in self.painted:
                    self.painted[consumer] = origin
                    queue.append(consumer)
        for node, origin in self.painted.items():
            why = f"deny spreads forward from {origin.op_type} '{origin.name}' ({self.category(node)} op)"
            self.decide(node, Precision.FLOAT32, Phase.DENY_SPREAD, why)
        self.flexible -= self.painted.keys()

    def between_low(self) -> None:
        """Phase 3: ``infer``/``clear`` ops on a path from a low op to a low op, through
        ``infer``/``clear`` ops only, become low (no casts in between).

        Example: ``MatMul -> Add -> Relu -> MatMul``: Add and Relu become low.
        """
        lows = [n for n in self.nodes if self.is_low(n)]
        downstream = _reach(lows, self.flexible, _float_consumers)
        upstream = _reach(lows, self.flexible, _float_producers)
        for node in self.nodes:
            if node in downstream and node in upstream:
                self.decide(node, self.low, Phase.BETWEEN, f"between low-precision ops ({self.category(node)} op)")
        self.flexible = {n for n in self.flexible if n not in self.decisions}

    def follow_low(self) -> None:
        """Phase 4: ``infer``/``clear`` ops whose float inputs all come from low ops (or
        constants, which are stored low) become low, in topological order.

        Example: ``MatMul -> Add(bias)`` at the end of the graph: the Add becomes low.
        """
        for node in self.nodes:
            if node not in self.flexible:
                continue
            sources = [_input_source(v) for v in _float_inputs(node, self.typings[node])]
            if any(self.is_low(s) for s in sources) and all(s == "const" or self.is_low(s) for s in sources):
                why = f"inputs come from low-precision ops ({self.category(node)} op)"
                self.decide(node, self.low, Phase.FOLLOW, why)
                self.flexible.discard(node)

    def backward_follows_forward(self) -> None:
        """Phase 5: in training graphs, the elementwise nodes a gradient rule wrote for a low
        forward op (``mpgraph.grad_of``) become low, even where a deny op among them would
        paint them float32: autocast runs a low op's backward in its dtype too.

        Example: the erf GELU's backward (``Pow``, ``Exp``, ``Div``, ...) of a bfloat16 GELU.
        """
        if not any(n.metadata_props.get(md.NODE_ROLE) == Role.BACKWARD for n in self.nodes):
            return
        for node in self.nodes:
            twin = self.twins.get(node)
            if (
                node in self.fixed_nodes
                or twin is None
                or not self.is_low(twin)
                or node.op_type not in FOLLOW_FORWARD_OPS
                or node.domain not in DEFAULT_DOMAINS
                or self.category(node) == Category.ALLOW
            ):
                continue
            why = f"backward of low-precision {twin.op_type} '{twin.name}' follows it"
            self.decide(node, self.low, Phase.BACKWARD, why)
            self.flexible.discard(node)
            self.painted.pop(node, None)

    def clear_feeds_low(self) -> None:
        """Phase 6: ``clear`` ops whose every float consumer is a low op become low, so data
        movement happens in the low dtype; this includes clear ops that deny spread painted,
        as moving data is exact in any dtype (only the consumers matter).

        Example: ``Softmax -> Transpose -> MatMul`` (the attention backward's ``P^T``): the
        Transpose reads the Softmax output's existing low cast instead of transposing float32
        and casting again.
        """
        for node in reversed(self.nodes):
            if not (node in self.flexible or node in self.painted) or self.category(node) != Category.CLEAR:
                continue
            outs = [v for v in node.outputs if is_float(v.dtype)]
            consumers = [u.node for v in outs for u in v.uses()]
            if (
                outs
                and consumers
                and not any(v.is_graph_output() for v in outs)
                and all(self.is_low(c) for c in consumers)
            ):
                self.decide(node, self.low, Phase.CLEAR_FEEDS_LOW, "clear op feeding only low-precision ops")
                self.flexible.discard(node)
                self.painted.pop(node, None)

    def low_io_kernels(self) -> None:
        """Phase 7: a ``deny`` op whose low kernel computes in float32 inside takes low I/O
        where that costs nothing: a Softmax/LogSoftmax between low ops
        (``LOW_IO_FLOAT32_KERNELS``), a ReduceSum of a bfloat16 value (``LOW_IO_FLOAT32_SUMS``).

        Example: ``MatMul -> Softmax -> MatMul`` (attention, forward consumers low): the
        Softmax reads and writes bfloat16 and computes float32 inside.
        """
        low = self.low
        for node in self.nodes:
            if node in self.decisions or node.domain not in DEFAULT_DOMAINS or self.category(node) != Category.DENY:
                continue
            sources = [_input_source(v) for v in _float_inputs(node, self.typings[node])]
            from_low = bool(sources) and all(self.is_low(s) for s in sources)
            if node.op_type in LOW_IO_FLOAT32_SUMS and low == Precision.BFLOAT16:
                if from_low:
                    why = f"{node.op_type} of a bfloat16 value: float32 accumulation in the kernel, bfloat16 out"
                    self.decide(node, low, Phase.LOW_IO, why)
            elif node.op_type in LOW_IO_FLOAT32_KERNELS and from_low and self._feeds_low_forward(node):
                why = f"{node.op_type} between low-precision ops: float32 math in a {low}-in, {low}-out kernel"
                self.decide(node, low, Phase.LOW_IO, why)

    def _feeds_low_forward(self, node: ir.Node) -> bool:
        """Every consumer low or backward, one at least low, and no graph output."""
        consumers = [u.node for v in node.outputs for u in v.uses()]
        return (
            bool(consumers)
            and not any(v.is_graph_output() for v in node.outputs)
            and all(self.is_low(c) or c.metadata_props.get(md.NODE_ROLE) == Role.BACKWARD for c in consumers)
            and any(self.is_low(c) for c in consumers)
        )

    def low_io_backward(self) -> None:
        """Phase 8: the backward of a Softmax/LogSoftmax that phase 7 gave low I/O follows it:
        its elementwise and data-movement nodes become low, except a product that feeds a sum
        (the row sum keeps float32 products and accumulation). Phase 0 had kept them float32
        as the backward of a deny op; this phase revisits exactly those.

        Autocast's reasoning, as in phase 5: the softmax output and its gradient are low
        already (the MatMuls around them are), so float32 here bought only casts. Example:
        attention's ``dx = y * (dy - rowsum)`` over ``[batch, heads, T, T]`` computes in
        bfloat16 instead of casting ``y`` and ``dy`` up and ``dx`` back: on the H200 benchmark
        GPT, cast kernels 4.12 -> 2.82 ms and the bf16 step 24.2 -> 22.2 ms
        (``benchmarks/results/gpu_step_softmax_bwd_prototype.log``).
        """
        lowered = {n for n in self.nodes
                   if n in self.decisions and self.decisions[n].phase == Phase.LOW_IO and n.op_type in LOW_IO_FLOAT32_KERNELS}
        if not lowered:
            return
        for node in self.nodes:
            twin = self.twins.get(node)
            if twin not in lowered or node.metadata_props.get(md.NODE_ROLE) != Role.BACKWARD or node.domain not in DEFAULT_DOMAINS:
                continue
            decided = self.decisions.get(node)
            if decided is not None and decided.precision != Precision.FLOAT32:
                continue  # only phase 0's float32; a Shape (precision none) stays as it is
            # Data movement (the policy's clear ops, as in phase 6) is exact in any dtype.
            movement = self.policy.rule(node.op_type, node.domain).category == Category.CLEAR
            if not (movement or node.op_type in FOLLOW_FORWARD_OPS):
                continue
            consumers = [u.node for v in node.outputs for u in v.uses()]
            if not movement and consumers and all(c.op_type in _SUMS for c in consumers):
                continue
            why = f"backward of low-I/O {twin.op_type} '{twin.name}' follows it"
            self.decide(node, self.low, Phase.LOW_IO_BACKWARD, why)
            self.fixed_nodes.discard(node)

    def float32_rest(self) -> None:
        """Phase 9: every node still open stays float32, with the reason of its rule.

        Example: ``Softmax`` (deny) -> ``deny list: <the policy's reason>``; an unlisted op
        -> ``not listed (default deny)``; ``Add`` after a float32 input -> ``infer op with
        float32 inputs``; an op the target has no low kernel for -> ``no bfloat16 kernel on
        cpu (...)`` (``Phase.KERNEL_GAP``).
        """
        for node in self.nodes:
            if node in self.decisions:
                continue
            rule = self.rules[node]
            if rule.category != Category.DENY:
                self.decide(node, Precision.FLOAT32, Phase.FLOAT32_INPUTS, f"{rule.category} op with float32 inputs")
            elif rule.source == RuleSource.TARGET:
                self.decide(node, Precision.FLOAT32, Phase.KERNEL_GAP, rule.reason)
            elif rule.source == RuleSource.POLICY:
                self.decide(node, Precision.FLOAT32, Phase.DENY, f"deny list: {rule.reason}")
            else:
                self.decide(node, Precision.FLOAT32, Phase.DENY, rule.reason)

    def record(self, model: ir.Model) -> bool:
        """Write every decision, and float32 on control-flow bodies; whether anything changed."""
        modified = False
        for node in self.nodes:
            modified |= record_decision(node, self.decisions[node])
        body = Decision(Precision.FLOAT32, Phase.BODY, "inside a control-flow body (bodies stay float32)")
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.graph is model.graph or md.NODE_PRECISION in node.metadata_props:
                continue
            record_decision(node, body)
            modified = True
        return modified


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
