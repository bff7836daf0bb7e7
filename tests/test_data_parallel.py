"""Data-parallel training on gloo: 2 and 3 processes against one process, bit for bit (fp32).

One process with ``micro_batches=N`` runs the same N slices of each global batch one after
the other and sums them in slice order, which is what N ranks do with the ordered reduction:
the same float32 bits. Each world size is one run of N worker processes (``tests.dp_worker``)
that goes through every scenario, so the processes start once (torch's import is ~2 s of CPU).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.audit.rank_memory import rank_memory
from mpgraph.errors import CheckpointError, TrainingError, UsageError
from mpgraph.lowering import plan_session
from mpgraph.policy import parse_policy
from mpgraph.runtime.data_parallel import (
    DataParallelOptions,
    DataParallelRunner,
    shard_batch,
    train_data_parallel,
)
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.parallel_trainer import DataParallelTrainer
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.cpu_runner import CpuRunner
from tests.helpers import mpgraph_cli

GLOBAL_BATCH = 6  # divisible by 2 and 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _model_bytes(model: str) -> bytes:
    name, _, kind = model.partition(":")
    options = {"pack": False} if "unpacked" in kind else None
    step = build_training_graph(f"models/onnx/{name}.loss.onnx", optimizer="adamw", optimizer_options=options)
    if "fp16" in kind:
        policy = parse_policy("extends: fp16\nloss_scaling: {mode: dynamic, init: 1024, growth_interval: 2}\n",
                                             "dp.yaml")
        step = mpgraph.convert(step, policy, emulate=True)
    return ir.to_proto(step).SerializeToString()


def _step(model: str) -> ir.Model:
    return ir.from_proto(onnx.load_from_string(_model_bytes(model)))


def _batches(model: str, steps: int, plant: int | None, size: int = GLOBAL_BATCH) -> list[dict[str, np.ndarray]]:
    """Seeded global batches; with ``plant``, an inf in the last row (the last rank's slice)
    of that step's batch."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(steps):
        if model.startswith("gpt"):
            batch = {"tokens": rng.integers(0, 64, (size, 16)), "label": rng.integers(0, 64, (size, 16))}
        else:
            batch = {"x": rng.standard_normal((size, 4)).astype(np.float32), "label": rng.integers(0, 2, size)}
            if i == plant:
                batch["x"][-1, 0] = np.inf
        out.append(batch)
    return out


#: name: (model, options, steps, step with a planted inf)
SCENARIOS = {
    "mlp": ("tiny_mlp", {"bucket_bytes": 4096}, 3, None),
    "gpt": ("gpt", {"bucket_bytes": 1 << 16, "micro_batches": 2}, 2, None),
    "mlp_fp16": ("tiny_mlp:fp16", {}, 4, 1),
    "mlp_fp16_zero": ("tiny_mlp:fp16", {"shard_optimizer": True}, 4, 1),
    "mlp_zero": ("tiny_mlp", {"shard_optimizer": True, "bucket_bytes": 4096}, 3, None),
    "gpt_zero": ("gpt:unpacked", {"shard_optimizer": True}, 2, None),
    "mlp_all_reduce": ("tiny_mlp", {"reduction": "all_reduce"}, 3, None),
    "mlp_zero_loop": ("tiny_mlp", {"shard_optimizer": True, "bucket_bytes": 4096}, 3, None),
    "mlp_unreduced": ("tiny_mlp", {"bucket_bytes": 4096}, 3, None),
}
#: Scenarios whose ranks skip the reduction (``reduce_buckets`` a no-op): what the tests must catch.
UNREDUCED = {"mlp_unreduced"}
#: Scenarios run through the training loop (``DataParallelTrainer.fit``), not the runner.
LOOP = {"mlp_zero_loop"}
GLOBAL_BATCH_OF = {"gpt": 12}  # 2 slices a rank on 2 and 3 ranks
ONLY_ON = {"mlp_all_reduce": 2, "mlp_unreduced": 2}


def _run_world(folder, world: int) -> dict[str, list[dict[str, np.ndarray]]]:
    """Every scenario on ``world`` gloo processes; each rank's final state, losses, skips."""
    scenarios = []
    for name, (model, options, steps, plant) in SCENARIOS.items():
        if ONLY_ON.get(name, world) != world:
            continue
        (folder / f"{name}.onnx").write_bytes(_model_bytes(model))
        batches = _batches(model, steps, plant, GLOBAL_BATCH_OF.get(name, GLOBAL_BATCH))
        np.savez(folder / f"{name}.batches.npz", **{f"{i}:{k}": v for i, b in enumerate(batches) for k, v in b.items()})
        scenarios.append({"name": name, "model": f"{name}.onnx", "batches": f"{name}.batches.npz", "steps": steps,
                          "options": options, "checkpoint_after": 2 if name in ("mlp", "mlp_zero", "mlp_zero_loop") else None,
                          "loop": name in LOOP, "skip_reduction": name in UNREDUCED})
    (folder / "scenarios.json").write_text(json.dumps(scenarios))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dp_worker", str(folder), str(r), str(world)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    out = {}
    for name in SCENARIOS:
        if ONLY_ON.get(name, world) != world:
            continue
        out[name] = []
        for rank in range(world):
            with np.load(folder / f"{name}.{rank}.npz") as data:
                out[name].append({k: data[k] for k in data.files})
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"world{request.param}")
    return request.param, folder, _run_world(folder, request.param)


def _one_process(name: str, world: int) -> tuple[DataParallelRunner, list]:
    """The scenario in this process, unsharded: each global batch in as many slices as
    ``world`` ranks cut it into, summed in the same tree."""
    model, options, steps, plant = SCENARIOS[name]
    slices = world * options.get("micro_batches", 1)
    options = {**options, "shard_optimizer": False, "reduction": "ordered", "micro_batches": slices}
    runner = DataParallelRunner(_step(model), options=DataParallelOptions(threads=1, **options))
    return runner, [runner.step(b) for b in _batches(model, steps, plant, GLOBAL_BATCH_OF.get(name, GLOBAL_BATCH))]


def _assert_ranks_equal_one_process(results, name: str, world: int) -> dict[str, np.ndarray]:
    reference, steps = _one_process(name, world)
    state = reference.full_state()
    for rank, got in enumerate(results[name]):
        np.testing.assert_array_equal(got["__losses"], [s.loss for s in steps], err_msg=f"rank {rank}")
        np.testing.assert_array_equal(got["__skipped"], [s.skipped for s in steps], err_msg=f"rank {rank}")
        for key, value in state.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name}: rank {rank} of {world}, state {key}")
    return state


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_ranks_train_like_one_process_bit_for_bit(world, name):
    """The GPT runs 2 micro-batches a rank: N ranks give the bits of one process over 2N
    slices (rule 2's tree); the MLP one slice a rank."""
    size, _, results = world
    state = _assert_ranks_equal_one_process(results, name, size)
    # The whole step graph on the whole batch sums the batch in another order: close, not
    # equal. AdamW turns the rounding noise of a gradient that is zero in exact arithmetic
    # (the GPT's key bias) into updates of up to lr: 1.6e-5 measured here, 2e-9 on the MLP.
    model, _, steps, _ = SCENARIOS[name]
    whole = CpuRunner(_step(model), threads=1)
    losses = [whole.step(batch) for batch in _batches(model, steps, None, GLOBAL_BATCH_OF.get(name, GLOBAL_BATCH))]
    np.testing.assert_allclose(results[name][0]["__losses"], losses, rtol=1e-5)
    for key, value in whole.state.items():
        np.testing.assert_allclose(state[key], value, rtol=1e-4, atol=1e-4, err_msg=key)


@pytest.mark.parametrize("name", ["mlp_fp16", "mlp_fp16_zero"])
def test_an_overflow_on_one_rank_skips_on_every_rank(world, name):
    size, _, results = world
    state = _assert_ranks_equal_one_process(results, name, size)
    for got in results[name]:
        assert got["__skipped"].tolist() == [False, True, False, False]
    # 1024; step 1 finite (tracker 1); step 2 overflows: 512, tracker 0; steps 3 and 4 finite:
    # the second makes 2 in a row, 1024, tracker 0.
    assert state[md.LOSS_SCALE] == 1024.0 and state[md.GROWTH_TRACKER] == 0.0


@pytest.mark.parametrize("name", ["mlp_zero", "gpt_zero", "mlp_fp16_zero"])
def test_sharded_optimizer_state_trains_like_one_unsharded_process(world, name):
    """Per-tensor AdamW (gpt_zero): each parameter's moments live on one rank. Packed
    (mlp_zero, mlp_fp16_zero: every parameter in one flat slot): each rank holds and updates
    its slice of the flat moments."""
    size, _, results = world
    _assert_ranks_equal_one_process(results, name, size)
    state = results[name][0]
    held = [dict(zip(got["__held"].tolist(), got["__held_sizes"].tolist(), strict=True)) for got in results[name]]
    moments = [k for k in state if k.startswith("optim/") and k != "optim/step"]
    for key in moments:
        holders = [h[key] for h in held if key in h]
        if key.startswith("optim/flat/"):
            assert len(holders) == size and sum(holders) == state[key].size and max(holders) - min(holders) <= 1
        else:
            assert len(holders) == 1, f"{key} is held by {len(holders)} ranks"
    assert all(any(k in h for k in moments) for h in held)  # every rank holds a share
    # audit --memory --nproc: the bytes it counts per rank are the bytes the ranks held.
    estimate = rank_memory(_step(SCENARIOS[name][0]), size, shard_optimizer=True)
    params = {k for k in state if not k.startswith(("optim/", "loss_scale", "__"))}
    for rank, h in enumerate(held):
        assert estimate[rank].optimizer_state == 4 * sum(n for k, n in h.items() if k not in params)
        assert estimate[rank].master_weights == sum(state[k].nbytes for k in params)


def test_ranks_that_skip_the_reduction_fail_the_comparison(world):
    """The mutant: the same 2 ranks with ``reduce_buckets`` a no-op. Each rank then trains on
    its own half of the batch, so the ranks drift apart and neither equals one process on the
    whole batch: the comparison the tests above make fails, as it must."""
    size, _, results = world
    if size != 2:
        pytest.skip("run on 2 ranks only")
    ranks = results["mlp_unreduced"]
    assert any(not np.array_equal(ranks[0][k], ranks[1][k]) for k in ranks[0] if not k.startswith("__"))
    with pytest.raises(AssertionError):
        _assert_ranks_equal_one_process(results, "mlp_unreduced", 2)
    reduced = results["mlp"][0]  # the same batches with the reduction: equal to one process
    assert any(not np.allclose(ranks[0][k], reduced[k], rtol=1e-4, atol=1e-4) for k in reduced if not k.startswith("__"))


def test_audit_memory_reports_bytes_per_rank(tmp_path):
    path = tmp_path / "gpt.onnx"
    path.write_bytes(_model_bytes("gpt:unpacked"))
    ran = mpgraph_cli("audit", "--memory", "--nproc", "2", "--shard-optimizer", "--json", str(path))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    ranks = json.loads(ran.stdout)["ranks"]
    unsharded = rank_memory(_step("gpt:unpacked"), 2)
    moments = unsharded[0].optimizer_state - 4  # less the step counter, which every rank keeps
    assert [r["optimizer_state"] for r in ranks] == [moments // 2 + 4] * 2  # the GPT's groups split evenly
    assert ranks[0]["receive_buffers"] == ranks[0]["gradient_buckets"]  # one chunk of each rank's buckets
    assert mpgraph_cli("audit", "--nproc", "2", str(path)).returncode == 2  # only with --memory


def test_plain_all_reduce_is_bit_for_bit_on_two_ranks(world):
    size, _, results = world
    if size != 2:
        pytest.skip("all_reduce fixes the order of a sum of two terms only")
    _assert_ranks_equal_one_process(results, "mlp_all_reduce", 2)


@pytest.mark.parametrize("name", ["mlp", "mlp_zero"])
def test_rank_zero_checkpoint_resumes_on_another_world_size(world, name):
    """Saved by N ranks after step 2 (mlp_zero: the flat moments gathered from their slices),
    resumed by one unsharded process (N slices): step 3 gives the N ranks' step 3 bit for bit."""
    size, folder, results = world
    path = folder / f"{name}.ckpt.npz"
    assert [p.name for p in folder.iterdir() if p.name.startswith(f".{name}.ckpt")] == []  # no temporary left
    resumed = DataParallelRunner(_step("tiny_mlp"), options=DataParallelOptions(threads=1, micro_batches=size))
    resumed.load(str(path))
    assert resumed.steps == 2
    resumed.step(_batches("tiny_mlp", 3, None)[2])
    for key, value in resumed.full_state().items():
        np.testing.assert_array_equal(value, results[name][0][key], err_msg=key)
    with pytest.raises(CheckpointError, match="not this step graph"):
        DataParallelRunner(_step("gpt"), options=DataParallelOptions(threads=1)).load(str(path))


def test_the_training_loop_drives_the_data_parallel_executor(world, tmp_path):
    """``DataParallelTrainer.fit`` (the one-process loop over a ``DataParallelExecutor``) on N
    ranks with ZeRO-1 gives the runner's one-process bits; its collective checkpoint after step
    2 (the loop's format, written by rank 0) resumes in one process on another world size, in
    a ``DataParallelTrainer`` (step 3 gives the ranks' bits) and in a plain ``Trainer``."""
    size, folder, results = world
    _assert_ranks_equal_one_process(results, "mlp_zero_loop", size)
    for got in results["mlp_zero_loop"]:  # each rank held a slice of the packed moments
        sizes = dict(zip(got["__held"].tolist(), got["__held_sizes"].tolist(), strict=True))
        flat = [k for k in sizes if k.startswith("optim/flat/")]
        assert flat and all(sizes[k] < got[k].size for k in flat)
    path = folder / "mlp_zero_loop.ckpt.npz"
    resumed = DataParallelTrainer(_step("tiny_mlp"), RunOptions(threads=1), DataParallelOptions(micro_batches=size))
    resumed.load_checkpoint(path)
    assert resumed.steps == 2 and len(resumed.metrics.loss) == 2
    plain = Trainer(_step("tiny_mlp"), threads=1)
    plain.load_checkpoint(path)
    for key, value in resumed.state.items():
        np.testing.assert_array_equal(plain.state[key], value, err_msg=key)
    resumed.step(_batches("tiny_mlp", 3, None)[2])
    for key, value in resumed.state.items():
        np.testing.assert_array_equal(value, results["mlp_zero_loop"][0][key], err_msg=key)
    np.testing.assert_array_equal(resumed.metrics.loss, results["mlp_zero_loop"][0]["__losses"])


def test_data_parallel_sessions_run_the_lowering_plans():
    """The executor's two sessions load ``plan_session``'s plans of the two parts: together the
    rules of the whole step's plan (ReLU gradient fusion in the gradient part, AdamW in the
    apply part), whose fused nodes ORT then runs. They are bit-identical rules: without
    kernels (nothing applied) two steps give the same bits."""
    step = _step("tiny_mlp")
    runs = {}
    for kernels in (None, False):
        runner = DataParallelRunner(step, options=DataParallelOptions(micro_batches=2),
                                    run_options=RunOptions(threads=1, kernels=kernels))
        runs[kernels] = runner, [runner.step(b).loss for b in _batches("tiny_mlp", 2, None)]
    runner = runs[None][0]
    applied = {part: {n: c for n, c in plan.applied if c} for part, plan in runner.executor.plans.items()}
    assert applied == {"gradient": {"relu_grad": 2}, "apply": {"adamw": 1, "adam_scalars": 1}}
    whole = plan_session(step, "cpu", runner.program.plan_options(RunOptions(threads=1)))
    assert {n: c for n, c in whole.applied if c} == {**applied["gradient"], **applied["apply"]}
    fused = [n for n in runner.executor.node_providers() if n.endswith(("/ReluGrad", "/AdamWUpdate"))]
    assert len(fused) == 3
    plain = runs[False][0]
    assert all(plan.kernels_fused == 0 for plan in plain.executor.plans.values())
    assert not [n for n in plain.executor.node_providers() if n.endswith(("/ReluGrad", "/AdamWUpdate"))]
    assert runs[None][1] == runs[False][1]
    for key, value in runner.full_state().items():
        np.testing.assert_array_equal(plain.full_state()[key], value, err_msg=key)


def test_data_parallel_trainer_evaluates_like_a_trainer_with_its_state():
    """One process: ``fit`` on a dataset, then ``evaluate`` and ``predict`` run the forward
    plan on the executor's parameter buffers, as a ``Trainer`` holding the same state does."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((48, 4)).astype(np.float32)
    data = {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}
    trainer = DataParallelTrainer(_step("tiny_mlp"), RunOptions(threads=1), DataParallelOptions(micro_batches=2))
    trainer.fit(data, steps=4, batch_size=16)
    plain = Trainer(_step("tiny_mlp"), threads=1, state=trainer.state)
    np.testing.assert_array_equal(trainer.predict(data), plain.predict(data))
    assert trainer.evaluate(data) == plain.evaluate(data)
    with pytest.raises(UsageError, match="must be finite"):
        trainer.step({k: v[:16] for k, v in data.items()}, lr=float("nan"))


def test_ort_writes_the_gradients_into_the_bucket_tensors():
    """The buckets are torch tensors (what the collectives reduce in place) and ORT writes
    every gradient and the loss into their views through DLPack: the same addresses, no copy.
    (On a GPU the tensors would own device memory, bound the same way; not run here.)"""
    runner = DataParallelRunner(_step("tiny_mlp"), options=DataParallelOptions(threads=1, bucket_bytes=64))
    runner.step(_batches("tiny_mlp", 1, None)[0])
    executor = runner.executor
    assert len(executor.bucket_tensors) > 1
    outputs, views = executor.gradient_outputs(), executor.bucket_views()
    assert set(views) == {g for _, g in runner.split.gradients} | {runner.split.loss}
    for name, view in views.items():
        assert outputs[name].data_ptr() == view.data_ptr(), name
    assert runner.step(_batches("tiny_mlp", 2, None)[1]).loss == float(views[runner.split.loss])


def test_train_data_parallel_meets_a_nonfinite_batch_as_the_loop_does(monkeypatch, tmp_path):
    """``--on-nonfinite`` reaches ``fit`` (rule 1: the batch is checked before the step):
    ``stop`` raises, ``skip`` counts the step and leaves the state; ``mpgraph train --nproc``
    passes the flag on to the ranks."""
    import mpgraph.cli.train_nproc as train_nproc

    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    x[3, 1] = np.nan  # in one of the two batches of the first epoch
    np.savez(tmp_path / "d.npz", x=x, label=rng.integers(0, 2, 16))
    options = DataParallelOptions(threads=1, micro_batches=2)
    with pytest.raises(TrainingError, match="non-finite"):
        train_data_parallel(_step("tiny_mlp"), str(tmp_path / "d.npz"), steps=2, batch_size=8, options=options)
    ran = train_data_parallel(_step("tiny_mlp"), str(tmp_path / "d.npz"), steps=2, batch_size=8, options=options,
                              on_nonfinite="skip")
    assert ran.steps == 2 and ran.metrics.skipped.count(True) == 1
    launched = []
    monkeypatch.setattr(train_nproc, "launch", lambda nproc, args: launched.append(args) or 0)
    assert mpgraph_cli("train", "m.onnx", "--nproc", "2", "--on-nonfinite", "skip").returncode == 0
    assert launched[0][-2:] == ["--on-nonfinite", "skip"]


def test_shard_batch_refuses_a_batch_that_does_not_divide():
    assert shard_batch({"x": np.arange(6)}, 2, 3)["x"].tolist() == [4, 5]
    with pytest.raises(UsageError, match="not divisible into 4"):
        shard_batch({"x": np.arange(6)}, 0, 4)


def test_torchrun_launch_trains_like_one_process_and_resumes_the_stream(tmp_path):
    """``python -m mpgraph.cli.train_nproc --nproc 2`` (what ``mpgraph train --nproc 2`` runs):
    5 steps of the data stream on 2 ranks equal one process with 2 slices that runs 3 steps,
    checkpoints, and resumes for 2 (the checkpoint holds the stream's position)."""
    (tmp_path / "mlp.onnx").write_bytes(_model_bytes("tiny_mlp"))
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((20, 4)).astype(np.float32), label=rng.integers(0, 2, 20))
    args = ["mlp.onnx", "--data", "d.npz", "--steps", "5", "--batch", "8", "--checkpoint", "ranks.npz", "--threads", "1"]
    ran = subprocess.run([sys.executable, "-m", "mpgraph.cli.train_nproc", "--nproc", "2", *args], cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "step 5: loss" in ran.stdout and "trained 5 steps on 2 processes" in ran.stdout
    options = DataParallelOptions(threads=1, micro_batches=2)
    first = str(tmp_path / "one.npz")
    train_data_parallel(_step("tiny_mlp"), str(tmp_path / "d.npz"), steps=3, batch_size=8, checkpoint=first, options=options)
    one = train_data_parallel(_step("tiny_mlp"), str(tmp_path / "d.npz"), steps=2, batch_size=8, resume=first, options=options)
    assert one.steps == 5  # 20 samples, batch 8: step 3 starts the second epoch
    check = Trainer(_step("tiny_mlp"), threads=1)  # the one-process checkpoint format
    check.load_checkpoint(tmp_path / "ranks.npz")
    assert check.steps == 5
    for key, value in one.state.items():
        np.testing.assert_array_equal(check.state[key], value, err_msg=key)


def test_mpgraph_train_nproc_launches_the_data_parallel_run(monkeypatch, tmp_path):
    """``mpgraph train --nproc 2`` hands its flags to the torchrun launcher (the launch itself
    is the test above) and refuses the flags a data-parallel run does not take yet."""
    import mpgraph.cli.train_nproc as train_nproc

    launched = []
    monkeypatch.setattr(train_nproc, "launch", lambda nproc, args: launched.append((nproc, args)) or 0)
    ran = mpgraph_cli("train", "m.onnx", "--nproc", "2", "--data", "d.npz", "--steps", "5", "--batch", "8",
                      "--checkpoint", str(tmp_path / "c.npz"), "--shard-optimizer")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert launched == [(2, ["m.onnx", "--data", "d.npz", "--steps", "5", "--batch", "8", "--seed", "0",
                             "--checkpoint-every", "0", "--checkpoint", str(tmp_path / "c.npz"), "--shard-optimizer"])]
    assert mpgraph_cli("train", "m.onnx", "--nproc", "2", "--provider", "cuda").returncode == 0
    assert launched[-1][1][-2:] == ["--provider", "cuda"]
    launched.pop()
    alone = mpgraph_cli("train", "m.onnx", "--shard-optimizer")
    assert alone.returncode == 2 and "--shard-optimizer: only with --nproc" in alone.stderr
    refused = mpgraph_cli("train", "m.onnx", "--nproc", "2", "--metrics", str(tmp_path / "m.csv"))
    assert refused.returncode == 2 and "--metrics: not with --nproc" in refused.stderr
    assert len(launched) == 1
    monkeypatch.undo()  # the real launcher: an uneven batch is refused before any process starts
    uneven = mpgraph_cli("train", "m.onnx", "--nproc", "2", "--batch", "7")
    assert uneven.returncode == 2 and "--batch 7 must be divisible by --nproc 2" in uneven.stderr


def test_a_cuda_rank_without_a_gpu_stops_with_one_error_line(capsys, monkeypatch):
    """A rank of ``mpgraph train --nproc N --provider cuda`` on this machine (no GPU) says so in
    one line, before any process group is formed (torch's NCCL init would fail less clearly)."""
    import torch

    import mpgraph.cli.train_nproc as train_nproc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "1")
    assert train_nproc.main(["m.onnx", "--data", "digits", "--provider", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: rank 1: data-parallel training on cuda (NCCL) needs a GPU")


def test_cuda_ranks_are_refused_with_the_fix_where_they_cannot_run(monkeypatch):
    """NCCL asked where torch sees no GPU (this machine), ORT without its CUDA provider, more
    ranks on a node than visible GPUs, a provider data-parallel runs do not know, and a process
    group whose backend cannot reduce the provider's buffers: one clear error each."""
    import torch

    from mpgraph.errors import MpgraphError
    from mpgraph.runtime import rank_device

    with pytest.raises(UsageError, match="'cpu' \\(gloo\\) or 'cuda' \\(NCCL\\), not 'rocm'"):
        rank_device.place_rank("rocm", 0, 0, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MpgraphError, match="needs a GPU, and torch .* sees none"):
        DataParallelRunner(_step("tiny_mlp"), run_options=RunOptions(provider="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rank_device.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(MpgraphError, match="has no CUDAExecutionProvider: install onnxruntime-gpu"):
        rank_device.place_rank("cuda", 0, 0, 1)
    monkeypatch.setattr(rank_device.ort, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(MpgraphError, match="rank 2 of 3 would run on cuda:2, but 2 GPU\\(s\\) are visible: "
                                           "start at most 2 process\\(es\\) per node"):
        rank_device.place_rank("cuda", 0, 2, 3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device.place_rank("cuda", 0, 1, 2) == ("cuda", 1)
    with pytest.raises(MpgraphError, match="backend 'gloo' cannot reduce: init_process_group\\('nccl'\\)"):
        rank_device.check_backend("cuda", "gloo")
