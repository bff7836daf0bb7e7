"""fp8 against bf16 training steps on one GPU, side by side in one process (issue 29, H200 half).

Each model (the zoo ``GPT``, seeded, exported once so both sides start from the same weights)
becomes an AdamW step graph converted with ``bf16`` and with ``fp8`` (native: the ``fp8_gemm``
lowering puts its products on the kernel library's ``GemmFp8`` or on ``com.microsoft.GemmFloat8``,
see below). Both train on the same batches of a learnable next-token task (a fixed random Markov
chain, four likely successors per token), in alternating rounds; it prints ms/step (median over
the rounds after the first), the mean loss of the last 10 steps for both, their ratios, which op
the fp8 products ran on and how many, and whether each side ran as a CUDA graph.

First it probes ``GemmFloat8`` itself on 64x64 problems, in exactly the configurations the
lowering writes for these bf16 products (``fp8_gemm.gemm_dtype``: E4M3 x E4M3 into bf16,
E5M2 x E4M3 and E4M3 x E5M2 into float32, which the graph casts to bf16; cuBLASLt refused the
mixed pairs into bf16, ``benchmarks/results/gemm_float8_probe_2026-12-02.txt``), against
numpy; a configuration ORT's build refuses stops the run before any model is built. Every
model handed to ONNX Runtime has ir_version <= ``MAX_IR_VERSION`` (13; 1.31.1 refuses the 14
``onnx.helper.make_model`` writes): the probes are written with 10.

Models (``--models``):
- ``gemm``: d 2048, 2 layers, 16 heads, T 2048, batch 4, vocab 8192;
- ``d4096``: the issue's d 4096, 4 layers, 32 heads, T 2048, batch 4, vocab 8192: 0.87G
  parameters, whose float32 export (3.5 GB) ``export_module`` refused until it checked large
  models without their weights (``io.check_model_any_size``); its step graph, with both
  moments, is ~10 GB in memory; its two trainers (about 11 GB of state each) fit the H200
  together and alternate like ``gemm``'s. Not yet run;
- ``gpt2s``: GPT-2-small-sized: d 768, 12 layers, 12 heads, T 1024, vocab 50257, batch 8;
  its bf16 and fp8 trainers run one after the other (memory), so its speedup is indicative.

Where the kernel library has cuBLASLt (``plan.has_gemm_bias``), the fp8 products run on its
``GemmFp8`` (``fp8_gemm`` rule 6) and the fp8 trainer captures CUDA graphs like bf16's. Otherwise,
or with ``MPGRAPH_FP8_GEMM=ort``, they run on ONNX Runtime's ``GemmFloat8``, and the fp8 trainer
runs without CUDA graphs: 1.31.1's GemmFloat8 ``cudaMalloc``s and ``cudaFree``s a 32 MiB
workspace on every call (``gemm_float8.cu``; ``cudaFree`` waits for the device), which capture
refuses. bf16 runs as ``Trainer`` gives it (CUDA graphs on);
``--bf16-plain`` adds a third side, bf16 without CUDA graphs, which separates what the graphs
are worth from what fp8 costs. Each side's line says whether it ran as a CUDA graph and why
not. A trainer without CUDA graphs plans the step graph as it is given (only the capturing
session is specialised to the batch's shapes), so both step graphs are specialised to the
batch here first: the plain session then gets the static plan too (no shape arithmetic on the
CPU provider, the pointwise fusion of static shapes). ``--products`` picks the fp8 section's
``products``: ``linear`` (the default here: the weight products and their backward, as
Transformer Engine) or ``all`` (the ``fp8`` preset's: attention's batched products too, which
GemmFloat8 cannot run, so they stay quantise-dequantise chains on [B, H, T, T] tensors and the
attention backward is not fused). Nothing is written; the lead commits the log.

    source .ortgpu/stage.sh && python3 benchmarks/fp8_step.py --steps 200 --rounds 10
    source .ortgpu/stage.sh && python3 benchmarks/fp8_step.py --models gemm --steps 60 --rounds 6 --bf16-plain
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES = {  # vocab, seq, d, heads, layers, batch
    "gemm": (8192, 2048, 2048, 16, 2, 4),
    "gpt2s": (50257, 1024, 768, 12, 12, 8),
    "d4096": (8192, 2048, 4096, 32, 4, 4),  # the issue's: 0.87G parameters, 3.5 GB of float32 weights
}
#: The probes' ir_version (onnx's helper writes 14, which onnxruntime-gpu 1.31.1 refuses).
PROBE_IR_VERSION = 10
#: The dtype of the products the fp8 steps here quantise (the ``fp8`` preset extends ``bf16``).
PRODUCT_DTYPE = "BFLOAT16"
#: Models whose two trainers run one after the other (GPT-2 small's bf16 step held 59 GiB on
#: the H200 in real_models.py: two would not fit): loss tracking, timings not side by side.
SEQUENTIAL = {"gpt2s"}


def cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


# -- the GemmFloat8 probe -------------------------------------------------------------------


def probe_configurations() -> list[tuple[str, str, str]]:
    """(A format, B format, GemmFloat8 dtype) as the fp8_gemm lowering writes them for
    products of ``PRODUCT_DTYPE`` (E5M2 x E5M2 stays emulated; ONNX type names)."""
    import onnx_ir as ir

    from mpgraph.lowering.fp8_gemm import gemm_dtype

    out = ir.DataType[PRODUCT_DTYPE]
    pairs = (("FLOAT8E4M3FN", "FLOAT8E4M3FN"), ("FLOAT8E5M2", "FLOAT8E4M3FN"), ("FLOAT8E4M3FN", "FLOAT8E5M2"))
    return [(fa, fb, gemm_dtype(ir.DataType[fa], ir.DataType[fb], out).name) for fa, fb in pairs]


def probe_model(fa: str, fb: str, dtype: str) -> bytes:
    """``Y = float(GemmFloat8(Cast(A, fa), Cast(B, fb), scaleA=0.5, scaleB=2, dtype))``, 64x64,
    transA=0, transB=1, ir_version ``PROBE_IR_VERSION``, serialised."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["A"], ["qa"], to=getattr(TensorProto, fa), saturate=1),
             helper.make_node("Cast", ["B"], ["qb"], to=getattr(TensorProto, fb), saturate=1),
             helper.make_node("GemmFloat8", ["qa", "qb", "", "sa", "sb"], ["Yg"], domain="com.microsoft",
                              transA=0, transB=1, alpha=1.0, dtype=getattr(TensorProto, dtype)),
             helper.make_node("Cast", ["Yg"], ["Y"], to=TensorProto.FLOAT)]
    inits = [helper.make_tensor("sa", TensorProto.FLOAT, [], [0.5]), helper.make_tensor("sb", TensorProto.FLOAT, [], [2.0])]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64, 64]) for n in "AB"],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [64, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = PROBE_IR_VERSION
    return model.SerializeToString()


def probe_gemm_float8(providers: tuple[str, ...] = ("CUDAExecutionProvider",)) -> list[tuple[str, str]]:
    """Run GemmFloat8 in each of ``probe_configurations``, one session each, against numpy;
    (configuration, verdict)."""
    import ml_dtypes
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    results = []
    for fa, fb, dtype in probe_configurations():
        label = f"{fa} x {fb} -> {'float32' if dtype == 'FLOAT' else dtype.lower()}"
        np_a = a.astype(getattr(ml_dtypes, fa.lower().replace("float8", "float8_"))).astype(np.float32)
        np_b = b.astype(getattr(ml_dtypes, fb.lower().replace("float8", "float8_"))).astype(np.float32)
        want = (np_a * 0.5) @ (np_b * 2.0).T
        try:
            session = ort.InferenceSession(probe_model(fa, fb, dtype), providers=list(providers))
            got = session.run(None, {"A": a, "B": b})[0]
            err = float(np.abs(got - want).max() / np.abs(want).max())
            results.append((label, f"ok, max error {err:.1e} of max |Y|" if err < 2e-2 else f"WRONG ({err:.2e})"))
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            results.append((label, f"FAILED: {str(e).splitlines()[0][:200]}"))
    return results


# -- models, data, trainers -----------------------------------------------------------------


def markov_batches(vocab: int, seq: int, batch: int, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Sequences of a fixed random chain (each token has four likely successors): the label
    is the next token, so the loss can fall from ln(vocab) towards ln(4)."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, (vocab, 4))
    out = []
    for _ in range(count):
        toks = np.empty((batch, seq + 1), np.int64)
        toks[:, 0] = rng.integers(0, vocab, batch)
        for t in range(seq):
            toks[:, t + 1] = succ[toks[:, t], rng.integers(0, 4, batch)]
        out.append({"tokens": toks[:, :-1].copy(), "label": toks[:, 1:].copy()})
    return out


def fp8_policy(products: str) -> object:
    """The ``fp8`` preset with its fp8 section's ``products`` set to ``products``."""
    import dataclasses

    from mpgraph.policy.loader import load_policy

    policy = load_policy("fp8")
    return dataclasses.replace(policy, fp8=dataclasses.replace(policy.fp8, products=products))


def step_graphs(name: str, products: str = "linear") -> dict[str, object]:
    """The bf16 and fp8 AdamW step graphs of model ``name``, specialised to its batch."""
    import onnx_ir as ir
    import torch

    import mpgraph
    from models.zoo import GPT
    from mpgraph.export import export_module
    from mpgraph.lowering.specialize import specialize_shapes
    from mpgraph.training import MAX_IR_VERSION, build_training_graph

    vocab, seq, d, heads, layers, batch = SIZES[name]
    torch.manual_seed(0)
    module = GPT(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=layers).train()
    proto = export_module(copy.deepcopy(module), torch.zeros((2, seq), dtype=torch.int64), loss="cross_entropy")
    del module
    step = build_training_graph(proto, optimizer="adamw", lr=3e-4, optimizer_options={"weight_decay": 0.01}, target="cuda")
    out = {}
    for policy in ("bf16", "fp8"):
        fresh = ir.from_proto(ir.to_proto(step))
        graph = mpgraph.convert(fresh, policy if policy == "bf16" else fp8_policy(products), emulate=False,
                                validate=False, calibrate=None)
        graph = specialize_shapes(graph, {"tokens": [batch, seq], "label": [batch, seq]})
        if graph.ir_version > MAX_IR_VERSION:  # onnxruntime-gpu 1.31 loads ir_version <= 13
            graph.ir_version = MAX_IR_VERSION
        out[policy] = graph
    return out


@dataclass
class Side:
    label: str  # "bf16", "fp8" or "bf16 plain" (bf16 without CUDA graphs)
    trainer: object
    round_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    graph: str = ""  # how it ran: "CUDA graph" or "no CUDA graph (<reason>)"


#: Each side's step graph and ``Trainer(cuda_graph=...)`` (fp8's: ``fp8_capturable``).
SIDES = {"bf16": ("bf16", None), "fp8": ("fp8", None), "bf16 plain": ("bf16", False)}


def fp8_capturable() -> tuple[bool, str]:
    """Whether the fp8 products will run on the library's capturable GemmFp8, and which op."""
    if os.environ.get("MPGRAPH_FP8_GEMM") == "ort":
        return False, "GemmFloat8 (MPGRAPH_FP8_GEMM=ort)"
    from mpgraph.lowering.build import KernelBuildError, cublaslt_flags
    from mpgraph.lowering.plan import has_gemm_bias, library

    try:
        if has_gemm_bias(str(library("cuda"))):
            return True, "the library's GemmFp8"
    except KernelBuildError as e:
        return False, f"GemmFloat8 (no kernel library: {e})"
    return False, f"GemmFloat8 (the library has no cuBLASLt: {cublaslt_flags()[1]})"


def plan_ops(trainer: object, *ops: str) -> dict[str, int]:
    """How many nodes of each of ``ops`` the trainer's current session plan has."""
    import onnx

    graph = onnx.load_from_string(trainer.executor.plan.graph).graph  # type: ignore[attr-defined]
    return {op: sum(n.op_type == op for n in graph.node) for op in ops}


def graph_note(trainer: object) -> str:
    """Whether ``trainer``'s steps ran as a CUDA graph, and if not, its executor's reason."""
    if trainer.cuda_graph:  # type: ignore[attr-defined]
        return "CUDA graph" + ("" if trainer.pipeline else f", not pipelined ({trainer.pipeline_reason})")  # type: ignore[attr-defined]
    return f"no CUDA graph ({trainer.cuda_graph_reason or 'no reason given'})"  # type: ignore[attr-defined]


def kernel_table(trainer: object, batches: list, steps: int) -> list[dict[str, object]]:
    """CUDA kernels of ``steps`` more steps of ``trainer`` by name (CUPTI through torch.profiler,
    which sees the kernels inside captured graphs too): calls and GPU ms per step, largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            trainer.step(batches[i % len(batches)])  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = table.setdefault(event.name[:110], [0, 0.0])
        row[0] += 1
        row[1] += event.device_time_total
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    return [{"name": k, "calls": n / steps, "ms": us / steps / 1e3} for k, (n, us) in rows]


def run_model(name: str, steps: int, rounds: int, products: str = "linear", plain: bool = False,
              kernels: int = 0) -> dict[str, object]:
    from mpgraph.runtime.trainer import Trainer

    t0 = time.perf_counter()
    graphs = step_graphs(name, products)
    result: dict[str, object] = {"model": name, "build_s": time.perf_counter() - t0, "interleaved": name not in SEQUENTIAL}
    vocab, seq, _, _, _, batch = SIZES[name]
    data = markov_batches(vocab, seq, batch, count=16)
    labels = ["bf16", "fp8", *(["bf16 plain"] if plain else [])]

    capturable, result["fp8_gemm_op"] = fp8_capturable()

    def make(label: str) -> Side:  # each trainer keeps its own copy of the graph
        policy, cuda_graph = SIDES[label]
        if label == "fp8" and not capturable:
            cuda_graph = False
        return Side(label, Trainer(graphs[policy], "cuda", cuda_graph=cuda_graph))

    def train(group: list[Side]) -> None:
        per_round, done = max(1, steps // rounds), 0
        while done < steps:
            n = min(per_round, steps - done)
            for side in group:
                start = time.perf_counter()
                side.losses.extend(side.trainer.step(data[(done + i) % len(data)]).loss for i in range(n))
                side.round_ms.append((time.perf_counter() - start) * 1e3 / n)
            done += n

    def done(side: Side) -> None:
        side.graph = graph_note(side.trainer)
        if kernels:
            result[f"{side.label} kernels"] = kernel_table(side.trainer, data, kernels)
        if side.label == "fp8":
            result["fp8_gemms"] = plan_ops(side.trainer, "GemmFp8", "GemmFloat8")
        side.trainer = None
    if name in SEQUENTIAL:  # two trainers at once would not fit: one after the other
        sides = []
        for label in labels:
            sides.append(make(label))
            train(sides[-1:])
            done(sides[-1])
    else:
        sides = [make(label) for label in labels]
        train(sides)
        for side in sides:
            done(side)
    graphs.clear()
    for side in sides:
        timed = side.round_ms[1:] or side.round_ms
        result[side.label] = {"ms": statistics.median(timed), "loss_last10": float(np.mean(side.losses[-10:])),
                              "loss_first": side.losses[0], "finite": bool(np.isfinite(side.losses).all()),
                              "graph": side.graph, "curve": loss_curve(side.losses)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemm,gpt2s", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=200, help="training steps per side and model")
    p.add_argument("--rounds", type=int, default=10, help="the steps in this many alternating rounds (the first is warm-up)")
    p.add_argument("--products", choices=("linear", "all"), default="linear",
                   help="the fp8 section's products: linear (weight products and their backward) or all (the preset's)")
    p.add_argument("--bf16-plain", action="store_true", help="also run bf16 without CUDA graphs (a third side)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="after timing, profile N more steps of each side and print its top CUDA kernels")
    args = p.parse_args()
    if not cuda_available():
        print("fp8_step: this benchmark needs onnxruntime-gpu with the CUDA provider (on the GPU machine: "
              "source .ortgpu/stage.sh); nothing was run.", file=sys.stderr)
        sys.exit(2)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SIZES]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(SIZES)}")
    probe = probe_gemm_float8()
    print(f"GemmFloat8 probe (64x64, transA=0, transB=1, scales 0.5 and 2, ir_version {PROBE_IR_VERSION}):")
    for pair, verdict in probe:
        print(f"  {pair:40s} {verdict}")
    if any(not v.startswith("ok") for _, v in probe):
        print("fp8_step: GemmFloat8 refuses a configuration the fp8_gemm lowering writes; stopping before the models.")
        sys.exit(1)
    rows = []
    for name in models:
        r = run_model(name, args.steps, args.rounds, args.products, args.bf16_plain, args.kernels)
        rows.append(r)
        print(f"{name}: built in {r['build_s']:.0f} s; fp8 products ({args.products}) on {r['fp8_gemm_op']}; "
              f"fp8 plan: {r['fp8_gemms']}", flush=True)
        for label in SIDES:
            if label in r:
                print(f"  {label:10s} {r[label]['graph']}", flush=True)
        for label in SIDES:
            table = r.get(f"{label} kernels")
            if table:
                total = sum(row["ms"] for row in table)
                print(f"  {label} kernels: {sum(row['calls'] for row in table):.0f} a step, {total:.2f} GPU ms a step; top:")
                for row in table[:25]:
                    print(f"    {row['ms']:7.3f} ms {row['calls']:5.0f}x  {row['name']}")
    print(report(rows, args.steps, args.rounds))


#: Issue 29's lines: fp8 at least this much faster than bf16 (on a GEMM-heavy model), and its loss
#: after the steps within this fraction of bf16's.
SPEEDUP_LIMIT, LOSS_LIMIT = 1.3, 0.02
#: The loss curve under the table: the mean loss of each window of this many steps.
CURVE_WINDOW = 20


def loss_curve(losses: list[float], window: int = CURVE_WINDOW) -> list[float]:
    """The mean of each ``window`` consecutive losses (a last, shorter window included)."""
    return [float(np.mean(losses[i:i + window])) for i in range(0, len(losses), window)]


def report(rows: list[dict[str, object]], steps: int, rounds: int) -> str:
    """The table: ms/step and loss of each side, fp8's speedup and loss ratio against bf16 (and
    against bf16 without CUDA graphs where that side ran)."""
    plain = any("bf16 plain" in r for r in rows)
    lines = [f"\n{'model':7s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'speedup':>8s} {'bf16 loss':>10s} {'fp8 loss':>10s} "
             f"{'loss ratio':>10s}" + (f" {'bf16 plain ms':>14s} {'fp8/plain':>9s}" if plain else "")
             + f"  (loss: mean of the last 10 of {steps} steps; ms: median of rounds 2..{rounds})"]
    for r in rows:
        b, f, q = r["bf16"], r["fp8"], r.get("bf16 plain")  # type: ignore[union-attr]
        line = (f"{r['model']:7s} {b['ms']:9.2f} {f['ms']:9.2f} {b['ms'] / f['ms']:7.3f}x {b['loss_last10']:10.4f} "  # type: ignore[index]
                f"{f['loss_last10']:10.4f} {f['loss_last10'] / b['loss_last10']:10.4f}")  # type: ignore[index]
        if plain:
            line += f" {q['ms']:14.2f} {q['ms'] / f['ms']:8.2f}x" if q else f" {'-':>14s} {'-':>9s}"  # type: ignore[index]
        finite = all(side["finite"] for side in (b, f, q) if side)  # type: ignore[index]
        lines.append(line + ("" if r["interleaved"] else "  (sides one after the other)")
                     + ("" if finite else "  NON-FINITE LOSS"))
    lines.append("\nissue 29's lines (speedup on a GEMM-heavy model; loss within 2% of bf16's after the steps):")
    for r in rows:
        b, f = r["bf16"], r["fp8"]  # type: ignore[index]
        speedup, ratio = b["ms"] / f["ms"], f["loss_last10"] / b["loss_last10"]  # type: ignore[index]
        lines.append(f"{r['model']:7s} speedup {speedup:.3f}x (>= {SPEEDUP_LIMIT}: "
                     f"{'held' if speedup >= SPEEDUP_LIMIT else 'MISSED'}{'' if r['interleaved'] else ', sides apart'}); "
                     f"loss ratio {ratio:.4f} (within {LOSS_LIMIT:.0%}: {'held' if abs(ratio - 1) <= LOSS_LIMIT else 'MISSED'})")
    lines.append(f"\nloss curves: the mean loss of each {CURVE_WINDOW} steps")
    for r in rows:
        for label in ("bf16", "fp8", "bf16 plain"):
            if r.get(label):
                lines.append(f"{r['model']:7s} {label:10s} " + " ".join(f"{v:.4f}" for v in r[label]["curve"]))  # type: ignore[index]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
