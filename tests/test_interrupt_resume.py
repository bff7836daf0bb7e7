"""Ctrl-C, SIGTERM and kill -9 during training, then ``--resume``: the same final state, bit for bit.

Two layers:

1. In-process, at seeded step numbers: a stop request (what the SIGINT/SIGTERM handler sets),
   and a ``KeyboardInterrupt`` raised inside a step (Ctrl-C with no handler installed, which
   once left the data stream one batch ahead of the step count). Deterministic and fast.
2. Real processes (``python -m mpgraph train``) sent SIGINT, SIGTERM or SIGKILL after a
   seeded delay once training has begun; the run is resumed from its checkpoint for the
   remaining steps and compared with an uninterrupted run: every state array, the step count
   and the loss history. The resumed and the uninterrupted runs, which no signal reaches, are
   the same ``mpgraph train`` command run in this process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpgraph.runtime.checkpoint import metrics_path
from mpgraph.runtime.trainer import Trainer
from tests.helpers import Ran, mpgraph_cli

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from mpgraph.io import save_model
    from mpgraph.training import build_training_graph

    tmp = tmp_path_factory.mktemp("interrupt")
    step = tmp / "tiny.step.onnx"
    save_model(build_training_graph(str(ZOO / "tiny_mlp.loss.onnx"), optimizer="adamw"), step)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 4)).astype(np.float32)  # 12 batches of 16 per epoch, 8 dropped
    data = tmp / "data.npz"
    np.savez(data, x=x, label=(x[:, 0] + x[:, 1] > 0).astype(np.int64))
    return step, data


def _same(a: Trainer, b: Trainer) -> None:
    assert a.steps == b.steps
    sa, sb = a.state, b.state
    assert all(sa[k].tobytes() == sb[k].tobytes() for k in sa)
    assert a.metrics.loss == b.metrics.loss and a.metrics.step == b.metrics.step


# -- in-process, seeded step numbers ------------------------------------------------------------


def _arrays(data: Path) -> dict[str, np.ndarray]:
    with np.load(data) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stop_request_then_resume_is_bit_identical(setup: tuple[Path, Path], tmp_path: Path, seed: int):
    step, data = setup
    arrays, total = _arrays(data), 60
    full = Trainer(step, threads=1)
    full.fit(arrays, total, batch_size=16, seed=4)

    at = random.Random(seed).randrange(1, total)
    first = Trainer(step, threads=1)
    first.fit(arrays, total, batch_size=16, seed=4, stop=lambda: first.steps >= at)
    assert first.steps == at and first.stop_reason
    ckpt = tmp_path / "c.npz"
    first.save_checkpoint(ckpt)

    resumed = Trainer(step, threads=1)
    resumed.load_checkpoint(ckpt)
    resumed.fit(arrays, total - at, batch_size=16, seed=4)
    _same(full, resumed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keyboard_interrupt_inside_a_step_does_not_run_the_data_ahead(setup: tuple[Path, Path], tmp_path: Path,
                                                                      seed: int):
    step, data = setup
    arrays, total = _arrays(data), 60
    full = Trainer(step, threads=1)
    full.fit(arrays, total, batch_size=16, seed=4)

    at = random.Random(100 + seed).randrange(1, total)
    first = Trainer(step, threads=1)
    real_launch = first._launch

    def launch_then_ctrl_c(batch: dict[str, np.ndarray], position: object = None) -> object:
        if first.steps == at:
            raise KeyboardInterrupt  # Ctrl-C while ORT runs the step: the batch was drawn, no state changed
        return real_launch(batch, position)

    first._launch = launch_then_ctrl_c  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        first.fit(arrays, total, batch_size=16, seed=4)
    ckpt = tmp_path / "c.npz"
    first.save_checkpoint(ckpt)
    with np.load(ckpt) as z:
        meta = json.loads(z["__meta__"].tobytes())
    assert meta["steps"] == at
    assert meta["data"]["epoch"] * 12 * 16 + meta["data"]["index"] == at * 16  # not a batch ahead

    resumed = Trainer(step, threads=1)
    resumed.load_checkpoint(ckpt)
    resumed.fit(arrays, total - at, batch_size=16, seed=4)
    _same(full, resumed)


# -- real processes and real signals ------------------------------------------------------------

TOTAL = 4000


def _args(step: Path, data: Path, steps: int, ckpt: Path, *extra: str) -> list[str]:
    return ["train", str(step), "--data", str(data), "--steps", str(steps), "--batch", "16", "--seed", "4",
            "--threads", "1", "-q", "--no-eval", "--checkpoint", str(ckpt), *extra]


def _train(step: Path, data: Path, steps: int, ckpt: Path, *extra: str) -> subprocess.Popen:
    """``mpgraph train`` in a process of its own, for the runs that receive a signal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "mpgraph", *_args(step, data, steps, ckpt, *extra)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _train_here(step: Path, data: Path, steps: int, ckpt: Path, *extra: str) -> Ran:
    """``mpgraph train`` in this process (the real app, ``mpgraph_cli``), for the runs no signal
    reaches: a new interpreter costs more CPU (1.2 s) than the 4000 steps of the tiny MLP."""
    return mpgraph_cli(*_args(step, data, steps, ckpt, *extra))


@pytest.fixture(scope="module")
def uninterrupted(setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    step, data = setup
    ckpt = tmp_path_factory.mktemp("full") / "full.npz"
    run = _train_here(step, data, TOTAL, ckpt)
    assert run.returncode == 0, run.stderr
    trainer = Trainer(step, threads=1)
    trainer.load_checkpoint(ckpt)
    return trainer


@pytest.mark.parametrize("how,seed", [("SIGINT", 0), ("SIGTERM", 1), ("SIGKILL", 2), ("SIGKILL", 3)])
def test_signal_then_resume_is_bit_identical(setup: tuple[Path, Path], uninterrupted: Trainer, tmp_path: Path,
                                             how: str, seed: int):
    step, data = setup
    ckpt = tmp_path / "run.npz"
    proc = _train(step, data, TOTAL, ckpt, "--checkpoint-every", "100")
    # The signal goes once the run is past a seeded step (its history gains a line per step at
    # every checkpoint), then a seeded fraction of a checkpoint interval later. A fixed delay
    # after the first checkpoint (0.05 to 0.4 s) let a quiet machine finish all 4000 steps
    # first: the signal then came during the final save, and the run held no steps to resume.
    draw = random.Random(seed)
    target, lag = draw.randrange(200, TOTAL // 2), draw.uniform(0.0, 0.01)
    history = metrics_path(ckpt)
    deadline = time.monotonic() + 120
    while (history.read_bytes().count(b"\n") if history.exists() else 0) < target:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(lag)
    proc.send_signal(getattr(signal, how))
    out, err = proc.communicate(timeout=120)
    expected = {"SIGINT": 130, "SIGTERM": 143, "SIGKILL": -9}[how]
    if proc.returncode == 0:
        pytest.skip(f"the run finished before {how} arrived (machine faster than the seeded delay)")
    assert proc.returncode == expected, err
    assert "Traceback" not in err
    if how != "SIGKILL":
        assert f"stopped by {how} after step" in err and f"--resume {ckpt}" in err
    with np.load(ckpt) as z:
        done = json.loads(z["__meta__"].tobytes())["steps"]
    assert 0 < done < TOTAL
    resume = _train_here(step, data, TOTAL - done, ckpt, "--resume", str(ckpt))
    assert resume.returncode == 0, resume.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # kill -9's temporaries are gone
    final = Trainer(step, threads=1)
    final.load_checkpoint(ckpt)
    _same(uninterrupted, final)


# -- resuming continues the checkpoint's data stream ----------------------------------------------


def test_resume_without_seed_and_batch_continues_the_checkpoint_stream(setup: tuple[Path, Path], tmp_path: Path):
    """A resume without --seed/--batch once took the defaults (0, 64): another data stream, 6 of
    9 state arrays different from the uninterrupted run, exit 0 and no message."""
    from typer.testing import CliRunner

    from mpgraph.cli.main import app
    from mpgraph.errors import CheckpointError

    step, data = setup
    ckpt, straight = tmp_path / "c.npz", tmp_path / "s.npz"
    common = ["train", str(step), "--data", str(data), "-q", "--no-eval", "--threads", "1"]
    runner = CliRunner()
    first = runner.invoke(app, [*common, "--steps", "7", "--seed", "4", "--batch", "16", "--checkpoint", str(ckpt)])
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, [*common, "--steps", "5", "--resume", str(ckpt), "--checkpoint", str(ckpt)])
    assert resumed.exit_code == 0, resumed.output
    assert "note: resuming with the checkpoint's --batch 16 and --seed 4" in resumed.output
    whole = runner.invoke(app, [*common, "--steps", "12", "--seed", "4", "--batch", "16", "--checkpoint", str(straight)])
    assert whole.exit_code == 0, whole.output
    a, b = Trainer(step, threads=1), Trainer(step, threads=1)
    a.load_checkpoint(ckpt)
    b.load_checkpoint(straight)
    _same(a, b)
    # The library says what differs too.
    other = Trainer(step, threads=1)
    other.load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"seed 5 \(the checkpoint's run used 4\)"):
        other.fit(_arrays(data), 1, seed=5)
