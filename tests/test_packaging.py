"""What a wheel of mpgraph ships: every subpackage, the policy presets and py.typed.

pyproject.toml lists the packages by hand because the presets live in the top-level rules/
folder and install as ``mpgraph.rules``, which setuptools' ``packages.find`` cannot see (a wheel
built with find shipped no presets, so ``load_policy("bf16")`` failed after ``pip install .``).
A hand-made list can miss a new subpackage: this test compares it with the tree.

Below: the imports a plain install (no extras) must satisfy, and what ``mpgraph`` loads before
it does anything.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
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


# --- what a plain `pip install -e .` (no extras) can import -----------------------------------
#
# typer stopped depending on click (it vendors it) while mpgraph/cli/main.py still imported
# click: every `mpgraph` call failed after a plain install, and nothing here saw it because the
# [dev] extra brings click in through transformers. These tests read the imports (ast) and
# compare them with pyproject.toml, so a missing declaration fails without a network or a venv.

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _distribution(requirement: str) -> str:
    """``"onnx-ir>=1.0"`` -> ``"onnx-ir"``, normalised as PyPI compares names (PEP 503)."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


REQUIRED = {_distribution(r) for r in PROJECT["dependencies"]}
#: The extras a user installs for a feature (torch for export, data for datasets and plots);
#: [dev] is the test toolchain, which the library must not import.
OPTIONAL = {_distribution(r) for extra, reqs in PROJECT["optional-dependencies"].items() if extra != "dev" for r in reqs}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # scans every installed package: once


def _providers(top: str) -> set[str]:
    """The distributions that install the top-level import name ``top`` (``yaml`` -> pyyaml)."""
    found = _installed().get(top, [top])
    return {_distribution(d) for d in found}


def _third_party_imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, top-level name, eager) for every absolute import of a non-stdlib package
    in mpgraph/: eager when it runs at module import, not when it sits in a function body or an
    ``if TYPE_CHECKING:`` block."""
    found = []

    def walk(node: ast.AST, where: str, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            names = [a.name for a in child.names] if isinstance(child, ast.Import) else (
                [child.module] if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "mpgraph":
                    found.append((where, child.lineno, top, not lazy))
            walk(child, where, inner)

    for path in sorted((ROOT / "mpgraph").rglob("*.py")):
        walk(ast.parse(path.read_text(), str(path)), str(path.relative_to(ROOT)), False)
    return found


def test_the_import_walk_sees_eager_and_lazy_imports() -> None:
    imports = _third_party_imports()
    assert ("mpgraph/cli/main.py", "typer", True) in {(f, t, e) for f, _, t, e in imports}
    assert ("mpgraph/export.py", "torch", False) in {(f, t, e) for f, _, t, e in imports}


def test_every_import_is_a_declared_dependency() -> None:
    """A module-level import needs a declared dependency; an optional extra's package (torch,
    scikit-learn, matplotlib) only inside the function that needs it."""
    bad = []
    for where, line, top, eager in _third_party_imports():
        allowed = REQUIRED if eager else REQUIRED | OPTIONAL
        if not _providers(top) & allowed:
            kind = "at module level" if eager else "in a function"
            bad.append(f"{where}:{line} imports {top} {kind}; dependencies: {sorted(allowed)}")
    assert not bad, "\n".join(bad)


# --- what `mpgraph` loads before it does anything ----------------------------------------------
#
# `mpgraph --help` spent two seconds (more under load) importing onnx, ml_dtypes, onnx_ir and
# sympy: mpgraph/__init__.py imported every Python twin and the command modules their libraries.
# The libraries now load inside the command that uses them.

HEAVY = ("numpy", "onnx", "onnx_ir", "onnxruntime", "onnxscript", "ml_dtypes", "sympy", "torch", "yaml")


def _loaded_after(code: str) -> list[str]:
    ran = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    modules = set(ran.stdout.split())
    return sorted(m for m in HEAVY if m in modules)


def test_the_command_line_imports_no_model_library() -> None:
    assert _loaded_after("import mpgraph.cli.main") == []


def test_importing_mpgraph_or_its_errors_loads_no_model_library() -> None:
    assert _loaded_after("import mpgraph\nfrom mpgraph.errors import MpgraphError") == []


def test_the_python_twins_keep_their_names_after_their_submodules_load() -> None:
    """``mpgraph.audit``, ``convert`` and ``check_grad`` are functions named like their
    subpackages: importing ``mpgraph.audit.report`` first must not turn ``mpgraph.audit`` into
    the module."""
    code = (
        "import mpgraph.audit.report, mpgraph.convert, mpgraph.check_grad.check, mpgraph\n"
        "for name in mpgraph.__all__:\n"
        "    value = getattr(mpgraph, name)\n"
        "    assert callable(value) and not isinstance(value, type(mpgraph)), name\n"
        "assert set(mpgraph.__all__) <= set(dir(mpgraph))\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
