"""``mpgraph.check_grad`` (finite differences, no torch) on every corpus model and exporter.

Each case of tests/corpus is built from its library config with random init (nothing
downloaded), exported with ``tests.corpus.check.export`` (TorchScript and dynamo, loss as the
only output), and checked with ``check_grad(model, loss=<the loss output>)`` and every other
argument at its default: seeded generated inputs, float64 where ORT has kernels, localization
on. Each (model, exporter) runs in its own process under ``--timeout`` seconds, so one slow
model is recorded and the rest still run. One row each::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_grad_corpus.py [--models bert,gpt2] [--exporters dynamo]

Columns: ``verdict`` (``pass``: every parameter agrees; ``noisy``: some parameter only within
the finite differences' own spread; ``FAIL``: some parameter disagrees, with the first wrong
rule check_grad names); ``params`` parameters checked; ``ops`` forward nodes whose gradient
rule the check exercises (nodes downstream of a parameter and upstream of the loss), and their
distinct op types; ``worst`` the largest parameter relative error, that parameter, and the op
that consumes it (through Identity/Cast/Transpose); ``fd`` the precision of the finite
differences (float64, naming any op that ran in float32) and ``rtol`` the pass tolerance
check_grad chose for it; ``check s`` the seconds of check_grad alone, ``wall`` the whole row.

``--pytorch-converted`` checks the onnx wheel's ``pytorch-converted/*/model.onnx`` single-module
exports instead, each with ``check_grad(path, loss="mse")`` (its own weights, seeded inputs):
per model ``pass``, ``noisy``, ``FAIL`` or the one-line error (a model without a float
parameter is refused: nothing to train), then the counts::

    .venv/bin/python benchmarks/check_grad_corpus.py --pytorch-converted
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: Ops a parameter passes through unchanged on its way to the op that uses it.
_PASS_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Unsqueeze", "Squeeze"})


def _path_nodes(model, loss: str, params: set[str]) -> list:  # noqa: ANN001 - onnx.ModelProto
    """Forward nodes downstream of some parameter and upstream of ``loss``."""
    nodes = list(model.graph.node)
    tainted = set(params)
    for node in nodes:
        if any(i in tainted for i in node.input):
            tainted.update(node.output)
    needed = {loss}
    on_path = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            needed.update(i for i in node.input if i)
            if any(i in tainted for i in node.input):
                on_path.append(node)
    return on_path[::-1]


def _consumer(model, name: str) -> str:  # noqa: ANN001
    """Op type (and node name) of the first node using parameter ``name``, past pass-through ops."""
    seen = {name}
    for _ in range(8):
        users = [n for n in model.graph.node if any(i in seen for i in n.input)]
        if not users:
            return "-"
        real = [n for n in users if n.op_type not in _PASS_THROUGH]
        if real:
            return real[0].op_type
        seen = {o for n in users for o in n.output}
    return "-"


def check_one(name: str, exporter: str) -> dict:
    """Export one case and check it; a JSON-ready row."""
    from mpgraph.check_grad import check_grad
    from tests.corpus import check
    from tests.corpus.models import build

    row: dict = {"model": name, "exporter": exporter}
    start = time.perf_counter()
    try:
        exported = check.export(build(name), exporter)
    except check.ExportFailed as e:
        row.update(verdict="export failed", error=str(e)[:200], seconds=time.perf_counter() - start)
        return row
    row["export_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        report = check_grad(exported.model, loss=exported.loss)
    except Exception as e:  # noqa: BLE001 - recorded in the table
        row.update(verdict="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}",
                   seconds=time.perf_counter() - start)
        return row
    row["seconds"] = time.perf_counter() - start
    params = {p.name for p in report.params}
    path = _path_nodes(exported.model, exported.loss, params)
    worst = max(report.params, key=lambda p: p.rel_error)
    statuses = [p.status for p in report.params]
    row.update(
        verdict="FAIL" if not report.passed else ("noisy" if "noisy" in statuses else "pass"),
        params=len(report.params), failed=statuses.count("fail"), noisy=statuses.count("noisy"),
        ops=len(path), op_types=len({n.op_type for n in path}),
        worst=worst.rel_error, worst_param=worst.name, worst_op=_consumer(exported.model, worst.name),
        worst_status=worst.status, dtype=report.dtype, rtol=report.rtol, notes=list(report.notes),
        failed_params=[f"{p.name} {p.rel_error:.1e} (spread {p.uncertainty:.0e})" for p in report.failed],
        nodes_checked=report.nodes_checked,
    )
    node = report.first_bad_node
    if node is not None:
        row["first_bad_node"] = (f"{node.name} ({node.op_type}, {node.rule}) input {node.input}: "
                                 f"{node.analytic:.6g} vs {node.numeric:.6g}, rel {node.rel_error:.1e}")
    return row


def _format(row: dict) -> str:
    head = f"{row['model']:13s} {row['exporter']:11s} {row['verdict']:6s}"
    if "params" not in row:
        return f"{head} {row.get('error', '')}"
    param = row["worst_param"] if len(row["worst_param"]) <= 40 else "…" + row["worst_param"][-39:]
    text = (f"{head} {row['params']:6d} {row['ops']:4d}/{row['op_types']:<3d} {row['worst']:8.1e} "
            f"{param:40s} {row['worst_op']:20s} {row['rtol']:6.0e} {row['seconds']:7.1f}  fd {row['dtype']}")
    extra = [f"{row['noisy']} noisy"] if row["noisy"] else []
    extra += [f"failed: {', '.join(row['failed_params'])}"] if row["failed"] else []
    if row.get("first_bad_node"):
        extra.append(f"first wrong rule: {row['first_bad_node']}")
    elif row["failed"]:
        extra.append(f"no single node's rule disagrees on its own ({row['nodes_checked']} checked)")
    extra += [f"note: {n}" for n in row["notes"]]
    return text + ("  " + "; ".join(extra) if extra else "")


def check_pytorch_converted() -> int:
    """``check_grad`` on every ``pytorch-converted`` model of the onnx wheel, one line each."""
    import collections

    import onnx

    import mpgraph
    from mpgraph.errors import MpgraphError

    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "pytorch-converted"
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(root.glob("*/model.onnx")):
        try:
            report = mpgraph.check_grad(str(path), loss="mse")
        except MpgraphError as e:
            outcome = f"refused: {str(e).splitlines()[0][:120]}"
            counts["refused" + (" (nothing to train)" if "nothing to train" in str(e) else "")] += 1
        else:
            statuses = collections.Counter(p.status for p in report.params)
            outcome = "FAIL" if not report.passed else ("noisy" if statuses["noisy"] else "pass")
            counts[outcome] += 1
            outcome += f" ({dict(statuses)})"
        print(f"{path.parent.name:45s} {outcome}", flush=True)
    print()
    print(f"{sum(counts.values())} models: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def main() -> int:
    from tests.corpus.check import EXPORTERS
    from tests.corpus.models import BUILDERS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BUILDERS))
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per (model, exporter), export included")
    parser.add_argument("--pytorch-converted", action="store_true",
                        help="check the onnx wheel's pytorch-converted models instead of the corpus")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "EXPORTER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pytorch_converted:
        return check_pytorch_converted()
    if args.one:
        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        print(json.dumps(check_one(*args.one)))
        return 0
    head = (f"{'model':13s} {'exporter':11s} {'verdict':6s} {'params':>6s} {'ops/types':9s} {'worst':>8s} "
            f"{'worst parameter':40s} {'its op':20s} {'rtol':>6s} {'check s':>7s}  fd precision; notes")
    print(head)
    print("-" * len(head), flush=True)
    counts: dict[str, int] = {}
    for name in args.models.split(","):
        for exporter in args.exporters.split(","):
            start = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, __file__, "--one", name, exporter], capture_output=True,
                                      text=True, timeout=args.timeout, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if lines else {
                    "model": name, "exporter": exporter, "verdict": "crash",
                    "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:200]}"}
            except subprocess.TimeoutExpired:
                row = {"model": name, "exporter": exporter, "verdict": "timeout",
                       "error": f"not done after {args.timeout:.0f} s (export included)"}
            counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
            print(_format(row) + f"  [{time.perf_counter() - start:.0f} s wall]", flush=True)
    print()
    print(f"{sum(counts.values())} model x exporter: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
