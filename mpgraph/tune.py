"""``mpgraph tune``: the fewest ops to keep float32 so that an objective holds.

``tune`` converts the model with the policy (CPU emulation, so the numbers are the low dtype's
on any machine), measures an objective against the float32 model, and, while it fails, keeps
more of the lowered ops float32 through per-node overrides. It searches in phases:

Conversions run without ``convert``'s range check (``calibrate=None``): tune is the search that
the range check approximates, and it must see what the bare policy does.

1. **Check the ends.** No override: if the objective holds, nothing needs to stay float32.
   Every lowered op float32: if the objective still fails, no override set can meet it (the
   search stops and says so).
2. **Follow compare.** ``compare`` (``compare_train`` for step graphs) names the first value,
   in topological order, whose error passes the threshold; its producer is the first suspect. Example: a MatMul whose output
   overflows float16 is the first value to turn inf, and keeping it float32 is the answer.
3. **Bisect contiguous segments.** When the suspect alone is not enough, binary search for the
   shortest prefix (in topological order) of the remaining lowered ops whose float32 makes the
   objective hold; its last op is needed, so it is kept; repeat from 2.
4. **Minimize.** Drop every kept op whose removal still meets the objective.

The search assumes that keeping more ops float32 never makes the objective worse (true of
overflow and underflow; rounding errors can cancel, so the result is minimal in the sense of
phase 4: no single kept op can go). The result is a policy YAML that extends the base policy
with one ``float32`` override per kept op, and records the search time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import onnx_ir as ir
import yaml

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph.audit.compare import compare, relative_error
from mpgraph.data import check_inputs, random_feeds
from mpgraph.errors import MpgraphError, UsageError
from mpgraph.io import ModelLike, as_model
from mpgraph.policy import Policy, load_policy
from mpgraph.policy.schema import Override
from mpgraph.runtime.probe import run

__all__ = ["Objective", "OutputTolerance", "GradientTolerance", "LossAfterSteps", "TuneResult", "tune", "parse_objective"]

logger = logging.getLogger(__name__)


class Objective(Protocol):
    """What must hold: an error (lower is better) measured on a candidate, and its bound."""

    tol: float

    def describe(self) -> str: ...

    def bind(self, reference: ir.Model, feeds: Mapping[str, np.ndarray]) -> Callable[[ir.Model], float]:
        """Run the reference once; return the error function of a candidate."""
        ...


@dataclasses.dataclass(frozen=True)
class OutputTolerance:
    """Every float graph output within ``tol`` relative error (L2) of float32's, and finite."""

    tol: float = 2e-3

    def describe(self) -> str:
        return f"output relative error <= {self.tol:g}"

    def bind(self, reference: ir.Model, feeds: Mapping[str, np.ndarray]) -> Callable[[ir.Model], float]:
        ref = {k: v for k, v in run(reference, feeds, threads=1).items() if v.dtype.kind == "f"}

        def error(candidate: ir.Model) -> float:
            got = run(candidate, feeds, threads=1)
            return max((relative_error(r, got[k]) for k, r in ref.items() if k in got), default=0.0)

        return error


@dataclasses.dataclass(frozen=True)
class LossAfterSteps:
    """Training step graphs: the loss after ``steps`` steps on the feeds (one batch, repeated)
    within ``tol`` relative error of float32's, and finite."""

    steps: int = 10
    tol: float = 1e-2

    def describe(self) -> str:
        return f"loss after {self.steps} steps within {self.tol:g} relative"

    def bind(self, reference: ir.Model, feeds: Mapping[str, np.ndarray]) -> Callable[[ir.Model], float]:
        from mpgraph.runtime.trainer import Trainer

        if not StepContract.is_training(reference):
            raise MpgraphError("objective 'loss' needs a training step graph (run train-graph first)")

        def final_loss(model: ir.Model) -> float:
            trainer = Trainer(model, threads=1, track_scale=False)
            losses = [trainer.step(feeds).loss for _ in range(self.steps)]
            return losses[-1]

        ref = final_loss(reference)

        def error(candidate: ir.Model) -> float:
            got = final_loss(candidate)
            if not np.isfinite(got):
                return float("inf")
            return abs(got - ref) / max(abs(ref), 1e-30)

        return error


@dataclasses.dataclass(frozen=True)
class GradientTolerance:
    """Training step graphs: after one step on the feeds, every gradient the optimizer reads
    (unscaled) within ``tol`` relative error of float32's, and finite (``compare_train``)."""

    tol: float = 1e-2

    def describe(self) -> str:
        return f"every gradient's relative error <= {self.tol:g}"

    def bind(self, reference: ir.Model, feeds: Mapping[str, np.ndarray]) -> Callable[[ir.Model], float]:
        from mpgraph.audit.compare_train import compare_train

        if not StepContract.is_training(reference):
            raise MpgraphError("objective 'grad' needs a training step graph (run train-graph first)")

        def error(candidate: ir.Model) -> float:
            with np.errstate(invalid="ignore", over="ignore"):
                report = compare_train(reference, candidate, feeds)
            return max((g.rel_error for g in report.gradients), default=0.0)

        return error


def parse_objective(text: str) -> Objective:
    """``output:TOL``, ``grad:TOL`` or ``loss:STEPS:TOL``.

    Example:
        >>> parse_objective("output:1e-3")
        OutputTolerance(tol=0.001)
        >>> parse_objective("loss:5:0.01")
        LossAfterSteps(steps=5, tol=0.01)
        >>> parse_objective("grad:0.05")
        GradientTolerance(tol=0.05)
    """
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    expected = "expected output[:TOL], grad[:TOL] or loss[:STEPS[:TOL]]"

    def tol(p: str) -> float:
        # A NaN tolerance compares false with every error: the search stopped after one
        # conversion and wrote a policy that meets nothing.
        value = float(p)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"bad objective '{text}': the tolerance must be a finite number >= 0, got {p}")
        return value

    try:
        if kind == "output" and len(parts) <= 1:
            return OutputTolerance(*(tol(p) for p in parts))
        if kind == "grad" and len(parts) <= 1:
            return GradientTolerance(*(tol(p) for p in parts))
        if kind == "loss" and len(parts) <= 2:
            steps = int(parts[0]) if parts else 10
            if steps < 1:
                raise ValueError
            return LossAfterSteps(steps, *(tol(p) for p in parts[1:]))
    except ValueError:
        pass
    raise UsageError(f"bad objective '{text}': {expected}")


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What ``tune`` found.

    Attributes:
        policy: Name of the base policy.
        objective: The objective, in words.
        kept: Names of the nodes kept float32 (topological order).
        kept_ops: Their op types.
        candidates: How many nodes the base policy lowers.
        error_before: Objective error with no override.
        error_after: Objective error with the overrides.
        evaluations: Conversions measured.
        seconds: Search time (wall clock).
        met: Whether the objective holds with the overrides.
    """

    policy: str
    objective: str
    kept: list[str]
    kept_ops: list[str]
    candidates: int
    error_before: float
    error_after: float
    evaluations: int
    seconds: float
    met: bool

    def policy_yaml(self) -> str:
        """A policy file: the base policy plus one ``float32`` override per kept node."""
        head = (
            f"# written by mpgraph tune in {self.seconds:.1f} s ({self.evaluations} conversions measured)\n"
            f"# objective: {self.objective}; error {self.error_before:.3g} with no override, "
            f"{self.error_after:.3g} with these {len(self.kept)}\n"
        )
        body = {
            "name": f"{self.policy}-tuned",
            "extends": self.policy,
            "overrides": [
                {"match": _escape(name), "precision": "float32", "reason": f"tune: {op} kept float32 to meet {self.objective}"}
                for name, op in zip(self.kept, self.kept_ops)
            ],
        }
        return head + yaml.safe_dump(body, sort_keys=False, width=1000)


@dataclasses.dataclass(frozen=True)
class _NodeSet(Override):
    """The search's override: float32 for exactly these node names, one set lookup per node.
    (One fnmatch pattern per kept node costs minutes on a 10k-node graph; the written policy
    has those patterns, which match the same nodes.)"""

    names: frozenset[str] = frozenset()

    def matches(self, node_name: str) -> bool:
        return node_name in self.names


def _escape(name: str) -> str:
    """An fnmatch pattern matching exactly ``name``.

    Example:
        >>> _escape("a[0]*b")
        'a[[]0][*]b'
    """
    return re.sub(r"([*?\[])", r"[\1]", name)


def _producer_name(label: str) -> str | None:
    """``"MatMul 'name'"`` (compare's producer label) -> ``name``."""
    match = re.fullmatch(r"\S+ '(.*)'", label)
    return match.group(1) if match else None


def tune(
    model: ModelLike,
    policy: str | os.PathLike | Policy = "fp16",
    *,
    objective: Objective | None = None,
    feeds: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    max_evaluations: int = 500,
    progress: Callable[[int, float, int], None] | None = None,
) -> TuneResult:
    """Find the fewest ops of ``model`` to keep float32 under ``policy`` so ``objective`` holds.

    Args:
        model: A float32 model (inference or training step graph).
        policy: The base policy (e.g. ``fp16``).
        objective: ``OutputTolerance`` (default, 2e-3), ``GradientTolerance`` or ``LossAfterSteps``.
        feeds: Inputs; seeded random inputs when ``None``.
        seed: Seed of the random inputs.
        max_evaluations: Stop searching after this many conversions.
        progress: Called with (evaluations, last error, ops kept) after each evaluation.

    Raises:
        MpgraphError: The model was already converted, or the objective fails even with every
            lowered op float32.
    """
    start = time.perf_counter()
    base = load_policy(policy)
    if base.is_identity:
        raise UsageError("tune needs a low-precision policy (fp16, bf16, ...), not fp32")
    reference = as_model(model)
    if md.MODEL_POLICY in reference.metadata_props:
        raise MpgraphError("model was already converted; tune the original float32 model")
    objective = objective or OutputTolerance()
    if feeds is not None:
        check_inputs(feeds, "inputs")  # NaN inputs gave error 0 and a policy: nothing was compared
    inputs = dict(feeds) if feeds is not None else random_feeds(reference, seed=seed)
    evaluate = _Evaluator(reference, base, objective.bind(reference, inputs), objective.tol, max_evaluations, progress)
    # Phase 1, the ends: no override, then (if that fails) every lowered op float32.
    first_err, first_model = evaluate(frozenset())
    assert first_model is not None
    low_name = base.dtype.name.lower()
    order = [n.name for n in first_model.graph
             if n.name and not n.metadata_props.get(md.NODE_INSERTED) and n.metadata_props.get(md.NODE_PRECISION) == low_name]
    op_of = {n.name: n.op_type for n in first_model.graph if n.name}
    kept: frozenset[str] = frozenset()
    if first_err > objective.tol:
        every = frozenset(order)
        if not evaluate.holds(every):
            raise MpgraphError(
                f"objective ({objective.describe()}) fails even with all {len(order)} lowered ops float32 "
                f"(error {evaluate(every)[0]:.3g}); loosen the tolerance or check the float32 model"
            )
        try:
            kept = _search(order, evaluate, evaluate.holds, reference, inputs, compare)
        except _Budget:
            logger.warning("tune: stopped after %d conversions (max_evaluations)", evaluate.count)
            kept = every
    final_err = evaluate(kept)[0] if kept in evaluate.cache else first_err
    ordered = [n for n in order if n in kept]
    return TuneResult(
        policy=base.name,
        objective=objective.describe(),
        kept=ordered,
        kept_ops=[op_of.get(n, "?") for n in ordered],
        candidates=len(order),
        error_before=first_err,
        error_after=final_err,
        evaluations=evaluate.count,
        seconds=time.perf_counter() - start,
        met=final_err <= objective.tol,
    )


class _Evaluator:
    """The objective's error of the conversion that keeps a set of nodes float32, measured once per set.

    Conversions are emulated (the low dtype's numbers on any machine) and run without
    ``convert``'s range check (tune is the search the check approximates). Raises ``_Budget``
    past ``max_evaluations`` conversions.
    """

    def __init__(self, reference: ir.Model, base: Policy, error_of: Callable[[ir.Model], float], tol: float,
                 max_evaluations: int, progress: Callable[[int, float, int], None] | None) -> None:
        self.proto = ir.to_proto(reference)
        self.base, self.error_of, self.tol = base, error_of, tol
        self.max_evaluations, self.progress = max_evaluations, progress
        self.count = 0
        self.cache: dict[frozenset[str], float] = {}
        self.latest: dict[frozenset[str], ir.Model] = {}  # no override and the last candidate, for compare

    def __call__(self, kept: frozenset[str]) -> tuple[float, ir.Model | None]:
        from mpgraph.convert import convert

        if kept in self.cache:
            return self.cache[kept], self.latest.get(kept)
        if self.count >= self.max_evaluations:
            raise _Budget
        override = _NodeSet("<tune>", "float32", "tune", kept)
        pol = dataclasses.replace(self.base, overrides=(override,) + self.base.overrides)
        candidate = convert(ir.from_proto(self.proto), pol, emulate=True, validate=False, calibrate=None)
        err = self.error_of(candidate)
        self.count += 1
        self.cache[kept] = err
        for key in [k for k in self.latest if k]:  # keep the unmodified conversion: the search starts there
            del self.latest[key]
        self.latest[kept] = candidate
        if self.progress is not None:
            self.progress(self.count, err, len(kept))
        logger.info("tune: %d kept -> error %.3g", len(kept), err)
        return err, candidate

    def holds(self, kept: frozenset[str]) -> bool:
        return self(kept)[0] <= self.tol


class _Budget(Exception):
    """Internal: the evaluation budget ran out."""


def _search(
    order: Sequence[str],
    evaluate: Callable[[frozenset[str]], tuple[float, ir.Model | None]],
    holds: Callable[[frozenset[str]], bool],
    reference: ir.Model,
    inputs: Mapping[str, np.ndarray],
    compare: Callable[..., object],
) -> frozenset[str]:
    """Phases 2-4 of the module docstring; ``order`` is known to hold when all kept."""
    kept: frozenset[str] = frozenset()
    while not holds(kept):
        remaining = [n for n in order if n not in kept]
        suspect = _first_divergent(reference, evaluate(kept)[1], inputs, compare)
        if suspect in remaining and holds(kept | {suspect}):
            kept |= {suspect}
            break
        lo, hi = 0, len(remaining)  # prefix lo fails, prefix hi holds
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if holds(kept | frozenset(remaining[:mid])):
                hi = mid
            else:
                lo = mid
        kept |= {remaining[hi - 1]}
    for name in [n for n in order if n in kept]:
        if len(kept) > 1 and holds(kept - {name}):
            kept -= {name}
    return kept


def _first_divergent(reference: ir.Model, candidate: ir.Model | None, inputs: Mapping[str, np.ndarray],
                     compare: Callable[..., object]) -> str | None:
    if candidate is None:
        return None
    try:
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in overflowing values
            if StepContract.is_training(reference):
                from mpgraph.audit.compare_train import compare_train

                report = compare_train(reference, candidate, inputs)  # unscales backward values
            else:
                report = compare(reference, candidate, inputs)
    except MpgraphError:
        return None
    first = getattr(report, "first_divergence", None)
    worst = getattr(report, "worst", None)
    if first is None and callable(worst):
        ranked = worst(1)
        first = ranked[0] if ranked else None
    return _producer_name(first.producer) if first is not None else None
