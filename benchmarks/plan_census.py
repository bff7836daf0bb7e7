"""The CUDA session plans of one real model's two exports, side by side, made on any machine.

Each export (TorchScript with eager attention, dynamo) is built as ``real_models.py`` builds it
(random init from the config, ``build_training_graph(target="cuda")``, ``convert`` to the
policy), specialised to the benchmark's batch and planned as a CUDA-graph session whose kernel
library has the fused attention (``plan_memory.py``'s plan; no library is built or loaded). It
prints the rewrites of each lowering rule and the op types whose counts differ: where one
exporter's step does work the other's does not, found without a GPU. The GPT-2 dynamo export
kept 96 Transposes around its fused attention this way (``sdpa_layout`` took 0 of 12).

    python3 benchmarks/plan_census.py gpt2            # about 3 minutes on 2 cores, 3 GB of files
    python3 benchmarks/plan_census.py bert --policy bf16 --workdir /tmp/census
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

#: The benchmark's batch and sequence per model (``real_models.py``).
SHAPES = {"gpt2": (8, 1024), "llama": (8, 1024), "bert": (8, 512)}


def plan_counts(path: Path, batch: tuple[int, int]) -> collections.Counter:
    """The op-type counts of the capturing CUDA plan (``plan_memory.capturing_plan``, which
    prints each rule's rewrites) of the step graph at ``path``."""
    from plan_memory import capturing_plan

    model = capturing_plan(str(path), {name: list(batch) for name in ("input_ids", "labels")}, sdpa=True)
    return collections.Counter(node.op_type for node in model.graph)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("--policy", default="bf16")
    parser.add_argument("--workdir", default=None, help="where the step graphs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    from real_models_cases import PrepJob, prepare

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        counts = {}
        for exporter in ("torchscript", "dynamo"):
            built = prepare(PrepJob(model=args.model, exporter=exporter, small=False, seed=0, policies=(args.policy,),
                                    emulate=False, target="cuda", workdir=workdir))
            if built["errors"]:
                print(f"{exporter}: {built['errors']}")
                return 1
            print(f"{exporter}:")
            counts[exporter] = plan_counts(Path(built["graphs"][args.policy]), SHAPES[args.model])
        print(f"op types whose counts differ ({args.model}, {args.policy}, batch {SHAPES[args.model]}):")
        for op in sorted(set(counts["torchscript"]) | set(counts["dynamo"])):
            ts, dy = counts["torchscript"][op], counts["dynamo"][op]
            if ts != dy:
                print(f"  {op:28s} torchscript {ts:5d}  dynamo {dy:5d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
