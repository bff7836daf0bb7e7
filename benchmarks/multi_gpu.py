"""Data-parallel training on N GPUs: mpgraph (NCCL) against torch DDP + AMP bf16, side by side.

One command. The parent builds the step graph once (the bench GPT of ``gpu_step.py``, or with
``--model gpt2`` transformers' GPT-2 small from its config as ``real_models.py`` builds it;
same seeded weights on both sides), then runs world size 1 and world size N, each as N
processes started with ``torch.multiprocessing.spawn`` (NCCL on ``cuda:<rank>``; ``--cpu``:
gloo on the CPU, the tiny GPT, float32). In every world each rank runs, in the same processes:

1. **the loss check**: ``--check-steps`` steps on fixed global batches of ``--batch`` x N
   samples. On N ranks each takes one slice of ``--batch``; on one GPU the same global batch
   runs as N micro-batches (mpgraph ``micro_batches=N``; torch: gradient accumulation). So the
   N-GPU losses should match the 1-GPU losses within the stack's own run-to-run noise
   (bf16, non-deterministic kernels: not bit for bit).
2. **the timing**: each rank steps on ``--batch`` samples (weak scaling: global batch
   ``--batch`` x world), mpgraph and torch DDP taking turns round by round; round 0 is a
   warm-up; ms/step is the median over rounds of rank 0's mean step time. Every step reads
   its loss back to the host, as ``gpu_step.py``'s rows do.

It prints ms/step, samples/s, the scaling efficiency (per-sample throughput on N GPUs over
N times one GPU's, i.e. t(1 GPU) / t(N GPUs)), mpgraph's time over DDP's, and the loss after
the check steps on N GPUs against one GPU with the same global batch.

    python3 benchmarks/multi_gpu.py --gpus 2 --out DIR                 # bench GPT, bf16
    python3 benchmarks/multi_gpu.py --gpus 8 --model gpt2 --out DIR    # GPT-2 small
    python3 benchmarks/multi_gpu.py --gpus 1                           # one GPU: world size 1 only
    .venv/bin/python benchmarks/multi_gpu.py --cpu --gpus 2            # gloo dry run (tiny GPT)

On the GPU machine ORT must be onnxruntime-gpu (``source .ortgpu/stage.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Config:
    """What every rank of every world needs (picklable: the spawned processes get it)."""

    model: str
    cpu: bool
    gpus: int
    batch: int  # per GPU
    graph: str  # the mpgraph step graph file
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    steps: int
    rounds: int
    check_steps: int
    reduction: str
    out: str


# -- the model, the same in every process ----------------------------------------------


def build_module(cfg: Config) -> tuple[torch.nn.Module, int, int]:
    """The seeded torch module, its vocabulary and sequence length."""
    if cfg.model == "gpt":
        import gpu_step

        spec = gpu_step.gpt_spec(small=cfg.cpu)
        return spec.module, spec.module.tok.weight.shape[0], spec.inputs[0].shape[1]
    import real_models

    case = real_models.build_case("gpt2", cfg.cpu)
    return case.module, case.module.config.vocab_size, case.batches[0]["input_ids"].shape[1]


def global_batches(cfg: Config, vocab: int, seq: int, count: int, size: int) -> list[dict[str, np.ndarray]]:
    """Seeded token batches (inputs and labels) of ``size`` rows."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, vocab, (size, seq), dtype=np.int64)
        labels = tokens if cfg.model == "gpt2" else rng.integers(0, vocab, (size, seq), dtype=np.int64)
        out.append({"tokens": tokens, "labels": labels})
    return out


def torch_loss(cfg: Config, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if cfg.model == "gpt2":
        return model(input_ids=batch["tokens"], labels=batch["labels"]).loss
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))


def prepare_graph(cfg: Config) -> str:
    """The AdamW step graph (bf16 on CUDA, float32 on ``--cpu``), saved once for every rank."""
    from mpgraph.io import save_model
    from mpgraph.training import MAX_IR_VERSION

    policy = "fp32" if cfg.cpu else "bf16"
    target = None if cfg.cpu else "cuda"
    if cfg.model == "gpt":
        import gpu_step

        graph = gpu_step.step_graphs(gpu_step.gpt_spec(small=cfg.cpu), False, [policy], target=target)[policy]
        graph.ir_version = min(graph.ir_version, MAX_IR_VERSION)  # onnxruntime-gpu 1.31 loads <= 13
        save_model(graph, cfg.graph)
        return cfg.graph
    import real_models

    job = real_models.PrepJob("gpt2", "torchscript", cfg.cpu, 0, (policy,), emulate=cfg.cpu, target=target,
                              workdir=os.path.dirname(cfg.graph))
    built = real_models.prepare(job)
    if policy not in built["graphs"]:
        raise SystemExit(f"could not build the GPT-2 step graph: {built['errors']}")
    return built["graphs"][policy]


# -- one rank ----------------------------------------------------------------------------


class MpgraphSide:
    """mpgraph's data-parallel runner on this rank; ``step`` takes this rank's share."""

    label = "mpgraph"

    def __init__(self, cfg: Config, graph: str, micro: int) -> None:
        from mpgraph.io import load_model
        from mpgraph.runtime.data_parallel import DataParallelOptions, DataParallelRunner
        from mpgraph.runtime.options import RunOptions

        run = RunOptions(provider="cpu", threads=1) if cfg.cpu else RunOptions(provider="cuda")
        options = DataParallelOptions(micro_batches=micro, reduction=cfg.reduction, threads=run.threads)
        self.runner = DataParallelRunner(load_model(graph), options=options, run_options=run)
        names = [s.name for s in self.runner.program.data_inputs]
        self.data = next(n for n in names if n not in ("label", "labels"))
        self.label_name = next(n for n in names if n != self.data)

    def step(self, share: dict[str, np.ndarray]) -> float:
        """The loss over the global batch (the runner reduces it with the gradients)."""
        return self.runner.step({self.data: share["tokens"], self.label_name: share["labels"]}).loss


class TrainerSide:
    """The one-process ``Trainer`` on the same step graph (world size 1 only): what the
    data-parallel executor's two sessions cost against one session (and, on CUDA, against
    one captured CUDA graph)."""

    def __init__(self, cfg: Config, graph: str, cuda_graph: bool | None) -> None:
        from mpgraph.runtime.trainer import Trainer

        self.trainer = (Trainer(graph, "cpu", threads=1) if cfg.cpu
                        else Trainer(graph, "cuda", cuda_graph=cuda_graph, pipeline=False))
        names = [s.name for s in self.trainer.data_inputs]
        self.data = next(n for n in names if n not in ("label", "labels"))
        self.label_name = next(n for n in names if n != self.data)

    def step(self, share: dict[str, np.ndarray]) -> float:
        return self.trainer.step({self.data: share["tokens"], self.label_name: share["labels"]}).loss


class TorchSide:
    """torch DDP (+ AMP bf16 on CUDA) on this rank; ``step`` takes this rank's share."""

    label = "torch DDP"

    def __init__(self, cfg: Config, module: torch.nn.Module, device: torch.device, micro: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.cfg, self.device, self.micro = cfg, device, micro
        module = module.to(device).train()
        self.model = DistributedDataParallel(module, device_ids=None if cfg.cpu else [device.index])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay, foreach=not cfg.cpu)

    def step(self, share: dict[str, np.ndarray], global_loss: bool = False) -> float:
        """One optimizer step over ``micro`` slices (gradient accumulation); the loss of this
        rank's share, or with ``global_loss`` the mean over every rank (one more collective)."""
        self.opt.zero_grad(set_to_none=True)
        rows = len(share["tokens"]) // self.micro
        total = torch.zeros((), device=self.device)
        for k in range(self.micro):
            part = {n: torch.from_numpy(a[k * rows:(k + 1) * rows]).to(self.device) for n, a in share.items()}
            sync = self.model.no_sync() if k < self.micro - 1 else contextlib.nullcontext()
            with sync, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=not self.cfg.cpu):
                loss = torch_loss(self.cfg, self.model, part) / self.micro
            loss.backward()
            total += loss.detach().float()
        self.opt.step()
        if global_loss:
            dist.all_reduce(total)
            total /= dist.get_world_size()
        return float(total.item())


def _share(batch: dict[str, np.ndarray], rank: int, world: int) -> dict[str, np.ndarray]:
    rows = len(batch["tokens"]) // world
    return {n: a[rank * rows:(rank + 1) * rows] for n, a in batch.items()}


def _sync(cfg: Config) -> None:
    if not cfg.cpu:
        torch.cuda.synchronize()


def _time_round(cfg: Config, side: Any, shares: list[dict[str, np.ndarray]]) -> float:
    """Mean ms/step of ``cfg.steps`` steps, every rank starting together."""
    dist.barrier()
    _sync(cfg)
    start = time.perf_counter()
    for i in range(cfg.steps):
        side.step(shares[i % len(shares)])
    _sync(cfg)
    return (time.perf_counter() - start) * 1e3 / cfg.steps


def rank_main(rank: int, world: int, cfg: Config, port: int) -> None:
    """One rank of one world: the loss check, then the timed rounds; rank 0 writes the result."""
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; the mpgraph executor reads it
    if cfg.cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group("gloo" if cfg.cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = run_world(rank, world, cfg, device)
        if rank == 0:
            with open(os.path.join(cfg.out, f"world{world}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(rank: int, world: int, cfg: Config, device: torch.device) -> dict[str, Any]:
    module, vocab, seq = build_module(cfg)
    checks = global_batches(cfg, vocab, seq, cfg.check_steps, cfg.batch * cfg.gpus)
    micro = cfg.gpus // world  # the check's global batch: N slices of --batch, however spread
    result: dict[str, Any] = {"world": world, "device": torch.cuda.get_device_name(device) if not cfg.cpu else "cpu"}
    # The loss check: fresh runners from the same weights, one after the other.
    mp_side = MpgraphSide(cfg, cfg.graph, micro)
    result["mpgraph_losses"] = [mp_side.step(_share(b, rank, world)) for b in checks]
    th_side = TorchSide(cfg, _copy(module), device, micro)
    result["torch_losses"] = [th_side.step(_share(b, rank, world), global_loss=True) for b in checks]
    if micro != 1:  # the timing steps one slice of --batch a rank
        del mp_side, th_side
        _free(cfg)
        mp_side = MpgraphSide(cfg, cfg.graph, 1)
        th_side = TorchSide(cfg, _copy(module), device, 1)
    shares = [_share(b, rank, world) for b in global_batches(cfg, vocab, seq, 4, cfg.batch * world)]
    sides: dict[str, Any] = {"mpgraph": mp_side, "torch": th_side}
    if world == 1:  # the one-process Trainer beside them: what the split step costs
        sides["trainer"] = TrainerSide(cfg, cfg.graph, False)
        if not cfg.cpu:
            sides["trainer_graph"] = TrainerSide(cfg, cfg.graph, None)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(cfg.rounds + 1):
        for name, side in sides.items():
            ms = _time_round(cfg, side, shares)
            if r:
                times[name].append(ms)
    result["ms"] = {k: statistics.median(v) for k, v in times.items()}
    result["round_ms"] = times
    if not cfg.cpu:
        result["max_memory_mib_torch"] = torch.cuda.max_memory_allocated(device) / 2**20
    return result


def _copy(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module)


def _free(cfg: Config) -> None:
    import gc

    gc.collect()
    if not cfg.cpu:
        torch.cuda.empty_cache()


# -- the parent --------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(cfg: Config, results: dict[int, dict[str, Any]]) -> str:
    """The table: one row per stack and world size."""
    worlds = sorted(results)
    one = results[worlds[0]]
    k = cfg.check_steps
    lines = [f"model {cfg.model}{' (tiny, --cpu)' if cfg.cpu else ''}, per-GPU batch {cfg.batch}, "
             f"{'float32 on CPU (gloo)' if cfg.cpu else 'bf16 (NCCL)'}, reduction {cfg.reduction}, "
             f"device {one['device']}, {cfg.rounds} rounds x {cfg.steps} steps",
             f"{'stack':<40}{'GPUs':>5}{'global batch':>14}{'ms/step':>10}{'samples/s':>11}{'scaling':>9}"
             f"{'vs DDP':>8}{f'loss@{k}':>12}{f'1-GPU loss@{k}':>15}{'max |dloss|':>13}"]
    for stack, label in (("mpgraph", "mpgraph data-parallel"), ("torch", "torch DDP + AMP bf16" if not cfg.cpu
                                                                      else "torch DDP fp32")):
        for world in worlds:
            got = results[world]
            ms = got["ms"][stack]
            scaling = f"{one['ms'][stack] / ms:>8.1%}" if world != worlds[0] else f"{'-':>8}"
            ratio = ms / got["ms"]["torch"]
            losses, ref = got[f"{stack}_losses"], one[f"{stack}_losses"]
            if world != worlds[0]:
                diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
                check = f"{losses[-1]:>12.5f}{ref[-1]:>15.5f}{diff:>13.2e}"
            else:
                check = f"{losses[-1]:>12.5f}{'(this row)':>15}{'-':>13}"
            lines.append(f"{label:<40}{world:>5}{cfg.batch * world:>14}{ms:>10.2f}{cfg.batch * world * 1e3 / ms:>11.1f}"
                         f" {scaling}{ratio:>8.2f}{check}")
    for name, label in (("trainer", "mpgraph Trainer, 1 process" + ("" if cfg.cpu else ", no CUDA graph")),
                        ("trainer_graph", "mpgraph Trainer, 1 process, CUDA graph")):
        if name in one["ms"]:
            ms = one["ms"][name]
            lines.append(f"{label:<40}{worlds[0]:>5}{cfg.batch:>14}{ms:>10.2f}{cfg.batch * 1e3 / ms:>11.1f}"
                         f" {'-':>8}{ms / one['ms']['torch']:>8.2f}")
    lines.append("scaling: per-sample throughput on N GPUs over N x one GPU's (t1/tN). Trainer rows: the "
                 "one-process trainer on the same step graph and batches (no data-parallel split). loss@k: mean loss of "
                 f"step {k} on the check's global batch of {cfg.batch * cfg.gpus}; 1-GPU: the same batches as "
                 f"{cfg.gpus} micro-batches on one GPU.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU; --cpu: 2)")
    p.add_argument("--model", choices=["gpt", "gpt2"], default="gpt")
    p.add_argument("--batch", type=int, default=None, help="per-GPU batch (default 8; --cpu 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed round (default 10; --cpu 3)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 5; --cpu 2)")
    p.add_argument("--check-steps", type=int, default=None, help="loss-check steps (default 20; --cpu 3)")
    p.add_argument("--reduction", choices=["all_reduce", "ordered"], default="all_reduce",
                   help="mpgraph's bucket reduction (all_reduce: one NCCL all-reduce a bucket, as DDP)")
    p.add_argument("--cpu", action="store_true", help="dry run: gloo processes on the CPU, tiny model, float32")
    p.add_argument("--out", default=None, help="folder for the step graph and the JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    small = args.cpu
    gpus = args.gpus or (2 if args.cpu else torch.cuda.device_count())
    if not args.cpu and not 1 <= gpus <= torch.cuda.device_count():
        raise SystemExit(f"--gpus {gpus}: {torch.cuda.device_count()} GPU(s) visible (use --cpu for a gloo dry run)")
    out = args.out or tempfile.mkdtemp(prefix="multi_gpu_")
    os.makedirs(out, exist_ok=True)
    if args.model == "gpt":
        hyper = (3e-4, (0.9, 0.999), 1e-8, 0.01)  # gpu_step.py's
    else:
        import real_models

        hyper = (real_models.LR, real_models.BETAS, real_models.EPS, real_models.WEIGHT_DECAY)
    cfg = Config(args.model, args.cpu, gpus, args.batch or (2 if small else 8), os.path.join(out, f"{args.model}.onnx"),
                 *hyper, steps=args.steps or (3 if small else 10), rounds=args.rounds or (2 if small else 5),
                 check_steps=args.check_steps or (3 if small else 20), reduction=args.reduction, out=out)
    start = time.perf_counter()
    cfg = dataclasses.replace(cfg, graph=prepare_graph(cfg))
    print(f"step graph built in {time.perf_counter() - start:.1f} s: {cfg.graph}", flush=True)
    results = {}
    for world in sorted({1, gpus}):
        start = time.perf_counter()
        mp.spawn(rank_main, args=(world, cfg, _port()), nprocs=world, join=True)
        with open(os.path.join(out, f"world{world}.json")) as f:
            results[world] = json.load(f)
        print(f"world size {world}: {time.perf_counter() - start:.1f} s", flush=True)
    text = report(cfg, results)
    print(text)
    with open(os.path.join(out, "multi_gpu.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "results": results, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
