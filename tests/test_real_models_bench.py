"""``benchmarks/real_models.py``: the Done-means verdicts of issue 30 on synthetic runs, and one
small CPU run through the whole script (export, train-graph, convert, Trainer, torch, JSON).

The verdicts must be measured, never assumed: a line whose rows are missing, failed or ran on
the CPU is ``n/a``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # real_models imports its sibling step_timing
_spec = importlib.util.spec_from_file_location("real_models", ROOT / "benchmarks" / "real_models.py")
real_models = importlib.util.module_from_spec(_spec)
sys.modules["real_models"] = real_models  # dataclasses look their module up there
_spec.loader.exec_module(real_models)

CHECK = 50


def _row(model, exporter, config, ms, mem_gib=None, loss=None, error="", device="cuda"):
    twin = None if config == real_models.EAGER else real_models.EAGER
    return {"model": model, "exporter": exporter, "config": config, "device": device, "ms_per_step": ms,
            "min": ms, "max": ms, "twin": twin, "memory_mib": None if mem_gib is None else mem_gib * 1024,
            f"loss_at_{CHECK}": loss, "tflops": None, "kernels_per_step": None, "note": "", "error": error}


def _run(rows, models=("gpt2", "llama"), exporters=("torchscript",)):
    real_models.derived(rows, CHECK)
    return {"args": {"check_step": CHECK, "models": list(models), "exporters": list(exporters)}, "rows": rows}


def _by_line(run):
    return {(v.model, v.exporter, v.line): v for v in real_models.verdicts(run)}


def _issue_rows():
    """GPT-2 as issue 30 measured it (every line missed); a Llama-style run where every line holds."""
    return [
        _row("gpt2", None, "torch amp bf16", 58.8, 14.1, 3.000),
        _row("gpt2", None, "torch compile bf16", 27.9, 10.7, 3.001),
        _row("gpt2", "torchscript", "mpgraph bf16", 84.4, 26.8, 3.003),
        _row("gpt2", "torchscript", "mpgraph tf32", 84.6, 19.5, 3.001),
        _row("gpt2", "torchscript", "mpgraph fp16", 95.0, 27.0, 3.002),
        _row("llama", None, "torch amp bf16", 66.2, 12.0, 4.0),
        _row("llama", None, "torch compile bf16", 29.5, 8.1, 4.0),
        _row("llama", "torchscript", "mpgraph bf16", 20.0, 8.0, 4.02),
        _row("llama", "torchscript", "mpgraph tf32", 40.0, 15.4, 4.0),
        _row("llama", "torchscript", "mpgraph fp16", 21.0, 8.0, 4.0),
    ]


def test_issue_numbers_miss_every_line_and_a_fast_run_holds_them():
    lines = _by_line(_run(_issue_rows()))
    gpt2 = {line: v for (m, _, line), v in lines.items() if m == "gpt2"}
    assert gpt2["bf16/compile"].value == pytest.approx(84.4 / 27.9) and gpt2["bf16/compile"].held is False
    assert gpt2["bf16/eager AMP"].value == pytest.approx(84.4 / 58.8) and gpt2["bf16/eager AMP"].held is False
    assert gpt2["TF32/bf16"].value == pytest.approx(84.6 / 84.4) and gpt2["TF32/bf16"].held is False
    assert gpt2["fp16/bf16"].held is False and gpt2["mem bf16/compile"].held is False
    assert gpt2["dloss bf16"].value == pytest.approx(1e-3) and gpt2["dloss bf16"].held is True
    llama = {line: v for (m, _, line), v in lines.items() if m == "llama"}
    assert all(v.held for line, v in llama.items() if line != "dloss bf16")
    assert llama["dloss bf16"].value == pytest.approx(5e-3) and llama["dloss bf16"].held is True
    table = real_models.verdict_table(real_models.verdicts(_run(_issue_rows())))
    assert "3.03 MISSED" in table and "0.68 held" in table
    assert table.splitlines()[-1].startswith("7 of 12 judged lines held, 5 missed; 0 n/a")


def test_missing_failed_and_cpu_rows_are_not_judged():
    rows = _issue_rows()
    rows[2]["error"] = "train-graph: GradientError: no gradient rule"  # gpt2 bf16 failed
    rows = [r for r in rows if r["config"] != "torch compile bf16" or r["model"] != "llama"]
    lines = _by_line(_run(rows, exporters=("torchscript", "dynamo")))
    assert all(v.held is None for (m, e, _), v in lines.items() if m == "gpt2" and e == "torchscript")
    assert all(v.held is None for (_, e, _), v in lines.items() if e == "dynamo")  # no dynamo rows at all
    assert lines[("llama", "torchscript", "bf16/compile")].held is None
    assert lines[("llama", "torchscript", "bf16/eager AMP")].held is True
    # BERT and ViT have no TF32 or fp16 line.
    assert {line for (m, _, line) in _by_line(_run([], models=("bert",)))} == {
        "bf16/compile", "bf16/eager AMP", "mem bf16/compile", "dloss bf16"}
    cpu = [_row("vit", None, "torch fp32 cpu", 80.0, device="cpu", loss=1.0),
           _row("vit", "torchscript", "mpgraph bf16 emulated cpu", 10.0, device="cpu", loss=1.0)]
    assert all(v.held is None for v in real_models.verdicts(_run(cpu, models=("vit",))))


def test_a_small_cpu_run_trains_like_torch(tmp_path):
    """One model, one exporter, tiny config, on ORT CPU: every row runs and fp32 tracks torch."""
    result = real_models.main(["--cpu-only", "--small", "--models", "vit", "--exporters", "torchscript",
                               "--rounds", "1", "--steps-per-round", "2", "--check-step", "4",
                               "--prep-workers", "0", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "real_models.json").read_text())
    assert saved["env"]["commit"] and saved["env"]["command"]
    assert (tmp_path / "real_models.log").read_text().startswith("# command: ")
    rows = {r["config"]: r for r in saved["rows"]}
    assert set(rows) == {"torch fp32 cpu", "mpgraph fp32 cpu", "mpgraph bf16 emulated cpu", "mpgraph fp16 emulated cpu"}
    assert not any(r["error"] for r in rows.values()), [r["error"] for r in rows.values()]
    assert rows["mpgraph fp32 cpu"]["rel_loss_diff_to_twin"] < 1e-5
    assert rows["mpgraph bf16 emulated cpu"]["rel_loss_diff_to_twin"] < 1e-2
    assert saved["prep"][0]["trained_parameters"] == "40/40"
    assert result["rows"] == saved["rows"]
