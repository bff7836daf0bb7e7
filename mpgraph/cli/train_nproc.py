"""``mpgraph train --nproc N``: data-parallel training on N processes, launched through torchrun.

``launch`` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
mpgraph.cli.train_nproc STEP ...``; every rank (this module's ``main``) joins the group torchrun
set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` in its environment) and trains with
``runtime.data_parallel.train_data_parallel``. Rank 0 prints the loss lines and writes the
checkpoint; an error is one ``error:`` line from the rank that met it, exit code 2.

With ``--provider cuda`` the ranks form an NCCL group and rank r trains on ``cuda:<LOCAL_RANK>``
(``runtime.parallel_executor``); a machine that cannot (no GPU, fewer GPUs than ranks, no
onnxruntime-gpu) gets one ``error:`` line before any group is formed.

``mpgraph train --nproc N`` calls ``train_with_nproc``, which refuses the one-process run's
flags a data-parallel run does not take yet (``--metrics``, ``--plot``);
``python -m mpgraph.cli.train_nproc --nproc N STEP ...`` launches the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

__all__ = ["launch", "launch_command", "main", "train_with_nproc"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpgraph train --nproc N", description=__doc__.splitlines()[0])
    p.add_argument("step", help="training step graph (.onnx)")
    p.add_argument("--data", required=True, help="digits, sequence, or an .npz")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64, help="global batch (divisible by N x --micro-batches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1: optimizer state split over the ranks")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--reduction", default="ordered", choices=["ordered", "all_reduce"])
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads per rank")
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL, a GPU a rank)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip", "ignore"],
                   help="NaN/inf in a batch or the loss (the one-process loop's rules)")
    return p


def launch_command(nproc: int, args: list[str]) -> list[str]:
    """The torchrun command line for ``nproc`` ranks of ``mpgraph.cli.train_nproc ARGS``.

    Example:
        >>> launch_command(2, ["net.onnx", "--data", "digits"])[1:7]
        ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2', '-m']
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "mpgraph.cli.train_nproc", *args]


def launch(nproc: int, args: list[str]) -> int:
    """Run ``nproc`` ranks through torchrun; 0, or 2 after one ``error:`` line from the first
    rank that failed (torchrun's own report of the failure is left out), or torchrun's code.

    Raises:
        UsageError: ``nproc`` below 1, a bad flag, or a batch the ranks cannot split evenly
            (refused here, before N processes start).
    """
    from mpgraph.errors import UsageError

    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    parsed = _parser().parse_args(args)
    if parsed.batch % (nproc * parsed.micro_batches):
        raise UsageError(f"--batch {parsed.batch} must be divisible by --nproc {nproc} x --micro-batches "
                         f"{parsed.micro_batches}: it is the global batch, split evenly over the ranks")
    ran = subprocess.run(launch_command(nproc, args), stderr=subprocess.PIPE, text=True, check=False)
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error: rank ")]
    if ran.returncode and errors:
        print(errors[0], file=sys.stderr)
        return 2
    sys.stderr.write(ran.stderr)
    return ran.returncode


def train_with_nproc(nproc: int, step: os.PathLike[str], *, data: str, steps: int, lr: float | None, batch: int | None,
                     seed: int | None, threads: int | None, checkpoint: os.PathLike[str] | None, checkpoint_every: int,
                     resume: os.PathLike[str] | None, unsupported: dict[str, bool], shard_optimizer: bool = False,
                     on_nonfinite: str = "stop", provider: str = "cpu") -> int:
    """``mpgraph train --nproc N``: the flags a data-parallel run takes, as a torchrun launch.

    Raises:
        UsageError: ``unsupported`` names a flag that was given (``True``): the one-process
            run's flags that a data-parallel run does not take yet.
    """
    from mpgraph.errors import UsageError

    if shard_optimizer and nproc == 1:
        raise UsageError("--shard-optimizer: only with --nproc N (N processes share the optimizer state)")
    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise UsageError(f"{', '.join(given)}: not with --nproc yet (a data-parallel run takes --data, "
                         f"--steps, --lr, --batch, --seed, --threads, --checkpoint, --checkpoint-every, --resume, --shard-optimizer, "
                         f"--on-nonfinite, --provider)")
    args = [os.fspath(step), "--data", data, "--steps", str(steps), "--batch", str(64 if batch is None else batch),
            "--seed", str(seed or 0), "--checkpoint-every", str(checkpoint_every)]
    for flag, value in (("--lr", lr), ("--threads", threads), ("--checkpoint", checkpoint), ("--resume", resume),
                        ("--on-nonfinite", None if on_nonfinite == "stop" else on_nonfinite)):
        if value is not None:
            args += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    if provider != "cpu":
        args += ["--provider", provider]
    return launch(nproc, args + (["--shard-optimizer"] if shard_optimizer else []))


def main(argv: list[str] | None = None) -> int:
    """One rank: join torchrun's group, train, report on rank 0."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--nproc"]:
        return launch(int(argv[1]), argv[2:])
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    from mpgraph.errors import MpgraphError
    from mpgraph.io import load_model
    from mpgraph.runtime.data_parallel import DataParallelOptions, backend_for, train_data_parallel
    from mpgraph.runtime.options import RunOptions
    from mpgraph.runtime.rank_device import place_rank

    try:  # before the group: NCCL where no GPU can run it fails inside torch, less clearly
        place_rank(args.provider, 0, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    except MpgraphError as e:
        print(f"error: rank {os.environ.get('RANK', 0)}: {e}", file=sys.stderr, flush=True)
        return 2
    dist.init_process_group(backend_for(args.provider))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        options = DataParallelOptions(shard_optimizer=args.shard_optimizer, micro_batches=args.micro_batches,
                                      reduction=args.reduction, threads=args.threads)

        def report(step: int, result) -> None:  # noqa: ANN001
            if rank == 0 and (step % max(args.log_every, 1) == 0 or step == args.steps):
                why = " (skipped: overflow)" if math.isfinite(result.loss) else " (skipped: non-finite)"
                print(f"step {step}: loss {result.loss:.6f}{why if result.skipped else ''}", flush=True)

        train_data_parallel(load_model(args.step), args.data, steps=args.steps, batch_size=args.batch, seed=args.seed,
                            lr=args.lr, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                            resume=args.resume, options=options, report=report, on_nonfinite=args.on_nonfinite,
                            run_options=RunOptions(provider=args.provider, threads=args.threads))
    except MpgraphError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"trained {args.steps} steps on {world} processes"
              f"{'; checkpoint ' + args.checkpoint if args.checkpoint else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
