"""``check_grad``: every parameter's gradient against central finite differences of the loss."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir.contract import StepContract
from mpgraph.check_grad.fd import central, direction
from mpgraph.check_grad.graphs import forward_model, inference_dropout, load
from mpgraph.check_grad.inputs import BATCH, generate_inputs, random_weights, read_inputs
from mpgraph.check_grad.localize import localize as localize_nodes
from mpgraph.check_grad.precision import (
    EPS,
    Precision,
    cast_feeds,
    conv_shapes,
    param_tolerance,
    session_in_best_dtype,
)
from mpgraph.check_grad.report import GradCheckReport, NodeCheck, ParamCheck, Progress
from mpgraph.runtime.check_runs import CheckSession

__all__ = ["check_grad"]


def check_grad(
    model: ir.Model | onnx.ModelProto | str | os.PathLike[str],
    loss: str | None = None,
    inputs: str | os.PathLike[str] | Mapping[str, np.ndarray] | None = None,
    *,
    seed: int = 0,
    batch: int = BATCH,
    freeze: Sequence[str] = (),
    batchnorm: str = "train",
    localize: bool = True,
    float64: bool = True,
    step: float | None = None,
    rtol: float | None = None,
    random_weights: bool = False,
    progress: Progress | None = None,
) -> GradCheckReport:
    """Compare every parameter's gradient with central finite differences of the loss.

    Args:
        model: Forward model (onnx-ir, protobuf or path), as for ``build_training_graph``.
        loss: As ``build_training_graph``'s ``loss`` (an output name, ``cross_entropy``, ``mse``).
        inputs: Data inputs (an ``.npz`` path or a dict); default: generated from ``seed``.
        seed: Seed of generated inputs, directions and cotangents.
        batch: Size of symbolic leading dimensions of generated inputs.
        freeze: Parameters to leave out (fnmatch patterns).
        batchnorm: As ``build_training_graph``.
        localize: When a parameter fails, check each node on the backward path alone.
        float64: Try float64 first (``False``: float32 only).
        step: Relative finite-difference step (default by precision, ``precision.STEP``).
        rtol: Pass threshold on the relative error (default by precision, ``precision.RTOL``).
        random_weights: Check at seeded random parameters instead of the model's own: for
            files whose weights are placeholders (the onnx test "light" models hold constant
            weights, which make every logit equal and most gradients zero).
        progress: ``progress(phase, done, total)`` after each parameter or node.

    Returns:
        The report; ``report.passed`` is false when some parameter disagrees.

    Raises:
        InputsError: ``inputs`` lacks a data input or has a key the model does not take.
        MpgraphError: The gradient graph cannot be built or ONNX Runtime cannot run it.
    """
    notes: list[str] = []
    step_model, loss_name, params = _gradient_graph(model, loss, freeze, batchnorm, notes)
    base, feeds = _data(step_model.graph, params, inputs, seed, batch, random_weights, notes)
    run, grad_prec = _runs(step_model, loss_name, params, feeds, base, float64, step, rtol)
    checks = []
    for i, p in enumerate(params):
        checks.append(_check_param(run, p, base[p], np.asarray(run.grads[p], np.float64), np.random.default_rng([seed, 1, i])))
        if progress is not None:
            progress("parameters", i + 1, len(params))
    if checks and all(c.analytic == 0.0 for c in checks):
        notes.append("every gradient is exactly zero: nothing was checked (a constant loss? try another --loss "
                     "or --random-weights)")
    bad: list[NodeCheck] = []
    checked = 0
    if localize and any(not c.passed for c in checks):
        bad, checked, skipped = localize_nodes(step_model, loss_name, params, run.feeds, run.prec.dtype, seed, progress)
        if skipped:
            notes.append(f"{len(skipped)} node(s) could not be checked alone: {', '.join(skipped[:5])}")
    return GradCheckReport(
        loss=loss_name, dtype=run.prec.label, analytic_dtype=grad_prec.label,
        dtype_note=run.prec.note or (f"gradient graph: {grad_prec.note}" if grad_prec.note else ""),
        step=run.rel_step, rtol=run.rtol, seed=seed,
        inputs=tuple((k, tuple(int(s) for s in v.shape), str(v.dtype)) for k, v in feeds.items()),
        params=tuple(checks), bad_nodes=tuple(bad), nodes_checked=checked, notes=tuple(notes),
    )


def _gradient_graph(model: ir.Model | onnx.ModelProto | str | os.PathLike[str], loss: str | None,
                    freeze: Sequence[str], batchnorm: str, notes: list[str]) -> tuple[ir.Model, str, list[str]]:
    """The step graph without an optimizer (loss and ``grad/<param>`` outputs), its loss and parameters.
    Dropout runs in inference mode: a random mask has no finite difference."""
    from mpgraph.training import build_training_graph, refuse_step_graph

    fwd = load(model)
    # Its optimizer outputs are no gradients: the check failed inside ORT on a float64 scalar.
    refuse_step_graph(fwd, model if isinstance(model, (str, os.PathLike)) else "model")
    dropped = inference_dropout(fwd.graph)
    if dropped:
        notes.append(f"Dropout ran in inference mode ({dropped} node(s)): a random mask has no finite difference")
    step_model = build_training_graph(fwd, optimizer=None, loss=loss, freeze=freeze, batchnorm=batchnorm)
    graph = step_model.graph
    loss_name = StepContract.read(step_model).loss or "loss"
    params = [o.name[len("grad/"):] for o in graph.outputs if o.name and o.name.startswith("grad/")]
    return step_model, loss_name, params


def _data(graph: ir.Graph, params: Sequence[str], inputs: str | os.PathLike[str] | Mapping[str, np.ndarray] | None,
          seed: int, batch: int, random: bool, notes: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The parameters (the model's, or seeded random ones) and the data inputs."""
    inits = graph.initializers
    base = {p: np.asarray(inits[p].const_value.numpy()) for p in params}  # type: ignore[union-attr]
    if random:
        base = random_weights(base, np.random.default_rng([seed, 3]))
        notes.append("parameters replaced by seeded random values (--random-weights)")
    specs = [v for v in graph.inputs if v.name not in inits]
    rng = np.random.default_rng([seed, 0])
    feeds = generate_inputs(specs, rng, batch) if inputs is None else read_inputs(inputs, specs)
    return base, feeds


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every parameter's check shares: the forward session, the loss at the base point,
    the analytic gradients, and the step and threshold chosen for the precision."""

    session: CheckSession
    prec: Precision
    loss_name: str
    feeds: dict[str, np.ndarray]  # data inputs and parameters
    loss0: float
    grads: dict[str, np.ndarray]
    rel_step: float
    rtol: float

    def loss_at(self, p: str, value: np.ndarray) -> float:
        """The loss with parameter ``p`` set to ``value``."""
        out = self.session.run([self.loss_name], cast_feeds({**self.feeds, p: value}, self.prec.dtype))[0]
        return float(np.asarray(out, np.float64).sum())


def _runs(step_model: ir.Model, loss_name: str, params: Sequence[str], feeds: dict[str, np.ndarray],
          base: dict[str, np.ndarray], float64: bool, step: float | None, rtol: float | None) -> tuple[_Run, Precision]:
    """Sessions for the forward (finite differences) and the gradient graph, each in float64
    where ORT has the kernels, and the analytic gradients; with the gradient graph's precision."""
    base_feeds = {**feeds, **base}
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    shapes.update(conv_shapes(step_model, base_feeds))
    fwd_prec, fwd_session = session_in_best_dtype(forward_model(step_model, [loss_name]), float64, shapes)
    grad_prec, grad_session = session_in_best_dtype(step_model, float64, shapes)
    outputs = [loss_name] + [f"grad/{p}" for p in params]
    results = grad_session.run(outputs, cast_feeds(base_feeds, grad_prec.dtype))
    default_step, default_rtol = param_tolerance(fwd_prec, grad_prec)
    run = _Run(fwd_session, fwd_prec, loss_name, base_feeds, float(np.asarray(results[0], np.float64).sum()),
               dict(zip(params, results[1:], strict=True)), default_step if step is None else step,
               default_rtol if rtol is None else rtol)
    return run, grad_prec


def _check_param(run: _Run, p: str, value: np.ndarray, g: np.ndarray, rng: np.random.Generator) -> ParamCheck:
    """``<g, d>`` against the central difference of the loss along ``d``, retried at smaller
    steps when they disagree (see the package docstring, 4)."""
    d = direction(g, rng)
    x = value.astype(np.float64)
    cast_to = x.dtype if run.prec.dtype == "float64" else value.dtype

    def loss_at(t: float) -> float:
        return run.loss_at(p, (x + t * d).astype(cast_to))

    analytic = float(np.dot(g.reshape(-1), d.reshape(-1)))
    # Step sized so the loss moves by ``rel_step`` of itself: rounding noise and kinks
    # (Relu, MaxPool) then cost the same relative error for a tensor of any size or scale.
    h0 = run.rel_step * max(abs(run.loss0), 1.0) / max(abs(analytic), 1e-12)
    # ... but not so far that the loss stops being smooth around p (a small gradient next to
    # a large loss would ask for a step of the size of p itself).
    h0 = min(h0, 3 * np.sqrt(run.rel_step) * max(float(np.linalg.norm(x)), 1.0))
    noise = 100 * EPS[run.prec.dtype] * max(abs(run.loss0), 1.0)
    numeric, rel = central(loss_at, analytic, h0, noise)
    status, spread = "pass", 0.0
    if rel > run.rtol:
        status, numeric, rel, spread = _retry(loss_at, analytic, h0, noise, run.rtol, (rel, numeric))
    return ParamCheck(p, int(x.size), analytic, numeric, rel, spread, status)


def _retry(loss_at: Callable[[float], float], analytic: float, h0: float, noise: float, rtol: float,
           first: tuple[float, float]) -> tuple[str, float, float, float]:
    """Retry at 1/4 and 1/16 of the step. Kinks (Relu, MaxPool) and curvature shrink with the
    step and rounding noise grows, so an error that changes by 2x or more over the three steps
    is the finite difference's own (``noisy``); a wrong rule's error stays put (``fail``).

    Returns:
        ``(status, numeric, rel_error, spread)`` of the best of the three steps.
    """
    tries = [first] + [central(loss_at, analytic, h0 / k, noise)[::-1] for k in (4.0, 16.0)]
    rel, numeric = min(tries)
    numerics = [n for _, n in tries]
    spread = (max(numerics) - min(numerics)) / max(abs(numeric), noise / h0)
    errors = [r for r, _ in tries]
    status = "pass"
    if rel > rtol:
        systematic = max(errors) < 2 * min(errors) and rel > 4 * spread
        status = "fail" if systematic else "noisy"
    return status, numeric, rel, spread
