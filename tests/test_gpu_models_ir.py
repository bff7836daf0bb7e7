"""Every model a GPU test builds by hand says its IR version.

onnx 1.23 writes IR version 14 by default and onnxruntime-gpu 1.31 (the H200's) reads at most
13, while the CPU onnxruntime these tests run on here reads 14: a test that leaves the default
passes its CPU checks and fails on the GPU before any kernel runs (all 63 cases of
test_gpu_gemm_bias and test_gpu_llama's RmsNormGrad test, 2026-12-03). Read from the sources,
so it runs here: in each function of a module with GPU tests, every ``helper.make_model(...)`` call
without an ``ir_version=`` keyword needs an ``<x>.ir_version = ...`` assignment in the same
function (``tests.helpers.make_model`` sets it itself).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
GPU_MODULES = sorted(p for p in TESTS.glob("test_*.py") if "mark.gpu" in p.read_text())


def _missing(tree: ast.AST) -> list[str]:
    out = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)  # onnx.helper's (h., helper.)
                 and isinstance(c.func, ast.Attribute) and c.func.attr == "make_model"]
        bare = [c for c in calls if not any(k.arg == "ir_version" for k in c.keywords)]
        sets = [a for a in ast.walk(fn) if isinstance(a, ast.Assign)
                and any(isinstance(t, ast.Attribute) and t.attr == "ir_version" for t in a.targets)]
        if len(bare) > len(sets):
            out.append(f"{fn.name} (line {fn.lineno}): {len(bare)} make_model without ir_version, {len(sets)} set")
    return out


def test_the_check_finds_a_model_without_its_ir_version() -> None:
    src = "def f():\n    m = h.make_model(g)\n    return m\n\ndef g():\n    m = h.make_model(g)\n    m.ir_version = 10\n"
    assert _missing(ast.parse(src)) == ["f (line 1): 1 make_model without ir_version, 0 set"]
    assert GPU_MODULES, "no module with GPU tests found"


@pytest.mark.parametrize("module", GPU_MODULES, ids=lambda p: p.stem)
def test_gpu_test_models_say_their_ir_version(module: Path) -> None:
    assert _missing(ast.parse(module.read_text())) == [], module.name
