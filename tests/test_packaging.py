"""What a wheel of mpgraph ships: every subpackage, the policy presets and py.typed.

pyproject.toml lists the packages by hand because the presets live in the top-level rules/
folder and install as ``mpgraph.rules``, which setuptools' ``packages.find`` cannot see (a wheel
built with find shipped no presets, so ``load_policy("bf16")`` failed after ``pip install .``).
A hand-made list can miss a new subpackage: this test compares it with the tree.
"""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed() -> None:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "mpgraph").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert set(SETUPTOOLS["packages"]) == found | {"mpgraph.rules"}


def test_presets_and_type_marker_are_package_data() -> None:
    assert SETUPTOOLS["package-dir"]["mpgraph.rules"] == "rules"
    assert (ROOT / "rules" / "__init__.py").exists()
    presets = sorted(p.name for p in (ROOT / "rules").glob("*.yaml"))
    assert {"bf16.yaml", "fp16.yaml", "fp32.yaml", "tf32.yaml"} <= set(presets)
    data = SETUPTOOLS["package-data"]
    assert data["mpgraph.rules"] == ["*.yaml"] and "py.typed" in data["mpgraph"]
    assert (ROOT / "mpgraph" / "py.typed").exists()
