"""Docstring examples are tests: every module under ``mpgraph/`` with a ``>>>`` example runs here.

The modules are found by walking the package, so a new example is run without being listed.
An example that cannot run in the tests (it needs CUDA, a download, minutes) says why in a
comment before its directive: ``>>> fit(step)  # needs CUDA  # doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from types import ModuleType

import pytest

import mpgraph

_FINDER = doctest.DocTestFinder()
# A reason is a comment before the directive: `>>> f()  # why  # doctest: +SKIP`.
_SKIP_WITH_REASON = re.compile(r"#\s*\S.*#\s*doctest:.*\+SKIP")


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(mpgraph.__path__, "mpgraph."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it runs the command line
            continue
        if any(test.examples for test in _FINDER.find(importlib.import_module(info.name))):
            names.append(info.name)
    return sorted(names)


MODULES = _modules_with_examples()


def _examples(module: ModuleType) -> list[doctest.Example]:
    return [example for test in _FINDER.find(module) for example in test.examples]


def test_walk_finds_the_known_modules() -> None:
    """The walk reaches subpackages (a broken walk would pass every test below vacuously)."""
    assert {"mpgraph.dtypes", "mpgraph.convert", "mpgraph.policy.loader", "mpgraph.cli.checks"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module)
    assert result.failed == 0
    assert result.attempted > 0, f"{name}: every example is skipped"


@pytest.mark.parametrize("name", MODULES)
def test_skipped_examples_say_why(name: str) -> None:
    skipped = [e.source.strip() for e in _examples(importlib.import_module(name))
               if e.options.get(doctest.SKIP) and not _SKIP_WITH_REASON.search(e.source)]
    assert not skipped, f"{name}: +SKIP without a reason (write `# why  # doctest: +SKIP`): {skipped}"
