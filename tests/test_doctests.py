"""Docstring examples are tests."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["mpgraph.convert", "mpgraph.dtypes", "mpgraph.policy.loader"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
