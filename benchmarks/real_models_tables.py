"""``real_models.py``'s tables and issue 30's Done-means judge: one record per row with the
ratios derived from the rows beside it, the rows table, the ``verdicts`` on ``LINES`` and their
table, and the not-judged torch.compile CUDA-graphs table (``--compile-modes``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from real_models_cases import (
    BF16_PEAK_TFLOPS,
    COMPILED,
    CPU_TWIN,
    CUDAGRAPHS,
    EAGER,
    MEMORY_STEPS,
    MODELS,
    RERUN,
)
from step_timing import (
    Run,
)

# -- rows, tables and the Done-means verdicts --------------------------------------------


def _median(run: Run) -> float | None:
    timed = run.round_ms[1:]
    return statistics.median(timed) if timed else None


def row_record(model: str, exporter: str | None, run: Run, check: int, kernels: Mapping[str, Any] | None,
               flops: float | None) -> dict[str, Any]:
    med = _median(run)
    loss = run.losses[check - 1] if len(run.losses) >= check else None
    peak = run.peak or {}
    return {"model": model, "exporter": exporter, "config": run.label, "device": run.device,
            "ms_per_step": med, "min": min(run.round_ms[1:], default=None), "max": max(run.round_ms[1:], default=None),
            "rounds_ms": run.round_ms, "twin": run.twin,
            # In this process, order-dependent (step_timing); the judged number is peak_mib.
            "memory_mib": run.memory_mib,
            "peak_mib": peak.get("peak_mib"), "memory_child": run.peak,
            f"loss_at_{check}": loss, "losses": run.losses,
            "tflops": flops / (med / 1e3) / 1e12 if flops and med else None,
            "kernels_per_step": (kernels or {}).get("kernels_per_step"),
            "gpu_ms_per_step": (kernels or {}).get("gpu_ms_per_step"),
            "kernels": kernels, "note": run.note, "error": run.error}


def _find(rows: Sequence[Mapping[str, Any]], model: str, exporter: str | None, config: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["model"] == model and r["exporter"] == exporter and r["config"] == config), None)


def _value(row: Mapping[str, Any] | None, key: str) -> float | None:
    value = None if row is None or row.get("error") else row.get(key)
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def derived(rows: list[dict[str, Any]], check: int) -> None:
    """Ratios to the model's torch rows and the loss difference to the twin, on every row."""
    for row in rows:
        ms = _value(row, "ms_per_step")
        eager_label = EAGER if row["device"] == "cuda" else CPU_TWIN
        for key, ref in (("ratio_to_compile", COMPILED), ("ratio_to_eager_amp", eager_label),
                         ("ratio_to_compile_cudagraphs", CUDAGRAPHS)):
            other = _value(_find(rows, row["model"], None, ref), "ms_per_step")
            row[key] = ms / other if ms is not None and other and row["config"] != ref else None
        twin = _find(rows, row["model"], None, row["twin"]) if row["twin"] else None
        loss, tloss = _value(row, f"loss_at_{check}"), _value(twin, f"loss_at_{check}")
        row["rel_loss_diff_to_twin"] = abs(loss - tloss) / abs(tloss) if loss is not None and tloss else None


def _f(value: Any, fmt: str, width: int) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return f"{'-':>{width}}"
    return f"{format(value, fmt):>{width}}"


def rows_table(rows: Sequence[Mapping[str, Any]], check: int) -> str:
    width = max([26] + [len(r["config"]) for r in rows])
    lines = [f"{'model':6s} {'exporter':11s} {'config':{width}s} {'ms/step':>8s} {'spread':>15s} {'/compile':>8s} "
             f"{'/eager':>7s} {'MFU%':>5s} {'peak GiB':>8s} {'in-proc':>7s} {'loss@' + str(check):>9s} {'dloss':>8s} "
             f"{'kern/step':>9s}  note"]
    gib = lambda mib: mib / 1024 if isinstance(mib, int | float) else None  # noqa: E731
    for r in rows:
        mfu = r["tflops"] / BF16_PEAK_TFLOPS * 100 if r.get("tflops") and r["device"] == "cuda" else None
        spread = f"{_f(r['min'], '.2f', 7)}-{_f(r['max'], '.2f', 7)}" if r.get("min") is not None else f"{'-':>15}"
        child = r.get("memory_child") or {}
        notes = [r.get("note") or ""]
        if "torch_max_reserved_mib" in child:
            notes.append(f"torch max allocated {gib(child['torch_max_allocated_mib']):.2f}, "
                         f"reserved {gib(child['torch_max_reserved_mib']):.2f} GiB")
        grew = sum((child.get("arena_grew") or {}).values())
        notes.append(f"ORT CUDA arenas grew {grew / 2**30:.2f} GiB of the peak" if grew else "")
        notes.append(f"peak: ERROR {child['error']}" if "error" in child else "")
        notes.append(f"ERROR {r['error']}" if r.get("error") else "")
        note = "; ".join(n for n in notes if n)
        lines.append(f"{r['model']:6s} {r['exporter'] or '-':11s} {r['config']:{width}s} {_f(r['ms_per_step'], '.2f', 8)} "
                     f"{spread} {_f(r.get('ratio_to_compile'), '.2f', 8)} {_f(r.get('ratio_to_eager_amp'), '.2f', 7)} "
                     f"{_f(mfu, '.1f', 5)} {_f(gib(r.get('peak_mib')), '.2f', 8)} {_f(gib(r.get('memory_mib')), '.2f', 7)} "
                     f"{_f(r.get(f'loss_at_{check}'), '.5f', 9)} "
                     f"{_f(r.get('rel_loss_diff_to_twin'), '.1e', 8)} {_f(r.get('kernels_per_step'), '.0f', 9)}  {note}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Verdict:
    model: str
    exporter: str
    line: str
    value: float | None  # None: the run lacks the rows this line needs, or one failed
    limit: float
    at_most: bool  # the value must be <= limit (else >=)
    # dloss: torch eager AMP's own run-to-run spread (RERUN row), None without it; the limit
    # is then max(LINES' 0.01, spread).
    spread: float | None = None

    @property
    def held(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.at_most else self.value >= self.limit


#: Issue 30's Done-means lines this script measures: (column, limit, at most?, models it applies to).
#: "dloss bf16"'s limit is max(0.01, torch's own run-to-run spread) where the run measured that
#: spread (the ``RERUN`` row), as the issue allows; "mem bf16/compile" compares ``peak_mib``.
LINES: tuple[tuple[str, float, bool, tuple[str, ...]], ...] = (
    ("bf16/compile", 1.0, True, MODELS),
    ("bf16/eager AMP", 0.6, True, MODELS),
    ("TF32/bf16", 2.0, False, ("gpt2", "llama")),
    ("fp16/bf16", 1.10, True, ("gpt2", "llama")),
    ("mem bf16/compile", 1.0, True, MODELS),
    ("dloss bf16", 0.01, True, MODELS),
)


def verdicts(result: Mapping[str, Any]) -> list[Verdict]:
    """Every Done-means line for every model and exporter the run asked for, judged on its CUDA
    rows (``n/a`` without them: a CPU run, a failed or skipped row)."""
    rows = result["rows"]
    check = result["args"]["check_step"]
    out = []
    for model in result["args"]["models"]:
        eager, compiled = (_find(rows, model, None, c) for c in (EAGER, COMPILED))
        spread = _value(_find(rows, model, None, EAGER + RERUN), "rel_loss_diff_to_twin")
        for exporter in result["args"]["exporters"]:
            bf16, tf32, fp16 = (_find(rows, model, exporter, f"mpgraph {p}") for p in ("bf16", "tf32", "fp16"))

            def ratio(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, key: str = "ms_per_step") -> float | None:
                x, y = _value(a, key), _value(b, key)
                return x / y if x is not None and y else None

            values = {"bf16/compile": ratio(bf16, compiled), "bf16/eager AMP": ratio(bf16, eager),
                      "TF32/bf16": ratio(tf32, bf16), "fp16/bf16": ratio(fp16, bf16),
                      "mem bf16/compile": ratio(bf16, compiled, "peak_mib"),
                      "dloss bf16": _value(bf16, "rel_loss_diff_to_twin") if _value(eager, f"loss_at_{check}") else None}
            for line, limit, at_most, models in LINES:
                if model not in models:
                    continue
                if line == "dloss bf16":
                    out.append(Verdict(model, exporter, line, values[line], max(limit, spread or 0.0), at_most, spread))
                else:
                    out.append(Verdict(model, exporter, line, values[line], limit, at_most))
    return out


def verdict_table(results: Sequence[Verdict]) -> str:
    columns = [line for line, *_ in LINES]
    width = max(len(c) for c in columns) + 2
    head = f"{'Done means (issue 30)':22s}" + "".join(f"{c:>{width}s}" for c in columns)
    limits = f"{'limit':22s}" + "".join(
        f"{('<= ' if at_most else '>= ') + format(limit, 'g'):>{width}s}" for _, limit, at_most, _ in LINES)
    lines = [head, limits]
    keys = list(dict.fromkeys((v.model, v.exporter) for v in results))
    for model, exporter in keys:
        cells = []
        for column in columns:
            v = next((v for v in results if (v.model, v.exporter, v.line) == (model, exporter, column)), None)
            if v is None:
                cells.append(f"{'':>{width}s}")
            elif v.held is None:
                cells.append(f"{'n/a':>{width}s}")
            else:
                shown = f"{v.value:.3f}" if v.line.startswith("dloss") else f"{v.value:.2f}"
                cells.append(f"{shown + (' held' if v.held else ' MISSED'):>{width}s}")
        lines.append(f"{model + ' ' + exporter:22s}" + "".join(cells))
    lines.append("mem bf16/compile: peak device memory, each configuration in its own fresh process (peak GiB)")
    dloss = {v.model: v for v in results if v.line == "dloss bf16"}
    if dloss:
        lines.append(f"dloss bf16 limit: max(0.01, the spread of {EAGER} and its{RERUN} at the check step): " + "; ".join(
            f"{m} spread {v.spread:.1e}, limit {v.limit:.3g}" if v.spread is not None else f"{m} no spread measured, "
            f"limit {v.limit:.3g}" for m, v in dloss.items()))
    judged = [v for v in results if v.held is not None]
    held = sum(bool(v.held) for v in judged)
    lines.append(f"{held} of {len(judged)} judged lines held, {len(judged) - held} missed; "
                 f"{len(results) - len(judged)} n/a (rows missing, failed or not on CUDA)")
    return "\n".join(lines)


MEMORY_LEGEND = (f"peak GiB: each configuration in its own fresh process, torch's CUDA context made first and the "
                 f"baseline taken after it, the largest device memory in use after it was made and after each of its "
                 f"first {MEMORY_STEPS} steps (on a CPU run: host resident set); in-proc: what it added to this process "
                 f"(order-dependent, not judged); {EAGER}{RERUN}: the eager row again, its dloss is torch's run-to-run "
                 f"spread")


def summary(result: Mapping[str, Any]) -> str:
    check = result["args"]["check_step"]
    parts = ["== all rows ==", MEMORY_LEGEND, rows_table(result["rows"], check)]
    refused = [p for p in result["prep"] if p["errors"]]
    if refused:
        parts.append("\n== what failed before timing ==")
        parts += [f"{p['model']} {p['exporter']}: " + "; ".join(f"{k}: {v}" for k, v in p["errors"].items()) for p in refused]
    if result.get("skipped"):
        parts.append("\nskipped (time budget): " + ", ".join(result["skipped"]))
    parts += ["", verdict_table(verdicts(result))]
    if "reduce-overhead" in result["args"].get("compile_modes", ()):
        parts += ["", cudagraphs_table(result["rows"])]
    return "\n".join(parts)


def cudagraphs_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """mpgraph bf16 against torch.compile with and without CUDA graphs (``--compile-modes``), not
    judged; ``gpu ms`` is the kernels' time per step (CUPTI), where the run profiled it."""
    lines = [f"not judged: mpgraph bf16 / {CUDAGRAPHS} (torch.compile mode=\"reduce-overhead\"); issue 30's lines "
             f"compare against {COMPILED}",
             f"{'model':6s} {'exporter':11s} {'bf16 ms':>8s} {'gpu ms':>7s} {'compile':>8s} {'gpu ms':>7s} "
             f"{'cgraphs':>8s} {'gpu ms':>7s} {'/compile':>8s} {'/cgraphs':>8s}"]
    for r in rows:
        if r["config"] != "mpgraph bf16" or r["device"] != "cuda":
            continue
        compiled, graphs = (_find(rows, r["model"], None, c) for c in (COMPILED, CUDAGRAPHS))
        cells = [_f(_value(x, key), ".2f", w) for x in (r, compiled, graphs)
                 for key, w in (("ms_per_step", 8), ("gpu_ms_per_step", 7))]
        lines.append(f"{r['model']:6s} {r['exporter'] or '-':11s} {' '.join(cells)} "
                     f"{_f(r.get('ratio_to_compile'), '.2f', 8)} {_f(r.get('ratio_to_compile_cudagraphs'), '.2f', 8)}"
                     + (f"  {CUDAGRAPHS}: ERROR {graphs['error']}" if graphs and graphs.get("error") else "")
                     + ("" if graphs else f"  no {CUDAGRAPHS} row"))
    if len(lines) == 2:
        lines.append(f"(no CUDA mpgraph bf16 row: {CUDAGRAPHS} runs on CUDA only)")
    return "\n".join(lines)
