"""What ``check_grad`` reports: one ``ParamCheck`` per parameter, the ``NodeCheck`` s of the
rules that disagree, and the ``GradCheckReport`` that holds them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from mpgraph.errors import MpgraphError

__all__ = ["GradCheckReport", "InputsError", "NodeCheck", "ParamCheck", "Progress"]

#: ``progress(phase, done, total)``, called after each parameter or node.
Progress = Callable[[str, int, int], None]


class InputsError(MpgraphError):
    """An ``--inputs`` file does not match the model's data inputs."""


@dataclasses.dataclass(frozen=True)
class ParamCheck:
    """One parameter: analytic ``<g, d>`` against the finite difference along ``d``.

    Attributes:
        name: Parameter name.
        size: Elements.
        analytic: ``<g, d>`` from the gradient graph.
        numeric: Central finite difference of the loss along ``d``.
        rel_error: ``|analytic - numeric| / max(|analytic|, |numeric|)``.
        uncertainty: Relative spread of the finite difference between two steps.
        status: ``pass``, ``fail`` or ``noisy`` (see ``passed``).
    """

    name: str
    size: int
    analytic: float
    numeric: float
    rel_error: float
    uncertainty: float
    status: str

    @property
    def passed(self) -> bool:
        """``pass``, or ``noisy``: the finite differences are too uncertain to tell (the
        analytic value is within three times their spread over two steps)."""
        return self.status != "fail"


@dataclasses.dataclass(frozen=True)
class NodeCheck:
    """A node whose gradient rule disagrees with finite differences through that node alone.

    Attributes:
        name: Node name in the gradient graph (the forward model's name where it had one).
        op_type: ONNX op type.
        rule: Registry key of the rule (``ai.onnx::Relu@1-``).
        input: The input whose cotangent disagrees.
        analytic: ``<x_bar, d>`` from the rule.
        numeric: Finite difference of ``<y_bar, node(x + t d)>``.
        rel_error: Relative error between the two.
        dtype: Precision the node was checked in.
    """

    name: str
    op_type: str
    rule: str
    input: str
    analytic: float
    numeric: float
    rel_error: float
    dtype: str


@dataclasses.dataclass(frozen=True)
class GradCheckReport:
    """Result of ``check_grad``.

    Attributes:
        loss: Name of the loss output.
        dtype: Precision of the finite differences (``float64`` or ``float32``).
        analytic_dtype: Precision the gradient graph ran in.
        dtype_note: Why float32 was used, when it was.
        step: Relative finite-difference step.
        rtol: Pass threshold on the relative error.
        seed: Seed of inputs and directions.
        inputs: ``(name, shape, dtype)`` of every data input fed.
        params: One ``ParamCheck`` per parameter, in graph order.
        bad_nodes: Nodes whose rule disagrees, closest to the loss first (empty when every
            parameter passed or localization was off).
        nodes_checked: Nodes checked alone during localization.
        notes: Things the user should know (Dropout in inference mode, unchecked nodes).
    """

    loss: str
    dtype: str
    analytic_dtype: str
    dtype_note: str
    step: float
    rtol: float
    seed: int
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    params: tuple[ParamCheck, ...]
    bad_nodes: tuple[NodeCheck, ...] = ()
    nodes_checked: int = 0
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether every parameter passed."""
        return all(p.passed for p in self.params)

    @property
    def failed(self) -> tuple[ParamCheck, ...]:
        """The parameters that failed."""
        return tuple(p for p in self.params if not p.passed)

    @property
    def first_bad_node(self) -> NodeCheck | None:
        """The node closest to the loss whose rule disagrees (where backward first goes wrong)."""
        return self.bad_nodes[0] if self.bad_nodes else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``passed`` and ``first_bad_node`` included)."""
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        d["first_bad_node"] = dataclasses.asdict(self.first_bad_node) if self.first_bad_node else None
        d["inputs"] = [{"name": n, "shape": list(s), "dtype": t} for n, s, t in self.inputs]
        return d

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)
