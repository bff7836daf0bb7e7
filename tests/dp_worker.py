"""One rank of the data-parallel tests (``tests/test_data_parallel.py``), run as a process.

``python -m tests.dp_worker DIR RANK WORLD`` joins a gloo group through ``DIR/rendezvous``,
runs every scenario of ``DIR/scenarios.json`` on this rank's share of its batches, and writes
``DIR/<scenario>.<rank>.npz``: the whole state after the last step, the losses and skips.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
import torch.distributed as dist

from mpgraph.runtime import parallel_executor
from mpgraph.runtime.data_parallel import DataParallelOptions, DataParallelRunner, shard_batch
from mpgraph.runtime.gradient_buckets import reduce_buckets
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.parallel_trainer import DataParallelTrainer


def run_scenario(folder: str, scenario: dict, rank: int, world: int) -> None:
    step = ir.from_proto(onnx.load(os.path.join(folder, scenario["model"])))
    options = DataParallelOptions(threads=1, **scenario["options"])
    with np.load(os.path.join(folder, scenario["batches"])) as data:
        batches = [{k.split(":")[1]: data[k] for k in data.files if k.startswith(f"{i}:")}
                   for i in range(scenario["steps"])]
    if scenario.get("loop"):
        run_loop(folder, scenario, step, options, batches)
        return
    if scenario.get("skip_reduction"):  # the mutant the tests must catch: no collective at all
        parallel_executor.reduce_buckets = lambda *args, **kwargs: None
    try:
        run_runner(folder, scenario, step, options, batches, rank, world)
    finally:
        parallel_executor.reduce_buckets = reduce_buckets


def run_runner(folder: str, scenario: dict, step: ir.Model, options: DataParallelOptions, batches: list,
               rank: int, world: int) -> None:
    runner = DataParallelRunner(step, options=options)
    losses, skipped = [], []
    for i, batch in enumerate(batches, 1):
        result = runner.step(shard_batch(batch, rank, world))
        losses.append(result.loss)
        skipped.append(result.skipped)
        if i == scenario.get("checkpoint_after"):
            runner.save(os.path.join(folder, f"{scenario['name']}.ckpt.npz"))
    state = runner.full_state()
    np.savez(os.path.join(folder, f"{scenario['name']}.{rank}.npz"), __losses=np.array(losses),
             __skipped=np.array(skipped), __held=np.array(sorted(runner.state)),
             __held_sizes=np.array([a.size for _, a in sorted(runner.state.items())]), **state)


def run_loop(folder: str, scenario: dict, step: ir.Model, options: DataParallelOptions, batches: list) -> None:
    """The scenario through the training loop (``DataParallelTrainer.fit`` on the global
    batches), its collective checkpoint written from the callback."""
    trainer = DataParallelTrainer(step, RunOptions(threads=1), options)
    path = os.path.join(folder, f"{scenario['name']}.ckpt.npz")

    def callback(done: int, _) -> None:
        if done == scenario.get("checkpoint_after"):
            trainer.save_checkpoint(path)

    metrics = trainer.fit(iter(batches), len(batches), callback=callback)
    state = trainer.state
    held = trainer.executor.held
    np.savez(os.path.join(folder, f"{scenario['name']}.{trainer.rank}.npz"), __losses=np.array(metrics.loss),
             __skipped=np.array(metrics.skipped), __held=np.array(sorted(held)),
             __held_sizes=np.array([a.size for _, a in sorted(held.items())]), **state)


def main() -> None:
    folder, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        with open(os.path.join(folder, "scenarios.json")) as f:
            for scenario in json.load(f):
                run_scenario(folder, scenario, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
