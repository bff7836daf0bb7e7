"""Test options: ``--runslow`` runs the tests marked ``slow``; without it they are deselected.

Deselected, not skipped: ``pytest -rs`` then lists only the skips that depend on the machine
(on a CPU machine, the tests that need CUDA), and the summary line counts the slow tests as
"deselected". CI (``.ci/run``) passes ``--runslow``, so it runs every test, on two processes
(``-n 2 --dist worksteal``, pytest-xdist).

Threads: torch (and numpy's BLAS) read ``OMP_NUM_THREADS`` when first imported, which happens
after this file loads, so it is set here to 1 unless the caller set it. Tests that compare
torch with ORT then run one thread each, as their ORT sessions do (``intra_op_num_threads=1``):
on a shared 2-core machine two threads per library made ``test_train_graph`` take 14 minutes.

Order: no test may depend on another having run; ``pytest --reverse`` (the pytest-reverse
plugin) runs the suite backwards to check that.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
