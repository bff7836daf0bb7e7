"""Which precision a check runs in, and the step and tolerance that follow from it.

A graph runs in float64 where ORT's CPU provider has every kernel. ORT is asked, one op type
at a time: each "no implementation" error adds that op to ``keep32`` (rewritten into float64
ops, or run in float32 between Casts; see ``float64``), and the last resort is float32.

Example:
    >>> _kind(Precision("float64", (), ""), Precision("float64", ("OneHot",), ""))
    'float64'
    >>> _kind(Precision("float64", ("Erf",), ""), Precision("float64", ("Erf",), ""))
    'mixed'
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from mpgraph.check_grad.float64 import SHAPED_OPS, to_float64
from mpgraph.errors import MpgraphError
from mpgraph.runtime.check_runs import CheckSession, ort_message

__all__ = ["EPS", "NODE_RTOL", "NODE_STEP", "RTOL", "STEP", "Precision", "cast_feeds", "conv_shapes",
           "param_tolerance", "session_in_best_dtype"]

logger = logging.getLogger(__name__)

#: Step (the fraction of the loss a step moves it by) and pass threshold, by precision:
#: ``float64`` both graphs in float64; ``analytic32`` finite differences in float64, some
#: gradient ops in float32; ``mixed`` finite differences through float32 ops (LRN, cubic
#: Resize); ``float32``. Measured on the zoo: worst errors 6e-10 (tiny_mlp, wide_mlp), 1.5e-9
#: (resnet), 1.4e-8 (gpt; 3e-6 when its Erf ran in float32, mixed); a planted 2% error reads 2e-2.
STEP = {"float64": 1e-7, "analytic32": 1e-7, "mixed": 1e-4, "float32": 1e-3}
RTOL = {"float64": 1e-5, "analytic32": 1e-4, "mixed": 1e-3, "float32": 5e-3}
#: Node-level checks: the same, for the objective ``<cotangent, node(x)>``.
NODE_STEP = {"float64": 1e-7, "float32": 1e-3}
NODE_RTOL = {"float64": 1e-5, "float32": 5e-3}
EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps)}
#: Ops that round nothing when run in float32 inside a float64 graph (their float input is
#: only copied or used as 0/1 values).
_EXACT_IN_FLOAT32 = frozenset({"OneHot", "Shape", "Size", "Identity", "Reshape", "Transpose", "Gather", "Where"})
#: Op types ORT CPU loads in float64 but cannot run in it ("LSTM operator does not support
#: double yet"; checked on ORT 1.32): they run in float32 from the start.
_FLOAT64_FAILS_AT_RUN = frozenset({"LSTM", "GRU", "RNN"})
#: Op types ORT CPU runs in float64 only by expanding their function body, which has an op
#: without a float64 kernel (a float64 ``Gelu`` becomes ``Erf``...: the error names the ``Erf``,
#: not the ``Gelu``); ``to_float64`` rewrites them from the start.
_FLOAT64_BY_FUNCTION = frozenset({"Gelu"})
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")


@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision a graph runs in.

    Attributes:
        dtype: ``float64`` or ``float32``.
        keep32: Op types run in float32 inside a float64 graph.
        note: Why the graph is not float64, when it is not.
    """

    dtype: str
    keep32: tuple[str, ...]
    note: str

    @property
    def label(self) -> str:
        """``float64 (Erf in float32)``."""
        return self.dtype + (f" ({', '.join(self.keep32)} in float32)" if self.keep32 else "")


def session_in_best_dtype(model: ir.Model, float64: bool,
                          input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> tuple[Precision, CheckSession]:
    """A session in float64 when ORT CPU has the kernels (see the module docstring).

    Args:
        model: The float32 model.
        float64: Try float64 (``False``: float32 only).
        input_shapes: As ``to_float64``'s.

    Raises:
        MpgraphError: ORT cannot load even the float32 model.
    """
    note = "float64 not requested"
    keep32: set[str] = {n.op_type for n in model.graph if n.op_type in _FLOAT64_FAILS_AT_RUN | _FLOAT64_BY_FUNCTION}
    while float64 and len(keep32) < 12:
        try:
            converted, islands = to_float64(model, frozenset(keep32), input_shapes)
            return Precision("float64", tuple(sorted(islands)), ""), CheckSession(converted)
        except Exception as e:  # noqa: BLE001 - conversion and ORT errors alike mean "not in float64"
            note = f"no float64: {ort_message(e)}"
            missing = _NO_KERNEL.search(str(e))
            if missing is None or missing.group(1) in keep32:
                break
            keep32.add(missing.group(1))
    logger.info("falling back to float32: %s", note)
    try:
        return Precision("float32", (), note), CheckSession(model)
    except MpgraphError as e:
        raise MpgraphError(f"onnxruntime cannot load the gradient graph: {e}") from None


def conv_shapes(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Runtime shapes of the inputs (and Resize's output) of every op in ``SHAPED_OPS`` (one
    float32 run): shape inference does not reach every backward Conv, nor a Resize's computed
    sizes, and their float64 rewrites need them static."""
    probe = ir.from_proto(ir.to_proto(model))
    outputs = {v.name for v in probe.graph.outputs}
    wanted: dict[str, ir.Value] = {}
    for node in probe.graph:
        if node.op_type in SHAPED_OPS:
            for v in [*node.inputs[:2], *(node.outputs[:1] if node.op_type == "Resize" else [])]:
                if v is not None and v.name and v.name not in outputs and v.name not in feeds:
                    wanted[v.name] = v
    if not wanted:
        return {}
    names = sorted(wanted)
    probe.graph.outputs.clear()
    probe.graph.outputs.extend(wanted[n] for n in names)
    try:
        arrays = CheckSession(probe).run(names, feeds)
    except MpgraphError as e:  # best effort: without shapes, Convs stay float32
        logger.debug("conv shape probe failed: %s", e)
        return {}
    return {n: tuple(a.shape) for n, a in zip(names, arrays, strict=True)}


def cast_feeds(feeds: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float arrays in ``dtype`` (``float64`` or ``float32``); others unchanged."""
    want = np.float64 if dtype == "float64" else np.float32
    return {k: (v.astype(want) if v.dtype in (np.float32, np.float64) else v) for k, v in feeds.items()}


def param_tolerance(fwd: Precision, grad: Precision) -> tuple[float, float]:
    """The relative step of the finite differences and the pass threshold, for a forward graph
    and a gradient graph that run in these precisions."""
    return STEP[_kind(fwd, fwd)], RTOL[_kind(fwd, grad)]


def _kind(fwd: Precision, grad: Precision) -> str:
    """``float64`` (both graphs fully float64), ``analytic32`` (finite differences in float64,
    some gradient ops in float32), ``mixed`` (finite differences through float32 ops) or
    ``float32``."""
    if fwd.dtype == "float32":
        return "float32"
    if set(fwd.keep32) - _EXACT_IN_FLOAT32:
        return "mixed"
    if grad.dtype == "float32" or set(grad.keep32) - _EXACT_IN_FLOAT32:
        return "analytic32"
    return "float64"
