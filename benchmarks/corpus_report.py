"""The real-architecture corpus (tests/corpus) measured: per model and exporter, the worst
gradient error against torch.autograd, the worst loss error over 5 AdamW steps against
torch.optim.AdamW, the emulated bf16/fp16 loss deltas after 5 updates, and wall times.

    .venv/bin/python benchmarks/corpus_report.py [--models bert,gpt2] [--exporters dynamo]

Errors: ``grad`` is the relative L2 error of the worst parameter against torch fp32 (a
parameter's norm floored at 1e-6 of the model's largest gradient norm); ``ok`` also accepts a
gradient or loss no further from torch float64 than twice torch fp32's own distance (see
tests/corpus/check.py). ``skip`` in ``lowp`` counts fp16 steps that dynamic loss scaling skipped.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.corpus import check  # noqa: E402
from tests.corpus.models import BUILDERS, build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILDERS))
    parser.add_argument("--exporters", default=",".join(check.EXPORTERS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = []
    for name in args.models.split(","):
        for exporter in args.exporters.split(","):
            start = time.perf_counter()
            try:
                result, failures = check.measure(build(name), exporter)
            except check.ExportFailed as e:
                rows.append((name, exporter, None, {"export": str(e)}, time.perf_counter() - start))
                print(f"{name}/{exporter}: export failed: {e}", flush=True)
                continue
            rows.append((name, exporter, result, failures, time.perf_counter() - start))
            print(f"{name}/{exporter}: {time.perf_counter() - start:.1f} s {failures or ''}", flush=True)
    print()
    head = (f"{'model':13s} {'exporter':11s} {'grad':>8s} {'worst parameter':44s} {'adamw':>8s} "
            f"{'bf16':>8s} {'fp16':>8s} {'skip':>4s} {'export':>6s} {'total':>6s}  verdict")
    print(head)
    print("-" * len(head))
    for name, exporter, result, failures, seconds in rows:
        if result is None:
            print(f"{name:13s} {exporter:11s} {'export failed in torch: ' + failures['export']}")
            continue
        verdicts = []
        if result.grad_errors:
            worst, err = result.worst_grad
            bad = result.bad_grads
            noisy = [k for k, e in result.grad_errors.items() if e.ok and e.vs_torch > check.GRAD_TOL]
            verdicts.append(f"grad FAIL ({len(bad)} params)" if bad else
                            f"grad ok ({len(noisy)} within fp32 noise of float64)" if noisy else "grad ok")
        else:
            worst, err = "-", float("nan")
        if result.loss_error is not None:
            e = result.loss_error
            verdicts.append("adamw FAIL" if not e.ok else "adamw ok" if e.vs_torch <= check.LOSS_TOL else
                            f"adamw ok (float64 {e.vs_fp64:.1e}, fp32 torch {e.torch_vs_fp64:.1e})")
        deltas = result.lowp_deltas
        if deltas:
            verdicts.append("lowp ok" if max(deltas.values()) <= check.LOWP_TOL else "lowp FAIL")
        seen: set[str] = set()
        for k, v in failures.items():
            verdicts.append(f"{k}: {v[:110]}" if v not in seen else f"{k}: same")
            seen.add(v)
        adamw = f"{result.loss_error.vs_torch:8.1e}" if result.loss_error else f"{'-':>8s}"
        bf16 = f"{deltas['bf16']:8.1e}" if deltas else f"{'-':>8s}"
        fp16 = f"{deltas['fp16']:8.1e}" if deltas else f"{'-':>8s}"
        skip = f"{result.lowp_skipped.get('fp16', 0):4d}" if deltas else f"{'-':>4s}"
        short = worst if len(worst) <= 44 else "…" + worst[-43:]
        print(f"{name:13s} {exporter:11s} {err:8.1e} {short:44s} {adamw} {bf16} {fp16} {skip} "
              f"{result.seconds.get('export', 0):6.1f} {seconds:6.1f}  {'; '.join(verdicts)}")


if __name__ == "__main__":
    main()
