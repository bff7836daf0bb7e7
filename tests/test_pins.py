"""Step graphs and converted models keep their bytes (``tests/pins.py`` lists the cases).

A change that alters one of them on purpose regenerates ``tests/pins.json`` with
``python -m tests.pins`` and says why in its commit; any other change must leave them alone.
"""

from __future__ import annotations

import pytest

from tests import pins

PINNED = pins.load()
CASES = [case for case, _ in pins.cases()]


def test_pins_cover_every_case() -> None:
    assert sorted(CASES) == sorted(PINNED), "tests/pins.json is stale: run python -m tests.pins"


@pytest.mark.slow  # 255 builds, about 60 s on 2 cores: CI runs it (--runslow), `pytest -q` does not
@pytest.mark.parametrize("case", CASES)
def test_bytes_unchanged(case: str) -> None:
    got = pins.compute(only=lambda c: c == case)[case]
    assert got == PINNED[case], f"{case} changed; if on purpose, run python -m tests.pins and say why"
