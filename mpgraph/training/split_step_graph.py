"""``split_step_graph``: a step graph cut into a gradient part and an apply part.

Data-parallel training runs the forward and backward on each rank's share of the batch,
reduces the gradients across ranks, and then applies the same update on every rank. The
step graph from ``build_training_graph`` (converted or not) does all three in one graph; this
module cuts it where the gradients the optimizer reads are made:

1. **The cut.** Each gradient named in ``mpgraph.gradients`` is cut where it is made. A
   gradient in a low dtype (native fp16/bf16) whose only readers are one ``Cast`` to float32
   is cut after that Cast, so gradients cross the cut, and are reduced, in float32.
2. **The gradient part** is every node the cut gradients and the loss need: forward,
   backward, and with loss scaling the scaled seed (``seed * loss_scale``). Its outputs are
   the loss, the cut gradients, and the values the apply part also reads from it (see 4).
3. **The apply part** is every other node: loss scaling's unscale, its finite check
   (``found_inf``) and scale update, and the optimizer. Its inputs are the cut gradients
   (as inputs of the same names) and whatever state, ``lr`` and constants it reads. Fed
   reduced gradients, every rank computes the same ``found_inf`` from the same numbers, so
   all ranks skip together and the scale sequence is the single-process one. Example: rank
   1 makes an inf gradient; the reduced sum is inf on every rank, every rank skips.
4. **Values read across the cut** that depend only on parameters and state are the same on
   every rank and go across as extra outputs/inputs (``passthrough``). A value that depends
   on the batch (a BatchNorm's batch statistics feeding its running-average update) would
   differ per rank: the split refuses it, and a state output the forward makes from the
   batch (BatchNorm running statistics in training mode) too.

Running the gradient part, then the apply part on its gradients, gives the original step's
outputs bit for bit on ORT CPU (measured on the zoo MLP and GPT, fp32 and fp16 loss-scaled,
``tests/test_split_step_graph.py``).

Example:
    >>> from mpgraph.training import build_training_graph
    >>> split = split_step_graph(build_training_graph("models/onnx/tiny_mlp.loss.onnx"))
    >>> split.gradients[0], split.data_inputs
    (('fc1.weight', 'grad/node_linear/Gemm'), ('x', 'label'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph._ir.links import ancestors
from mpgraph.errors import MpgraphError
from mpgraph.training.shard_flat_slot import FlatSlot, shard_flat_slots

__all__ = ["SplitStep", "deal_groups", "optimizer_groups", "shard_apply_part", "split_step_graph"]


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """A step graph's gradient and apply parts.

    Attributes:
        gradient: Data, parameters (and loss-scale state) -> loss, gradients, passthrough.
        apply: State, ``lr``, gradients, passthrough -> every state output and ``found_inf``.
        gradients: ``(parameter, gradient value name)`` in ``mpgraph.gradients`` order; the
            name is an output of ``gradient`` and an input of ``apply``; all float32.
        passthrough: Names of the other values ``apply`` reads from ``gradient``.
        loss: Name of the loss output of ``gradient``.
        data_inputs: Inputs of ``gradient`` that are neither state, ``lr`` nor initialized.
        state_pairs: ``(state input, updated output)`` of the step graph; every output is
            made by ``apply``, and each part reads the state inputs it needs.
    """

    gradient: ir.Model
    apply: ir.Model
    gradients: tuple[tuple[str, str], ...]
    passthrough: tuple[str, ...]
    loss: str
    data_inputs: tuple[str, ...]
    state_pairs: tuple[tuple[str, str], ...]


def split_step_graph(model: ir.Model) -> SplitStep:
    """Cut a training step graph into its gradient and apply parts (the module's rules 1-4).

    Args:
        model: A step graph from ``build_training_graph`` with an optimizer, converted or not.
            It is not modified.

    Raises:
        MpgraphError: The graph lacks the step metadata, a gradient has a low dtype read by
            more than one float32 Cast, or the apply part reads a value that depends on the
            batch.
    """
    if StepContract.missing(model, "gradients", "loss") or not StepContract.recorded(model):
        raise MpgraphError("split: not a step graph with an optimizer (no 'mpgraph.gradients' metadata); "
                           "build it with `mpgraph train-graph --optimizer ...`")
    contract = StepContract.read(model)
    assert contract.gradients is not None and contract.loss is not None
    proto = ir.to_proto(model)
    grad_model, apply_model = ir.from_proto(proto), ir.from_proto(proto)
    nodes = list(grad_model.graph)
    values = _values_by_name(grad_model.graph)
    cuts = [(param, _cut(values[name], param)) for param, name in contract.gradients]
    loss = values[contract.loss]
    in_grad = ancestors([v for _, v in cuts] + [loss])
    data = _data_inputs(grad_model, contract)
    crossing = _crossing(nodes, in_grad, {v for _, v in cuts})
    _refuse_batch_dependent(nodes, crossing, data)
    _refuse_state_made_in_gradient_part(grad_model.graph, in_grad, loss)
    cut_names = [v.name or "" for _, v in cuts]
    passthrough = [v.name or "" for v in crossing]
    _keep_gradient_part(grad_model, in_grad, [loss.name or "", *cut_names, *passthrough])
    _keep_apply_part(apply_model, {i for i, n in enumerate(nodes) if n in in_grad}, [*cut_names, *passthrough])
    data_inputs = tuple(v.name or "" for v in grad_model.graph.inputs if v in data)
    return SplitStep(grad_model, apply_model, tuple((p, n) for (p, _), n in zip(cuts, cut_names, strict=True)),
                     tuple(passthrough), loss.name or "", data_inputs,
                     contract.state_pairs)


def optimizer_groups(split: SplitStep) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """The apply part's state, split into groups that update independently, for sharding.

    Two state inputs are in one group when the update of one reads the other: a parameter
    and its moments; every parameter of a packed (flat) slot with the slot's moments. State
    of at most one element (the step counter, the loss scale) is left out of the groups: it
    is read by every update, so every rank computes it.

    Returns:
        The groups (state input names, in ``state_pairs`` order), and the scalar state.

    Example: per-tensor AdamW over ``w, b``: ``[("w", "optim/w/m", "optim/w/v"), ("b", ...)]``
    and ``("optim/step",)``.
    """
    graph = split.apply.graph
    inputs = {v.name: v for v in graph.inputs}
    made = {v.name: v for v in graph.outputs}
    pairs = [(a, b) for a, b in split.state_pairs if b in made]
    scalar = tuple(a for a, _ in pairs if _numel(inputs.get(a)) <= 1)
    grouped = [(a, b) for a, b in pairs if a not in scalar]
    root = {a: a for a, _ in grouped}

    def find(a: str) -> str:
        while root[a] != a:
            a = root[a]
        return a

    for a, b in grouped:
        for node in ancestors([made[b]]):
            for value in node.inputs:
                if value is not None and value.name in root:
                    root[find(value.name)] = find(a)
    groups: dict[str, list[str]] = {}
    for a, _ in grouped:
        groups.setdefault(find(a), []).append(a)
    return [tuple(g) for g in groups.values()], scalar


def deal_groups(sizes: list[int], world: int) -> list[int]:
    """The rank that owns each group: largest first, to the least-loaded rank (lowest on a tie).

    Example:
        >>> deal_groups([10, 3, 8, 4], 2)
        [0, 0, 1, 1]
    """
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def shard_apply_part(split: SplitStep, outputs: set[str], slots: Sequence[FlatSlot] = (), rank: int = 0,
                     world: int = 1) -> ir.Model:
    """A copy of the apply part that makes only ``outputs`` (and ``found_inf``), with only the
    nodes and inputs they need: one rank's share of a sharded optimizer. Each of ``slots`` is
    updated in this rank's slice (``shard_flat_slots``) and gives that slice as an output."""
    model = ir.from_proto(ir.to_proto(split.apply))
    shard_flat_slots(model, list(slots), rank, world)
    graph = model.graph
    outputs = outputs | {slot.output for slot in slots}
    kept = [v for v in graph.outputs if v.name in outputs or v.name == md.FOUND_INF]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    needed = ancestors(kept)
    graph.remove([n for n in graph if n not in needed], safe=True)
    _drop_unused_inputs(graph)
    return model


def _numel(value: ir.Value | None) -> int:
    if value is None or value.shape is None:
        return 0
    return int(np.prod([d if isinstance(d, int) else 2 for d in value.shape], dtype=np.int64))


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    found: dict[str, ir.Value] = {}
    for value in (*graph.inputs, *graph.initializers.values(), *(v for n in graph for v in n.outputs)):
        if value.name:
            found.setdefault(value.name, value)
    return found


def _cut(grad: ir.Value, param: str) -> ir.Value:
    """Rule 1: the gradient itself, or its one float32 Cast when it is made in a low dtype."""
    if grad.dtype == ir.DataType.FLOAT:
        return grad
    readers = {use.node for use in grad.uses()}
    casts = [n for n in readers if n.op_type == "Cast" and n.attributes.get_int("to") == ir.DataType.FLOAT]
    if len(casts) == 1 and len(readers) == 1:
        return casts[0].outputs[0]
    raise MpgraphError(f"split: the gradient of '{param}' ('{grad.name}') is {grad.dtype} and is read by "
                       f"{sorted(n.op_type for n in readers)}, not by one Cast to float32; the gradients "
                       f"must cross the cut in float32 (convert with loss scaling, or in float32)")


def _data_inputs(model: ir.Model, contract: StepContract) -> set[ir.Value]:
    """The contract's data inputs that have no initializer: the batch."""
    data = set(contract.data_inputs)
    return {v for v in model.graph.inputs if v.name in data and v.name not in model.graph.initializers}


def _crossing(nodes: list[ir.Node], in_grad: set[ir.Node], cuts: set[ir.Value]) -> list[ir.Value]:
    """Values made in the gradient part and read by the apply part, other than the cuts."""
    found: dict[ir.Value, None] = {}
    for node in nodes:
        if node in in_grad:
            continue
        for value in node.inputs:
            if value is not None and value not in cuts and value.producer() in in_grad:
                found[value] = None
    return list(found)


def _refuse_batch_dependent(nodes: list[ir.Node], crossing: list[ir.Value], data: set[ir.Value]) -> None:
    """Rule 4: a value read across the cut must not depend on the batch."""
    tainted: set[ir.Value] = set(data)
    for node in nodes:
        if any(v in tainted for v in node.inputs if v is not None):
            tainted.update(node.outputs)
    for value in crossing:
        if value in tainted:
            producer = value.producer()
            raise MpgraphError(
                f"split: the optimizer side reads '{value.name}' (made by node '{producer.name if producer else ''}'), "
                f"which depends on the batch, so it would differ between ranks (BatchNorm running statistics "
                f"do); build the step graph with --batchnorm eval or without such state"
            )


def _refuse_state_made_in_gradient_part(graph: ir.Graph, in_grad: set[ir.Node], loss: ir.Value) -> None:
    """Rule 4 for outputs: a state output the forward makes (BatchNormalization's running
    statistics in training mode) is per-rank."""
    for value in graph.outputs:
        if value is not loss and value.producer() in in_grad:
            raise MpgraphError(
                f"split: the state output '{value.name}' is made by the forward pass from the batch, so it would "
                f"differ between ranks (BatchNorm running statistics in training mode); build the step graph "
                f"with --batchnorm eval"
            )


def _keep_gradient_part(model: ir.Model, keep: set[ir.Node], outputs: list[str]) -> None:
    graph = model.graph
    values = _values_by_name(graph)
    graph.outputs.clear()
    graph.outputs.extend(values[name] for name in outputs)
    graph.remove([n for n in graph if n not in keep], safe=True)
    _drop_unused_inputs(graph)
    _keep_needed_metadata(model, ())


def _keep_apply_part(model: ir.Model, drop: set[int], cut: list[str]) -> None:
    """The other nodes; each cut value becomes a same-named graph input."""
    graph = model.graph
    nodes = list(graph)
    values = _values_by_name(graph)
    for name in cut:
        old = values[name]
        new = ir.Value(name=name, type=old.type, shape=old.shape)
        old.replace_all_uses_with(new)
        old.name = f"{name}/made"
        graph.inputs.append(new)
    made = {v for i in drop for v in nodes[i].outputs}
    kept = [v for v in graph.outputs if v not in made]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    graph.remove([nodes[i] for i in sorted(drop)], safe=True)
    _drop_unused_inputs(graph)
    _keep_needed_metadata(model, (md.MODEL_LOSS, md.MODEL_GRAD_SEED))


def _drop_unused_inputs(graph: ir.Graph) -> None:
    """Inputs and initializers no node reads and no output is."""
    outputs = set(graph.outputs)
    for value in list(graph.inputs):
        if not value.uses() and value not in outputs:
            graph.inputs.remove(value)
            graph.initializers.pop(value.name or "", None)
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in outputs and not value.is_graph_input():
            del graph.initializers[name]


def _keep_needed_metadata(model: ir.Model, drop: tuple[str, ...]) -> None:
    """The parts are not step graphs of their own: no state pairs (the runner pairs state)."""
    for key in (md.MODEL_STATE_PAIRS, md.MODEL_TRAINING, *drop):
        model.metadata_props.pop(key, None)
