"""``Program``: a step graph's contract and its session plans, read once.

A step graph (``build_training_graph``, maybe converted) says in its metadata what it is: the
state pairs (input -> output), the loss, the loss-scale state, the lr input, the data inputs
and what they must fit (``mpgraph._ir.contract.StepContract``). The ``Program`` reads that
once (``Program.contract``); the ``Executor`` and the training loop ask it instead of the graph. Its
session plans come from the lowering's one entry point, ``mpgraph.lowering.plan_session``:
the runtime never rewrites a graph itself.

Example:
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")
    >>> program = Program(step)
    >>> program.loss_name, [s.name for s in program.data_inputs], program.has_lr
    ('loss', ['x', 'label'], True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from mpgraph._ir.contract import LR_INPUT, StepContract
from mpgraph.data import InputSpec
from mpgraph.errors import MpgraphError
from mpgraph.io import ModelLike, as_model, as_proto
from mpgraph.lowering import PlanOptions, SessionPlan, plan_session
from mpgraph.runtime import probe
from mpgraph.runtime.checkpoint import graph_fingerprint
from mpgraph.runtime.options import RunOptions

if TYPE_CHECKING:
    from mpgraph.training.split_step_graph import SplitStep

__all__ = ["LR", "Program"]

#: The learning-rate input of a step graph.
LR = LR_INPUT


def _contract(model: ir.Model) -> StepContract:
    if not StepContract.recorded(model):
        raise MpgraphError("not a training step graph (no mpgraph.state_pairs metadata); build one with `mpgraph train-graph`")
    return StepContract.read(model)


def _data_inputs(model: ir.Model, names: Sequence[str]) -> list[InputSpec]:
    """The graph inputs a batch feeds (the contract's data inputs), with dtype and shape."""
    return [
        InputSpec(v.name, np.dtype(v.dtype.numpy() if v.dtype is not None else np.float32),
                  tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v.shape is not None else None)
        for v in model.graph.inputs if v.name in names
    ]


class Program:
    """The step contract of one step graph and the plans of its sessions.

    Attributes:
        model: The step graph (never changed).
        pairs: ``(state input, state output)`` in the graph's order.
        fingerprint: ``checkpoint.graph_fingerprint`` of the graph.
        initial: The state's initial values (the graph's initializers, or ``state``).
        default_lr: The graph's ``lr`` initializer (``None``: none).
        session_graph: The serialized graph sessions load: the state initializers left out
            (the state lives in the executor's buffers).
        loss_name, found_inf_name, scale_name: The loss output, the loss-scaling
            ``found_inf`` output and scale state input (``None`` when absent).
        extra_outputs: Outputs beyond the loss, ``found_inf`` and the new state.
        data_inputs: The inputs a batch feeds; ``has_lr``: whether the graph reads ``lr``.

    Raises:
        MpgraphError: Not a step graph, or a state input without an initial value.
    """

    def __init__(self, model: ModelLike, state: Mapping[str, np.ndarray] | None = None) -> None:
        self.model = as_model(model)
        self.contract = _contract(self.model)
        self.pairs: list[tuple[str, str]] = list(self.contract.state_pairs)
        self.state_names = {a for a, _ in self.pairs}
        self.initial = self._prepare(state)
        outputs = [o.name or "" for o in self.model.graph.outputs]
        self.loss_name: str = self.contract.loss or outputs[0]
        scaling = self.contract.loss_scale
        self.found_inf_name, self.scale_name = (scaling.found_inf, scaling.scale) if scaling is not None else (None, None)
        state_outs = {b for _, b in self.pairs}
        self.extra_outputs = [n for n in outputs if n not in state_outs and n not in (self.loss_name, self.found_inf_name)]
        self.data_inputs = _data_inputs(self.model, self.contract.data_inputs)
        self.has_lr = self.contract.lr is not None

    def _prepare(self, state: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """Set the fingerprint, default lr and session graph; return the initial state."""
        proto = as_proto(self.model)  # a copy: the session gets the graph without the state
        self.fingerprint = graph_fingerprint(proto)
        inits = self.model.graph.initializers
        missing = [a for a in self.state_names
                   if (a not in inits or inits[a].const_value is None) and (state is None or a not in state)]
        if missing:
            raise MpgraphError(f"state input(s) {', '.join(missing[:5])} have no initial value (initializer)")
        initial = {a: np.asarray(state[a]) if state is not None and a in state else inits[a].const_value.numpy()
                   for a, _ in self.pairs}
        lr = inits.get(LR)
        self.default_lr = float(lr.const_value.numpy()) if lr is not None and lr.const_value is not None else None
        kept = [t for t in proto.graph.initializer if t.name not in self.state_names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        self.session_graph: bytes = proto.SerializeToString()
        return initial

    # -- session plans --------------------------------------------------------------------

    @staticmethod
    def plan_options(options: RunOptions) -> PlanOptions:
        """What ``options`` ask of the lowering (the NCHWc block measured where it is used)."""
        cpu_kernels = options.provider != "cuda" and options.kernels is not False
        return PlanOptions(kernels=options.kernels, deterministic=options.deterministic,
                           nchwc_block=probe.nchwc_block() if cpu_kernels else 0)

    def plan(self, provider: str, options: PlanOptions,
             shapes: Mapping[str, Sequence[int]] | None = None) -> SessionPlan:
        """The session plan of this program on ``provider`` (specialised to ``shapes``)."""
        return plan_session(self.session_graph, provider, dataclasses.replace(options, shapes=shapes))

    @functools.cached_property
    def split(self) -> SplitStep:
        """The step cut into its gradient and apply parts (``training.split_step_graph``), the
        parts a data-parallel executor runs with a reduction between them."""
        # Imported here: a one-device run needs no split, and mpgraph.training is ~75 ms of import.
        from mpgraph.training.split_step_graph import split_step_graph

        return split_step_graph(self.model)

    def plan_part(self, part: ir.Model, provider: str, options: PlanOptions) -> SessionPlan:
        """The session plan of a part of this step graph (``split``'s, or one rank's share of
        its apply part): the state's initializers left out as in ``session_graph``, then
        ``plan_session`` with the rules a whole step gets."""
        proto = as_proto(part)
        kept = [t for t in proto.graph.initializer if t.name not in self.state_names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        return plan_session(proto.SerializeToString(), provider, options)

    # -- what the data must fit -----------------------------------------------------------

    def label_bounds(self) -> dict[str, tuple[int, int | None]]:
        """Data inputs that are class labels of a loss op, with (classes, ignore_index)
        (``StepContract.label_bounds``)."""
        return dict(self.contract.label_bounds)

    def vocab(self, token_input: str) -> int | None:
        """Rows of the embedding table a token input indexes (a Gather on it), if any
        (``StepContract.vocab``)."""
        return self.contract.vocab.get(token_input)
