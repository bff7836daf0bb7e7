"""ScaleLossPass: loss scaling inside the training step graph, in standard ONNX ops."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import Builder
from mpgraph._ir.contract import LossScaleState, StepContract
from mpgraph._ir.names import NameScope
from mpgraph.errors import MpgraphError
from mpgraph.policy.schema import LossScaling

__all__ = ["ScaleLossPass"]

#: Scope of every name the pass makes (``loss_scale/inv_scale``, ``loss_scale/<param>/unscaled``).
_SCOPE = "loss_scale"


class ScaleLossPass(ir.passes.InPlacePass):
    """Scales the loss gradient, unscales, checks finiteness and skips bad steps.

    Requires a training step graph from ``train-graph`` (metadata ``mpgraph.gradients``,
    ``mpgraph.grad_seed``, ``mpgraph.state_pairs``). Runs before precision assignment, so
    every node it adds is float32 (role ``optimizer``; the seed product is ``backward``).

    Rules, for ``mode: static`` and ``mode: dynamic`` (``none`` changes nothing):
        1. The gradient seed ``dloss/dloss = 1`` becomes ``seed * loss_scale``; the loss output
           itself stays unscaled.
        2. Each gradient the optimizer reads becomes ``Cast(g, float) * (1 / loss_scale)``.
           A flat optimizer's gradient buffer (the node tagged ``mpgraph.flat = gradient``)
           is unscaled once, and its member gradients are left alone.
        3. ``found_inf = IsNaN(sum_i ReduceSum(g_i) * 0)``: a sum is inf or NaN when one of
           its terms is (``x * 0`` is NaN exactly for inf/NaN), so one read of each gradient
           finds them. A sum of finite gradients that overflows float32 (its terms then
           average above 3.4e38 / count) counts as an overflow too: such a step is skipped
           and the scale backs off, where ``GradScaler`` would step. ``found_inf`` is a
           graph output. Example: a flat optimizer over 150 parameters: one ReduceSum.
        4. Every state output written by the optimizer (parameters, moments, step counter)
           becomes ``Where(found_inf, old, new)``: a skipped step leaves them bit-identical.
           BatchNorm running statistics update as in PyTorch (the forward ran). A flat
           optimizer's updated parameter is guarded once, before its Split:
           ``Split(Where(found_inf, flat_param, flat_new))`` copies the old values back
           exactly, so the per-parameter outputs it feeds get no Where of their own.
           An optimizer that marks its per-step coefficients (``mpgraph.on_skip`` on their
           nodes: Adam and AdamW) is gated instead: each marked coefficient becomes
           ``Where(found_inf, on_skip, c)`` and each gradient it reads
           ``Where(found_inf, 0, g)``, so the skipped update computes the old state itself
           (``m + (0 - m) * 0``, ``v * 1 + 0``, ``p * 1 - u * 0``; a parameter of -0.0 may
           come back as +0.0) with one select per gradient instead of one per state tensor;
           state marked ``old`` (the step counter, a scalar) is selected back as above.
           Example: AdamW on the H200 benchmark GPT (100 parameters, 36 packed slots): 100
           gradient selects and 6 scalar ones instead of 173 state selects (2,312 -> 2,245
           kernels a step, ``benchmarks/results/gpu_step_gated_skip.log``).
        5. Dynamic mode adds state ``loss_scale`` and ``loss_scale/growth_tracker`` updated as
           ``torch.amp.GradScaler``: on overflow ``scale = max(scale * backoff, min)`` and the
           tracker resets; after ``growth_interval`` finite steps in a row
           ``scale = min(scale * growth, max)``. Static mode keeps ``loss_scale`` a constant.
        6. The state is recorded by role in ``mpgraph.loss_scale_state`` (``found_inf``, and
           ``scale`` and ``growth_tracker`` in dynamic mode). A graph with that record is
           scaled already and left as it is; one without it whose own input or output is
           named ``loss_scale``, ``loss_scale/growth_tracker`` or ``found_inf`` is refused
           (the runtime would read the user's value as the scale).
    """

    def __init__(self, settings: LossScaling) -> None:
        super().__init__()
        self.settings = settings

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.settings.mode == "none" or not StepContract.is_training(model):
            return ir.passes.PassResult(model, False)
        if _already_scaled(model):
            return ir.passes.PassResult(model, False)
        contract, seed, grads = _seed_and_gradients(model)
        graph = model.graph
        names = NameScope(model)
        bwd = Builder(graph, role=md.Role.BACKWARD, scope=_SCOPE, names=names)
        opt = Builder(graph, role=md.Role.OPTIMIZER, scope=_SCOPE, names=names)
        pairs = [list(p) for p in contract.state_pairs]
        scale, tracker = self._scale(graph, opt)
        _scale_seed(bwd, seed, scale)
        marks = {n: n.metadata_props[md.NODE_ON_SKIP] for n in graph
                 if md.NODE_ON_SKIP in n.metadata_props and n.metadata_props.get(md.NODE_ROLE) == md.Role.OPTIMIZER}
        zero, found_inf, reads = _unscale_and_check(opt, graph, grads, scale)
        if marks:
            _gate_on_overflow(opt, {n: v for n, v in marks.items() if v != "old"}, reads, found_inf, zero)
            _skip_on_overflow(opt, graph, pairs, found_inf, only={n for n, v in marks.items() if v == "old"})
        else:
            _skip_on_overflow(opt, graph, pairs, found_inf)
        if tracker is not None:
            pairs += self._update_scale(opt, graph, scale, tracker, zero, found_inf)
        flag = opt.op("Identity", found_inf, name="found_inf")
        flag.name = md.FOUND_INF
        flag.shape = ir.Shape([])
        graph.outputs.append(flag)
        for node in (*bwd.tape.nodes, *opt.tape.nodes):
            is_bool = node.op_type in ("IsNaN", "GreaterOrEqual") or (node.op_type == "Identity" and node.inputs[0] is found_inf)
            node.outputs[0].type = ir.TensorType(ir.DataType.BOOL if is_bool else ir.DataType.FLOAT)
        state = LossScaleState(flag.name or md.FOUND_INF, *((md.LOSS_SCALE, md.GROWTH_TRACKER) if tracker is not None else ()))
        dataclasses.replace(contract, state_pairs=tuple((a, b) for a, b in pairs), loss_scale=state).record_state(model)
        graph.sort()  # the seed product and the unscales were appended after their readers
        return ir.passes.PassResult(model, True)

    def _scale(self, graph: ir.Graph, opt: Builder) -> tuple[ir.Value, ir.Value | None]:
        """The loss scale, and in dynamic mode the growth tracker (both state inputs); static
        mode's scale is a constant."""
        if self.settings.mode == "dynamic":
            return _state_input(graph, md.LOSS_SCALE, self.settings.init), _state_input(graph, md.GROWTH_TRACKER, 0.0)
        return _constant(opt, float(self.settings.init), "static_scale"), None

    def _update_scale(self, opt: Builder, graph: ir.Graph, scale: ir.Value, tracker: ir.Value, zero: ir.Value,
                      found_inf: ir.Value) -> list[list[str]]:
        """Rule 5: the updated scale and tracker as graph outputs; returns their state pairs."""
        s = self.settings
        grown_count = opt.op("Add", tracker, _constant(opt, 1.0, "one"), name="tracker_plus_one")
        grow = opt.op("GreaterOrEqual", grown_count, _constant(opt, float(s.growth_interval), "growth_interval"), name="grow")
        grown = opt.op("Min", opt.op("Mul", scale, _constant(opt, s.growth_factor, "growth_factor"), name="scale_grown"),
                       _constant(opt, s.max, "max"), name="scale_grown_capped")
        backed = opt.op("Max", opt.op("Mul", scale, _constant(opt, s.backoff_factor, "backoff_factor"), name="scale_backoff"),
                        _constant(opt, s.min, "min"), name="scale_backoff_floored")
        finite_scale = opt.op("Where", grow, grown, scale, name="finite_scale")
        finite_count = opt.op("Where", grow, zero, grown_count, name="finite_tracker")
        new_scale = opt.op("Where", found_inf, backed, finite_scale, name="new_scale")
        new_count = opt.op("Where", found_inf, zero, finite_count, name="new_tracker")
        new_scale.name = opt.unique(f"{md.LOSS_SCALE}/updated")
        new_count.name = opt.unique(f"{md.GROWTH_TRACKER}/updated")
        new_scale.shape = new_count.shape = ir.Shape([])
        graph.outputs.extend([new_scale, new_count])
        return [[md.LOSS_SCALE, new_scale.name], [md.GROWTH_TRACKER, new_count.name]]


def _already_scaled(model: ir.Model) -> bool:
    """Whether ``MODEL_LOSS_SCALE_STATE`` records the step graph as loss-scaled already.

    Raises:
        MpgraphError: Without that record, a graph input or output that has the name of the
            state the pass adds: a user's value, which the runtime would take for the state.
    """
    if LossScaleState.recorded(model):
        return True
    graph = model.graph
    taken = [v.name for v in graph.inputs if v.name in (md.LOSS_SCALE, md.GROWTH_TRACKER)]
    taken += [v.name for v in graph.outputs if v.name == md.FOUND_INF]
    if taken:
        raise MpgraphError(
            f"loss scaling: the step graph has a value named '{taken[0]}', but it is not the loss-scale "
            f"state (metadata '{md.MODEL_LOSS_SCALE_STATE}' does not record one); rename that input or "
            f"output of the model, since loss scaling adds its state under that name"
        )
    return False


def _seed_and_gradients(model: ir.Model) -> tuple[StepContract, ir.Value, list[tuple[str, ir.Value]]]:
    """The step contract, the gradient seed and the ``(parameter, gradient)`` pairs it names.

    Raises:
        MpgraphError: A step graph not from ``train-graph`` with an optimizer, one whose node
            roles were lost, or metadata naming missing values.
    """
    graph = model.graph
    missing = StepContract.missing(model, "gradients", "grad_seed", "state_pairs")
    if missing:
        raise MpgraphError(
            f"loss scaling needs a step graph built by `mpgraph train-graph` with an optimizer "
            f"(missing metadata {', '.join(missing)})"
        )
    contract = StepContract.read(model)
    if not any(node.metadata_props.get(md.NODE_ROLE) == md.Role.OPTIMIZER for node in graph):
        # Rule 4 finds what to guard by role: without roles a skipped step would still
        # apply its inf/NaN update. (onnx.version_converter drops node metadata.)
        raise MpgraphError(
            f"loss scaling: no node carries the '{md.NODE_ROLE}' optimizer role, so the update "
            f"could not be skipped on overflow; the node metadata was lost (opset upgrade: "
            f"{model.metadata_props.get(md.MODEL_OPSET_UPGRADED, 'none recorded')}); convert the step graph "
            f"from `mpgraph train-graph` again with --no-opset-upgrade (upgrade_opset=False)"
        )
    values: dict[str, ir.Value] = {}
    for value in (*(v for n in graph for v in n.outputs), *graph.inputs, *graph.initializers.values()):
        if value.name:
            values.setdefault(value.name, value)
    assert contract.grad_seed is not None and contract.gradients is not None
    seed = values.get(contract.grad_seed)
    grads = [(p, values.get(g)) for p, g in contract.gradients]
    if seed is None or any(g is None for _, g in grads):
        raise MpgraphError("loss scaling: the gradient seed or a gradient named in the metadata is missing")
    return contract, seed, [(p, g) for p, g in grads if g is not None]


def _scale_seed(bwd: Builder, seed: ir.Value, scale: ir.Value) -> None:
    """Rule 1: every reader of the seed reads ``seed * scale``."""
    uses = list(seed.uses())
    scaled_seed = bwd.op("Mul", seed, scale, name="scaled_seed")
    for use in uses:
        use.node.replace_input_with(use.idx, scaled_seed)


def _unscale_and_check(opt: Builder, graph: ir.Graph, grads: list[tuple[str, ir.Value]],
                       scale: ir.Value) -> tuple[ir.Value, ir.Value, list[tuple[ir.Value, list[ir.Usage]]]]:
    """Rules 2-3: the optimizer reads unscaled float32 gradients; returns the zero constant,
    ``found_inf``, and each unscaled gradient with the optimizer's reads of it."""
    inv = opt.op("Reciprocal", scale, name="inv_scale")
    zero = _constant(opt, 0.0, "zero")
    flat = _flat_nodes(graph)
    checked: list[tuple[str, ir.Value]] = []
    covered: set[ir.Value] = set()
    if md.FLAT_GRADIENT in flat:
        buffer = flat[md.FLAT_GRADIENT]
        covered = _flat_members(buffer)
        checked.append(("optim/flat", buffer.outputs[0]))
    checked += [(param, grad) for param, grad in grads if grad not in covered]
    total: ir.Value | None = None
    reads: list[tuple[ir.Value, list[ir.Usage]]] = []
    for param, grad in checked:
        uses = list(grad.uses())
        g32 = grad
        if grad.dtype != ir.DataType.FLOAT or md.FLAT_GRADIENT not in flat:
            g32 = opt.op("Cast", grad, to=ir.DataType.FLOAT, name=f"{param}/grad_fp32")
        unscaled = opt.op("Mul", g32, inv, name=f"{param}/unscaled")
        for use in uses:
            use.node.replace_input_with(use.idx, unscaled)
        reads.append((unscaled, uses))
        probe = opt.op("ReduceSum", unscaled, keepdims=0, name=f"{param}/sum")
        total = probe if total is None else opt.op("Add", total, probe, name=f"{param}/sum_total")
    assert total is not None
    total.shape = ir.Shape([])
    # Not IsFinite(total): IsNaN(total * 0), one scalar Mul.
    found_inf = opt.op("IsNaN", opt.op("Mul", total, zero, name="found_inf_probe"), name="found_inf_check")
    found_inf.shape = ir.Shape([])
    return zero, found_inf, reads


def _gate_on_overflow(opt: Builder, gates: dict[ir.Node, str], reads: list[tuple[ir.Value, list[ir.Usage]]],
                      found_inf: ir.Value, zero: ir.Value) -> None:
    """Rule 4, gated form: each marked coefficient takes its ``on_skip`` value (``"0"`` or
    ``"1"``) on overflow, and the optimizer reads zeros instead of the non-finite gradients."""
    one = _constant(opt, 1.0, "one_on_skip")
    for node, on_skip in gates.items():
        value = node.outputs[0]
        uses = list(value.uses())
        skipped = zero if on_skip == "0" else one
        gated = opt.op("Where", found_inf, skipped, value, name=f"{node.name}/gated")
        gated.shape = value.shape
        for use in uses:
            use.node.replace_input_with(use.idx, gated)
    for unscaled, uses in reads:
        safe = opt.op("Where", found_inf, zero, unscaled, name=f"{unscaled.name}/finite")
        safe.shape = unscaled.shape
        for use in uses:
            use.node.replace_input_with(use.idx, safe)


def _skip_on_overflow(opt: Builder, graph: ir.Graph, pairs: list[list[str]], found_inf: ir.Value,
                      only: set[ir.Node] | None = None) -> None:
    """Rule 4: every state output the optimizer writes becomes ``Where(found_inf, old, new)``
    (a flat optimizer's updated parameter once, before its Split); with ``only``, just the
    outputs those nodes make (a gated optimizer's ``old`` marks)."""
    outputs = {v.name: (i, v) for i, v in enumerate(graph.outputs)}
    inputs = {v.name: v for v in graph.inputs}
    flat = _flat_nodes(graph)
    split = flat.get(md.FLAT_SPLIT)
    if split is not None and md.FLAT_PARAM in flat and only is None:
        old_flat, new_flat = flat[md.FLAT_PARAM].outputs[0], split.inputs[0]
        assert new_flat is not None
        guarded_flat = opt.op("Where", found_inf, old_flat, new_flat, name="optim/flat/skip")
        guarded_flat.shape = old_flat.shape
        split.replace_input_with(0, guarded_flat)
    for state_in, state_out in pairs:
        index, new = outputs[state_out]
        producer = new.producer()
        if producer is None or producer.metadata_props.get(md.NODE_ROLE) != md.Role.OPTIMIZER:
            continue
        if only is not None and producer not in only:
            continue
        if split is not None and _reads_split(producer, split):
            continue  # guarded before the Split
        new.name = opt.unique(f"{state_out}/unguarded")
        guarded = opt.op("Where", found_inf, inputs[state_in], new, name=f"{state_in}/skip")
        guarded.name = state_out
        guarded.shape = new.shape or inputs[state_in].shape
        graph.outputs[index] = guarded


def _constant(b: Builder, value: float | bool, name: str) -> ir.Value:
    """A ``Constant`` node ``<scope>/<name>`` holding a float32 (or bool) scalar."""
    array: np.ndarray = np.array(value, dtype=np.bool_ if isinstance(value, bool) else np.float32)
    tensor = ir.tensor(array, name=b.unique(f"{b.scope}/{name}_value"))
    return b.op("Constant", name=name, value=tensor)


def _flat_nodes(graph: ir.Graph) -> dict[str, ir.Node]:
    """``{buffer: node}`` of the nodes a flat optimizer tagged with ``mpgraph.flat``."""
    found: dict[str, ir.Node] = {}
    for node in graph:
        buffer = node.metadata_props.get(md.NODE_FLAT)
        if buffer is None:
            continue
        if buffer in found:
            raise MpgraphError(f"loss scaling: two nodes are tagged as the flat {buffer} ('{found[buffer].name}', '{node.name}'); "
                               f"build the step with one flat optimizer")
        found[buffer] = node
    return found


def _flat_members(concat: ir.Node) -> set[ir.Value]:
    """The gradients a flat gradient Concat reads, each through its flattening Reshape (and
    through the optimizer's inner Concats where the Concat is built as a tree)."""
    members: set[ir.Value] = set()
    for value in concat.inputs:
        assert value is not None
        producer = value.producer()
        if producer is not None and producer.op_type == "Concat" and producer.metadata_props.get(md.NODE_ROLE) == md.Role.OPTIMIZER:
            members |= _flat_members(producer)
        elif producer is not None and producer.op_type == "Reshape" and producer.inputs[0] is not None:
            members.add(producer.inputs[0])
        else:
            members.add(value)
    return members


def _reads_split(node: ir.Node, split: ir.Node) -> bool:
    """``node`` is the flat Split or reads one of its outputs through Reshapes, Identities and
    the optimizer's inner Splits (a Split built as a tree)."""
    while node is not split:
        inner_split = node.op_type == "Split" and node.metadata_props.get(md.NODE_ROLE) == md.Role.OPTIMIZER
        if not (inner_split or node.op_type in ("Reshape", "Identity")) or node.inputs[0] is None:
            return False
        producer = node.inputs[0].producer()
        if producer is None:
            return False
        node = producer
    return True


def _state_input(graph: ir.Graph, name: str, init: float) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]),
                     const_value=ir.tensor(np.array(init, dtype=np.float32), name=name))
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value
