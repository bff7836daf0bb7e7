"""Training-step speed on one GPU: mpgraph on ORT CUDA against PyTorch, side by side, one process.

Builds each model once in torch (seeded), exports it with ``mpgraph.export.export_module`` (so
both sides start from the same weights), builds the AdamW step graph with ``train-graph`` and
the ``fp32``/``tf32``/``bf16``/``fp16`` conversions, then times every configuration in
alternating rounds on the same batches:

- mpgraph through ``Trainer`` as a user gets it (``fp32`` is strict: ``use_tf32=0``; CUDA
  graphs on where ORT can capture; where the trainer pipelines, as ``fit`` runs it:
  ``step_many`` over each round's batches, the host enqueueing step k+1 before it reads step
  k's loss);
- torch eager fp32 (TF32 off), tf32, AMP bf16, AMP fp16 + GradScaler, ``torch.compile`` +
  AMP bf16, and for the small nets the whole step (forward, backward, Adam with
  ``capturable=True``) captured once as a CUDA graph and replayed;
- for the small nets, both stacks on the CPU at 2 threads;
- the other stepping mode: for the small nets (pipelined by default) mpgraph fp32's
  synchronous step (``Trainer(pipeline=False).step``, the host waiting for each step); for
  the GPT (synchronous by default: its state is over ``PIPELINE_MAX_STATE_MIB``) bf16
  pipelined.

Every step of every configuration reads its loss back to the host (what a training loop that
logs the loss does); the pipelined mpgraph rows read each one a step late. It prints ms/step (median over rounds after a warm-up round), the ratio to
the named torch twin, model FLOP/s as a share of the measured bf16 matmul peak (GPT only),
device memory, the loss after ``--check-step`` steps against the twin, and a kernel breakdown
(count and time per class, from torch's CUPTI profiler around ORT's runs).

    python3 benchmarks/gpu_step.py --out DIR                      # the H200 run
    python3 benchmarks/gpu_step.py --out DIR --cpu-only --small   # a dry run on a laptop

On the GPU machine ORT must be onnxruntime-gpu (``source .ortgpu/stage.sh``).

Neither side's CUDA step gives the same bits twice by default (atomic reductions, cuDNN's
timed algorithm choice; ``benchmarks/repeat_probe.py``), so the loss after N steps also carries
run-to-run noise: on the Nature DQN in bf16 two mpgraph runs ended 0.5-1.2% apart. With
``--deterministic`` both sides run bit-reproducibly (the 2026-12-01T23 runs on the H200:
``benchmarks/results/gpu_step_2026-12-01T23_deterministic_*.log``; the GPT's bf16 step 1.38x slower).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step_targets  # noqa: E402
from step_timing import Run, create_run, kernel_breakdown, timed_rounds  # noqa: E402

import mpgraph  # noqa: E402
from models.zoo import GPT, NatureDQN, TinyMLP  # noqa: E402
from mpgraph.export import export_module  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

#: bf16 dense matmul rate measured on the H200 with torch (DESIGN.md: 8192^3 MatMul).
BF16_PEAK_TFLOPS = 796.0


@dataclass
class ModelSpec:
    name: str
    module: torch.nn.Module
    batch: int
    inputs: list[np.ndarray]  # cycled batches of the data input
    labels: list[np.ndarray]
    loss: str
    lr: float
    flops_per_step: float | None = None
    small: bool = True


def gpt_spec(small: bool) -> ModelSpec:
    if small:
        vocab, seq, d, heads, layers, batch = 256, 64, 64, 4, 2, 4
    else:
        vocab, seq, d, heads, layers, batch = 8192, 512, 1024, 16, 8, 8
    torch.manual_seed(0)
    module = GPT(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=layers).train()
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, vocab, (batch, seq), dtype=np.int64) for _ in range(4)]
    ys = [rng.integers(0, vocab, (batch, seq), dtype=np.int64) for _ in range(4)]
    n_params = sum(p.numel() for n, p in module.named_parameters() if n not in ("tok.weight", "pos"))
    tokens = batch * seq
    # 6 FLOP per matmul weight per token (forward 2, backward 4) plus attention's two
    # T x T x d products per layer (forward 4*T^2*d, times 3 with backward); no causal saving.
    flops = 6.0 * n_params * tokens + 12.0 * layers * batch * seq * seq * d
    return ModelSpec("gpt", module, batch, xs, ys, "cross_entropy", 3e-4, flops, small=small)


def tiny_spec() -> ModelSpec:
    torch.manual_seed(0)
    module = TinyMLP().train()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((64, 4)).astype(np.float32) for _ in range(4)]
    ys = [rng.integers(0, 2, (64,), dtype=np.int64) for _ in range(4)]
    return ModelSpec("tiny_mlp", module, 64, xs, ys, "cross_entropy", 1e-3)


def dqn_spec(teacher: bool = False) -> ModelSpec:
    """The Nature DQN regressing onto random targets, or with ``teacher`` onto a fixed second
    DQN's outputs (a function it can learn). Memorising four batches of random targets is
    chaotic: two float32 summation orders end 50 steps 3.3e-3 apart on ORT CPU, against 5.3e-5
    with the teacher's targets (846d9a9), so only the teacher's loss can say 1%."""
    torch.manual_seed(0)
    module = NatureDQN().train()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((32, 4, 84, 84)).astype(np.float32) for _ in range(4)]
    ys = [rng.standard_normal((32, 18)).astype(np.float32) * 0.1 for _ in range(4)]
    if teacher:
        torch.manual_seed(1)
        net = NatureDQN().eval()
        with torch.no_grad():
            ys = [net(torch.from_numpy(x)).numpy().astype(np.float32) for x in xs]
    return ModelSpec("dqn_cnn_teacher" if teacher else "dqn_cnn", module, 32, xs, ys, "mse", 1e-4)


# -- mpgraph side ------------------------------------------------------------------------


def step_graphs(spec: ModelSpec, flat: bool, policies: list[str], target: str | None = None) -> dict[str, Any]:
    example = torch.from_numpy(spec.inputs[0][:2])
    proto = export_module(copy.deepcopy(spec.module), example, loss=spec.loss)
    options = {"weight_decay": 0.01}
    if flat:
        options["flat"] = True
    step = build_training_graph(proto, optimizer="adamw", lr=spec.lr, optimizer_options=options, target=target)
    out = {}
    for policy in policies:
        fresh = ir.from_proto(ir.to_proto(step))
        # calibrate=None: the fp16 range check runs the step graph on ORT CPU (minutes at this
        # size); the GPT's activations are far inside fp16's range, and these rows measure speed.
        out[policy] = fresh if policy == "fp32" else mpgraph.convert(fresh, policy, emulate=False, validate=False, calibrate=None)
    return out


def mpgraph_run(label: str, graph: Any, spec: ModelSpec, provider: str, twin: str | None, **kw: Any) -> Run:
    trainer = Trainer(graph, provider, **kw)
    names = [s.name for s in trainer.data_inputs]
    data_name = next(n for n in names if n != "label")

    def batch(i: int) -> dict[str, np.ndarray]:
        k = i % len(spec.inputs)
        return {data_name: spec.inputs[k], "label": spec.labels[k]}

    def step(i: int) -> float:
        return trainer.step(batch(i)).loss

    def steps(i: int, n: int) -> list[float]:
        return [r.loss for r in trainer.step_many([batch(j) for j in range(i, i + n)])]

    return Run(label, step, twin, device=provider, trainer=trainer, steps=steps if trainer.pipeline else None)


# -- torch side --------------------------------------------------------------------------


def torch_loss(spec: ModelSpec, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    if spec.loss == "cross_entropy":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), label.reshape(-1))
    return F.mse_loss(logits.float(), label)


def torch_run(label: str, spec: ModelSpec, device: str, *, amp: torch.dtype | None = None,
              tf32: bool = False, compile_: bool = False, scaler: bool = False) -> Run:
    module = copy.deepcopy(spec.module).to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=spec.lr, weight_decay=0.01,
                            foreach=device == "cuda")
    forward = torch.compile(module) if compile_ else module
    grad_scaler = torch.amp.GradScaler("cuda") if scaler else None

    def step(i: int) -> float:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        k = i % len(spec.inputs)
        x = torch.from_numpy(spec.inputs[k]).to(device)
        y = torch.from_numpy(spec.labels[k]).to(device)
        opt.zero_grad(set_to_none=True)
        if amp is not None:
            with torch.autocast(device, dtype=amp):
                loss = torch_loss(spec, forward(x), y)
        else:
            loss = torch_loss(spec, forward(x), y)
        if grad_scaler is not None:
            grad_scaler.scale(loss).backward()
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            loss.backward()
            opt.step()
        return float(loss.item())

    return Run(label, step, device=device)


#: Set once a torch CUDA graph is captured: from then on, for that model, ``torch.cuda.empty_cache()``
#: is not called. It freed memory the captured DQN step still used (an illegal memory access in
#: a probe; fixed at d14b4c6). In this script's runs from 2026-12-01T14 to 2026-12-01T23 the
#: captured DQN's loss@50 read NaN or 3.5x eager's, while standalone it matches eager within 0.2%.
_TORCH_GRAPHS: list[Any] = []


def torch_graph_run(label: str, spec: ModelSpec) -> Run:
    """The whole step captured once as a CUDA graph (static input buffers), then replayed.
    Captured at its first step (in the warm-up round, after the other torch rows' caches were
    emptied), so that no ``empty_cache`` runs after the capture."""
    module = copy.deepcopy(spec.module).cuda()
    opt = torch.optim.AdamW(module.parameters(), lr=spec.lr, weight_decay=0.01, capturable=True)
    sx = torch.from_numpy(spec.inputs[0]).cuda()
    sy = torch.from_numpy(spec.labels[0]).cuda()

    def body() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = torch_loss(spec, module(sx), sy)
        loss.backward()
        opt.step()
        return loss

    warm: list[float] = []
    captured: dict[str, Any] = {}

    def capture() -> None:
        # Warm up on a side stream (as torch's CUDA graph docs require), then capture. The
        # warm-up steps are real steps: they count in the loss trajectory.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                sx.copy_(torch.from_numpy(spec.inputs[i % len(spec.inputs)]))
                sy.copy_(torch.from_numpy(spec.labels[i % len(spec.labels)]))
                warm.append(float(body().item()))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured["loss"] = body()
        captured["graph"] = graph
        _TORCH_GRAPHS.append(graph)

    def step(i: int) -> float:
        if not captured:
            capture()
        if i < len(warm):
            return warm[i]
        k = i % len(spec.inputs)
        sx.copy_(torch.from_numpy(spec.inputs[k]), non_blocking=False)
        sy.copy_(torch.from_numpy(spec.labels[k]), non_blocking=False)
        captured["graph"].replay()
        return float(captured["loss"].item())

    return Run(label, step, twin=None)


def run_model(spec: ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    cuda = not args.cpu_only and torch.cuda.is_available()
    _TORCH_GRAPHS.clear()  # the last model's graphs go with this reference and its runs: empty_cache is safe again
    runs: list[Run] = []
    t0 = time.perf_counter()
    policies = ["fp32", "tf32", "bf16", "fp16"] if cuda else ["fp32"]
    # GPU rows get the step built for ORT CUDA (its conv weight-gradient forms), the CPU rows
    # the default (CPU-measured) one.
    graphs = step_graphs(spec, args.flat, policies, target="cuda" if cuda else None)
    cpu_graph = step_graphs(spec, args.flat, ["fp32"])["fp32"] if cuda and spec.small else graphs["fp32"]
    build_s = time.perf_counter() - t0
    print(f"[{spec.name}] graphs built in {build_s:.1f}s", flush=True)

    def add(label: str, make: Callable[[], Run]) -> None:
        runs.append(create_run(label, make, cuda))

    if cuda:
        cg = None if args.cuda_graph else False
        for label, policy, twin in [("mpgraph fp32", "fp32", "torch fp32"), ("mpgraph tf32", "tf32", "torch tf32"),
                                    ("mpgraph bf16", "bf16", "torch amp bf16"), ("mpgraph fp16", "fp16", "torch amp fp16")]:
            # deterministic needs strict float32 matmuls: the tf32 row stays as it is.
            det = {"deterministic": True} if args.deterministic and policy != "tf32" else {}
            add(label, functools.partial(mpgraph_run, label, graphs[policy], spec, "cuda", twin, cuda_graph=cg, **det))
        for label, kw in [("torch fp32", {}), ("torch tf32", {"tf32": True}),
                          ("torch amp bf16", {"amp": torch.bfloat16}),
                          ("torch amp fp16", {"amp": torch.float16, "scaler": True})]:
            add(label, functools.partial(torch_run, label, spec, "cuda", **kw))
        if not args.no_compile:
            add("torch compile bf16", functools.partial(torch_run, "torch compile bf16", spec, "cuda",
                                                        amp=torch.bfloat16, compile_=True))
        if spec.small:
            add("torch cuda-graph step", functools.partial(torch_graph_run, "torch cuda-graph step", spec))
        # The other mode than the default: small nets are pipelined by default, so their extra
        # row is the synchronous step (the crossover); the GPT's state is over
        # PIPELINE_MAX_STATE_MIB, so its extra row is the pipelined step.
        policy, pipe = ("fp32", False) if spec.small else ("bf16", True)
        label = f"mpgraph {policy} {'pipelined' if pipe else 'sync'}"
        det = {"deterministic": True} if args.deterministic else {}
        add(label, functools.partial(mpgraph_run, label, graphs[policy], spec, "cuda",
                                     "torch fp32" if spec.small else "torch amp bf16", cuda_graph=cg, pipeline=pipe, **det))
    if spec.small or not cuda:
        add("mpgraph fp32 cpu2", functools.partial(mpgraph_run, "mpgraph fp32 cpu2", cpu_graph, spec, "cpu",
                                                   "torch fp32 cpu2", threads=2))
        add("torch fp32 cpu2", functools.partial(torch_run, "torch fp32 cpu2", spec, "cpu"))

    timed_rounds(runs, args.rounds, args.steps_per_round, cuda=cuda, keep_torch_cache=lambda: bool(_TORCH_GRAPHS),
                 on_round=lambda r: print(f"[{spec.name}] round {r} done", flush=True))

    for run in runs:
        trainer = run.trainer
        if trainer is not None and trainer.provider == "cuda":
            run.note = "cuda graph" if trainer.cuda_graph else f"no cuda graph: {trainer.cuda_graph_reason}"
    breakdown: dict[str, Any] = {}
    if cuda and not args.no_profile:
        for run in runs:
            if run.error or run.device != "cuda":
                continue
            if run.label.startswith("mpgraph") or run.label in ("torch amp bf16", "torch cuda-graph step"):
                try:
                    breakdown[run.label] = kernel_breakdown(run)
                except Exception as e:  # noqa: BLE001
                    breakdown[run.label] = {"error": str(e).splitlines()[0]}

    return summarize(spec, runs, breakdown, args)


def summarize(spec: ModelSpec, runs: list[Run], breakdown: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    by = {r.label: r for r in runs}
    rows = []
    check = args.check_step
    print(f"\n== {spec.name} (batch {spec.batch}) ==")
    print(f"{'config':24s} {'ms/step':>9s} {'spread':>13s} {'vs twin':>8s} {'MFU%':>6s} {'mem MiB':>8s} "
          f"{'loss@' + str(check):>10s} {'dloss':>9s}  note")
    for run in runs:
        med = statistics.median(run.round_ms[1:]) if len(run.round_ms) > 1 else float("nan")
        lo = min(run.round_ms[1:], default=float("nan"))
        hi = max(run.round_ms[1:], default=float("nan"))
        twin = by.get(run.twin or "")
        twin_med = statistics.median(twin.round_ms[1:]) if twin and len(twin.round_ms) > 1 else None
        ratio = med / twin_med if twin_med else None
        mfu = (spec.flops_per_step / (med / 1e3) / 1e12 / BF16_PEAK_TFLOPS * 100) if spec.flops_per_step and med == med else None
        loss = run.losses[check - 1] if len(run.losses) >= check else None
        tloss = twin.losses[check - 1] if twin and len(twin.losses) >= check else None
        dloss = abs(loss - tloss) / abs(tloss) if loss is not None and tloss else None
        row = {"config": run.label, "ms_per_step": med, "min": lo, "max": hi, "rounds_ms": run.round_ms,
               "twin": run.twin, "ratio_to_twin": ratio, "mfu_pct_of_bf16_peak": mfu,
               "memory_mib": run.memory_mib, f"loss_at_{check}": loss, "rel_loss_diff_to_twin": dloss,
               "note": run.note, "error": run.error, "losses": run.losses}
        rows.append(row)

        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None and v == v else "-"

        print(f"{run.label:24s} {f(med, '9.3f')} {f(lo, '6.2f')}-{f(hi, '6.2f')} {f(ratio, '8.2f')} {f(mfu, '6.1f')} "
              f"{f(run.memory_mib, '8.0f')} {f(loss, '10.5f')} {f(dloss, '9.2e')}  {run.note}{(' ERROR ' + run.error) if run.error else ''}")
    for label, b in breakdown.items():
        if "error" in b:
            print(f"  kernels {label}: {b['error']}")
            continue
        parts = ", ".join(f"{c} {v['kernels']:.0f}/{v['ms']:.2f}ms" for c, v in b["by_class"].items())
        print(f"  kernels {label}: {b['kernels_per_step']:.0f} per step, GPU {b['gpu_ms_per_step']:.2f} ms  [{parts}]")
    ratios = {}
    med = {r["config"]: r["ms_per_step"] for r in rows}
    for a, b in [("mpgraph bf16", "torch amp bf16"), ("mpgraph fp32", "mpgraph bf16"), ("mpgraph tf32", "mpgraph bf16"),
                 ("mpgraph fp16", "mpgraph bf16"), ("mpgraph bf16", "torch compile bf16"),
                 ("mpgraph bf16", "torch cuda-graph step"), ("mpgraph fp32", "torch cuda-graph step"),
                 ("mpgraph fp32 cpu2", "torch fp32 cpu2"), ("mpgraph fp32", "mpgraph fp32 cpu2"),
                 ("mpgraph fp32", "mpgraph fp32 sync"), ("mpgraph fp32 sync", "mpgraph fp32 cpu2"),
                 ("mpgraph fp32 sync", "torch cuda-graph step"),
                 ("mpgraph bf16 pipelined", "mpgraph bf16"), ("mpgraph bf16 pipelined", "torch amp bf16")]:
        if med.get(a) and med.get(b):
            ratios[f"{a} / {b}"] = med[a] / med[b]
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    return {"model": spec.name, "batch": spec.batch, "flops_per_step": spec.flops_per_step,
            "rows": rows, "ratios": ratios, "kernels": breakdown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="gpt,tiny_mlp,dqn_cnn", help="also dqn_cnn_teacher (learnable targets)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--check-step", type=int, default=50, help="compare losses after this many steps")
    p.add_argument("--small", action="store_true", help="a small GPT (dry runs)")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--flat", action="store_true", help="flat-buffer optimizer (optimizer_options flat=True)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible runs on both sides (Trainer(deterministic=True) except the tf32 row; "
                        "torch.use_deterministic_algorithms): the losses then differ by precision and summation "
                        "order, not by run-to-run noise")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.deterministic:  # before anything starts CUDA: cuBLAS reads it at its first handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    import onnxruntime as ort

    env = {"torch": torch.__version__, "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "args": vars(args)}
    print(json.dumps(env), flush=True)
    makers = {"gpt": lambda: gpt_spec(args.small), "tiny_mlp": tiny_spec, "dqn_cnn": dqn_spec,
              "dqn_cnn_teacher": functools.partial(dqn_spec, teacher=True)}
    results = {"env": env, "models": []}
    for name in args.models.split(","):
        results["models"].append(run_model(makers[name](), args))
        with open(os.path.join(args.out, "gpu_step.json"), "w") as f:
            json.dump(results, f, indent=1, default=float)
    print("\n" + step_targets.table(step_targets.verdicts(results)))


if __name__ == "__main__":
    main()
