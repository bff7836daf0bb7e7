"""Mixed-precision training on ORT CUDA: the zoo GPT three ways, the underflow case, node placement.

Run on a machine with onnxruntime-gpu (see benchmarks/results/gpu_train.md for the command)::

    python3 benchmarks/gpu_train.py --out results_dir [--steps 300]

Writes ``gpu_train.json`` (loss curves, step times, loss scales, skipped steps, node placement
from ORT's profiler, the underflow table) and prints a summary. ``--provider cpu`` runs the same
thing on CPU with emulated lowerings (a dry run of the script).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mpgraph  # noqa: E402
from models.underflow import underflow_model  # noqa: E402
from mpgraph.data import Batches, dataset_for_model  # noqa: E402
from mpgraph.policy import parse_policy  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ZOO = os.path.join(HERE, "..", "models", "onnx")


def step_graphs(emulate: bool) -> dict[str, ir.Model]:
    base = build_training_graph(os.path.join(ZOO, "gpt.loss.onnx"), optimizer="adamw", lr=3e-3)
    proto = ir.to_proto(base)
    return {
        "fp32": ir.from_proto(proto),
        "bf16": mpgraph.convert(ir.from_proto(proto), "bf16", emulate=emulate),
        "fp16+dynamic": mpgraph.convert(ir.from_proto(proto), "fp16", emulate=emulate),
    }


def profile_placement(model: ir.Model, provider: str, batch: dict[str, np.ndarray]) -> dict[str, object]:
    """Run one step with ORT's profiler; count node events per execution provider."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.log_severity_level = 3
    prefix = os.path.join(tempfile.mkdtemp(), "prof")
    options.profile_file_prefix = prefix
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=providers)
    feeds = dict(batch)
    names = {i.name for i in session.get_inputs()}
    for name, value in model.graph.initializers.items():
        if name in names and name not in feeds and value.const_value is not None:
            feeds[name] = value.const_value.numpy()
    session.run(None, {k: v for k, v in feeds.items() if k in names})
    path = session.end_profiling()
    events = json.load(open(path))
    by_provider: collections.Counter[str] = collections.Counter()
    cpu_float: list[str] = []
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        ep = args.get("provider", "?")
        by_provider[ep] += 1
        if ep == "CPUExecutionProvider":
            outs = json.dumps(args.get("output_type_shape", []))
            ins = json.dumps(args.get("input_type_shape", []))
            # Float results of integer-only inputs (Cast(Size) in a mean's backward) are shape
            # arithmetic ORT keeps on CPU on purpose; count nodes that move float data.
            if "float" in outs and "float" in ins:
                cpu_float.append(f"{args.get('op_name')}:{event['name'][:-len('_kernel_time')]}")
    return {"node_events_by_provider": dict(by_provider), "cpu_float_nodes": cpu_float}


def gpt_data(trainer: Trainer, seed: int = 0):
    tokens = next(spec.name for spec in trainer.data_inputs if spec.dtype.kind in "iu")
    return dataset_for_model("sequence", trainer.data_inputs, seed=seed, vocab=trainer.vocab(tokens))


def train(model: ir.Model, provider: str, steps: int, batch_size: int, seed: int) -> dict[str, object]:
    trainer = Trainer(model, provider=provider)
    data = gpt_data(trainer, seed)
    batches = Batches(data.train, batch_size, seed)
    losses, scales, skipped, times = [], [], [], []
    for _ in range(steps):
        result = trainer.step(next(batches))
        losses.append(result.loss)
        scales.append(result.loss_scale)
        skipped.append(result.skipped)
        times.append(result.seconds)
    warm = times[10:] or times
    test = trainer.evaluate(data.test) if data.test else {}
    return {
        "loss": losses,
        "loss_scale": scales,
        "skipped": int(sum(skipped)),
        "ms_per_step_median": 1000 * statistics.median(warm),
        "ms_per_step_p90": 1000 * float(np.percentile(warm, 90)),
        "test": test,
        "placement_from_trainer": dict(collections.Counter(trainer.node_providers().values())),
    }


def resnet_runs(provider: str, steps: int, emulate: bool) -> dict[str, object]:
    """The zoo ResNet (BatchNorm as explicit ops) on 512 fixed random images: fp32, bf16, fp16."""
    base = build_training_graph(os.path.join(ZOO, "resnet.loss.onnx"), optimizer="adamw", lr=1e-3, batchnorm="train-ops")
    proto = ir.to_proto(base)
    graphs = {
        "fp32": ir.from_proto(proto),
        "bf16": mpgraph.convert(ir.from_proto(proto), "bf16", emulate=emulate),
        "fp16+dynamic": mpgraph.convert(ir.from_proto(proto), "fp16", emulate=emulate),
    }
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((512, 3, 32, 32)).astype(np.float32), "label": rng.integers(0, 10, 512).astype(np.int64)}
    runs = {}
    for label, model in graphs.items():
        trainer = Trainer(model, provider=provider)
        batches = Batches(data, 64, 0)
        losses, times = [], []
        for _ in range(steps):
            result = trainer.step(next(batches))
            losses.append(result.loss)
            times.append(result.seconds)
        placement = profile_placement(model, provider, next(Batches(data, 64, 1)))
        runs[label] = {
            "loss": losses,
            "ms_per_step_median": 1000 * statistics.median(times[10:] or times),
            "placement_from_profiler": placement,
        }
        print(f"resnet {label:14s} loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}  "
              f"{runs[label]['ms_per_step_median']:.2f} ms/step  profiler {placement['node_events_by_provider']}  "
              f"cpu float nodes {len(placement['cpu_float_nodes'])}", flush=True)
    return runs


def underflow_table(provider: str, emulate: bool) -> dict[str, object]:
    """Gradients ~1e-8 through a MatMul: fraction that become zero per policy (lr=1, W=0: new W = -grad)."""
    model = underflow_model(64, 64)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((32, 64)).astype(np.float32), "t": rng.standard_normal((32, 64)).astype(np.float32)}
    policies = {
        "fp32": "fp32",
        "fp16 no scaling": parse_policy("extends: fp16\nloss_scaling: {mode: none}\n", "fp16-none.yaml"),
        "fp16 dynamic scaling": "fp16",
        "bf16 no scaling": "bf16",
    }
    grads = {}
    for label, pol in policies.items():
        step = build_training_graph(model, optimizer="sgd", lr=1.0)
        converted = mpgraph.convert(step, pol, emulate=emulate and pol != "fp32")
        # ORT puts the scalar Cast(Size) of ReduceMean's backward on CPU as shape math: allow it.
        trainer = Trainer(converted, provider=provider, allow_cpu_fallback=True)
        trainer.step(feeds, lr=1.0)
        grads[label] = -np.asarray(trainer.state["W"], dtype=np.float64)
    ref = grads["fp32"]
    table = {}
    for label, g in grads.items():
        table[label] = {
            "zero_fraction": float(np.mean(g == 0)),
            "rel_error_vs_fp32": float(np.linalg.norm(g - ref) / np.linalg.norm(ref)),
            "mean_abs_grad": float(np.abs(g).mean()),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resnet-steps", type=int, default=100)
    args = parser.parse_args()
    emulate = args.provider == "cpu"
    report: dict[str, object] = {
        "machine": platform.node(),
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
        "provider": args.provider,
        "emulated": emulate,
    }
    try:
        import torch

        report["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - informational only
        report["gpu"] = None
    graphs = step_graphs(emulate)
    first = next(Batches(gpt_data(Trainer(graphs["fp32"], provider=args.provider)).train, args.batch, 0))
    runs = {}
    for label, model in graphs.items():
        t0 = time.perf_counter()
        runs[label] = train(model, args.provider, args.steps, args.batch, seed=0)
        runs[label]["placement_from_profiler"] = profile_placement(model, args.provider, first)
        runs[label]["wall_s"] = time.perf_counter() - t0
        r = runs[label]
        print(f"{label:14s} loss {r['loss'][0]:.3f} -> {np.mean(r['loss'][-20:]):.3f}  skipped {r['skipped']}  "
              f"{r['ms_per_step_median']:.2f} ms/step  test {r['test']}  profiler {r['placement_from_profiler']['node_events_by_provider']}  "
              f"cpu float nodes {len(r['placement_from_profiler']['cpu_float_nodes'])}", flush=True)
    report["gpt"] = runs
    report["resnet_train_ops"] = resnet_runs(args.provider, args.resnet_steps, emulate)
    report["underflow"] = underflow_table(args.provider, emulate)
    for label, row in report["underflow"].items():
        print(f"underflow {label:22s} zero {row['zero_fraction']:.1%}  rel err {row['rel_error_vs_fp32']:.2e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_train.json"), "w") as f:
        json.dump(report, f, indent=1)
    for stray in glob.glob("onnxruntime_profile_*.json"):
        os.remove(stray)


if __name__ == "__main__":
    main()
