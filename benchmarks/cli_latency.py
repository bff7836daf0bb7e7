"""The command line's start-up: ``mpgraph --help`` and a bf16 ``convert`` of the bundled GPT.

Each command runs ``--repeat`` times in a fresh process (the installed ``mpgraph`` console
script, as a user types it), the two commands alternating so that load from other work lands
on both alike, after one untimed run of each (it compiles bytecode and warms the page cache).
Prints, per command, the best and median wall time, the CPU seconds of the best run (user +
system; they stretch far less than wall time when other work loads the machine) and the ratio
to its target. Then one more run of each with ``PYTHONPROFILEIMPORTTIME=1`` gives the import
time per top-level package: most of ``convert``'s time goes to importing onnx, which imports
ml_dtypes (half a second on the 2-core machine, most of it numpy's ``PyUFunc_AddLoop`` as
ml_dtypes registers its dtypes' loops), and onnx_ir, which imports sympy at module level; the
command modules import neither before they run. The first lines give the command, the date, the
commit and the load average at start and end (the machine may be shared).

Usage:
    python3 benchmarks/cli_latency.py [--repeat 7] [--out benchmarks/results/cli_latency.txt]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = Path("models/onnx/gpt.onnx")
#: The issue's targets, in seconds, idle on the 2-core machine.
TARGETS = {"help": 0.5, "convert": 2.0}


def _mpgraph() -> list[str]:
    """The console script beside this interpreter (what ``pip install`` made), else ``-m``."""
    script = Path(sys.executable).with_name("mpgraph")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpgraph"]


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stderr) of one run; a failed run stops the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    ran = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if ran.returncode != 0:
        sys.exit(f"{shlex.join(argv)} exited {ran.returncode}:\n{ran.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, ran.stderr


def _imports(argv: list[str], top: int) -> str:
    """The ``top`` top-level packages by import time (self time summed over submodules)."""
    _, _, err = _run(argv, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    per_package: collections.Counter[str] = collections.Counter()
    for m in re.finditer(r"^import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", err, re.MULTILINE):
        per_package[m.group(2).split(".")[0]] += int(m.group(1))
    total = sum(per_package.values()) / 1e6
    parts = ", ".join(f"{name} {us / 1e6:.2f}" for name, us in per_package.most_common(top))
    return f"imports {total:.2f} s: {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed runs of each command")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()

    out_dir = Path(tempfile.mkdtemp(prefix="cli_latency_"))
    exe = _mpgraph()
    commands = {
        "help": [*exe, "--help"],
        "convert": [*exe, "convert", str(GPT), "--policy", "bf16", "-o", str(out_dir / "gpt.bf16.onnx")],
    }
    shown = {"help": "mpgraph --help", "convert": f"mpgraph convert {GPT} --policy bf16 -o <tmp>"}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        f"command: python3 benchmarks/cli_latency.py {shlex.join(sys.argv[1:])}".rstrip(),
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, commit {commit}",
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, mpgraph run as {shlex.join(exe)}",
        "load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    ]
    if os.getloadavg()[0] > (os.cpu_count() or 1) / 2:
        lines.append("note: other work was loading the machine: wall times are above what an idle machine gives")
    for argv in commands.values():
        _run(argv)
    walls: dict[str, list[float]] = {k: [] for k in commands}
    cpus: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(args.repeat):
        for key, argv in commands.items():
            wall, cpu = _run(argv)[:2]
            walls[key].append(wall)
            cpus[key].append(cpu)
    lines.append("load average (1, 5, 15 min) at end:   " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    lines.append("")
    width = max(len(s) for s in shown.values())
    lines.append(f"{'command':<{width}}  best s  median s  cpu s  target s  best/target")
    for key in commands:
        best = min(walls[key])
        cpu = cpus[key][walls[key].index(best)]
        verdict = "within" if best <= TARGETS[key] else "OVER"
        lines.append(f"{shown[key]:<{width}}  {best:6.2f}  {statistics.median(walls[key]):8.2f}  {cpu:5.2f}  "
                     f"{TARGETS[key]:8.1f}  {best / TARGETS[key]:5.2f} {verdict}")
    lines.append(f"(best and median of {args.repeat} fresh processes each)")
    lines.append("")
    for key, argv in commands.items():
        lines.append(f"{shown[key]}: {_imports(argv, top=8)}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
