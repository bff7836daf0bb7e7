"""No test is skipped on every machine: the only skip markers allowed are the CUDA ones.

Issue 13: a skip that happens everywhere hides a test that never runs (483 of them once did, in
``test_real_models.py``). Slow tests are deselected by ``tests/conftest.py`` (not skipped), so on
a CPU machine ``pytest -rs`` lists only the tests that need CUDA. This test reads the markers of
every test collected in the same run (``request.session.items``), so the whole suite is checked
when the whole suite runs. Skips decided inside a test body (``pytest.skip``) depend on what
happens at run time and are not seen here.
"""

from __future__ import annotations

import pytest


def _taken_skips(item: pytest.Item) -> list[str]:
    """Reasons of the ``skip`` markers, and of the ``skipif`` markers whose condition is true."""
    reasons = [str(mark.kwargs.get("reason", mark.args)) for mark in item.iter_markers("skip")]
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if any(bool(c) for c in conditions if not isinstance(c, str)):
            reasons.append(str(mark.kwargs.get("reason", "")))
    return reasons


def test_only_cuda_tests_carry_a_skip_marker_that_is_taken(request: pytest.FixtureRequest) -> None:
    taken = {item.nodeid: _taken_skips(item) for item in request.session.items}
    not_cuda = {node: reasons for node, reasons in taken.items()
                if any("CUDA" not in reason for reason in reasons)}
    assert not not_cuda, f"skipped on this machine for a reason other than CUDA: {not_cuda}"


class _Item:
    """What ``_taken_skips`` reads of a collected test: its markers."""

    def __init__(self, *decorators: pytest.MarkDecorator) -> None:
        self.marks = [d.mark for d in decorators]

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [m for m in self.marks if m.name == name]


def test_taken_skips_are_found() -> None:
    """The check above can fail: an unconditional skip and a true skipif are both reported."""
    assert _taken_skips(_Item(pytest.mark.skip(reason="never runs"))) == ["never runs"]
    assert _taken_skips(_Item(pytest.mark.skipif(True, reason="needs nothing"))) == ["needs nothing"]
    assert _taken_skips(_Item(pytest.mark.skipif(False, reason="needs CUDA"), pytest.mark.slow)) == []
