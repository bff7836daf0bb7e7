"""Native fp16/bf16 step graphs of ReLU models on ORT CUDA, and whether low precision pays on a
model big enough to be compute-bound.

- The zoo's wide MLP and Nature DQN (ReLU backward compares in the low dtype; the DQN's first
  weight gradient goes through SpaceToDepth): fp32, bf16 and fp16 + dynamic loss scaling, on a
  fixed random dataset; loss at the start and the end, median ms/step, and ORT's node
  placement (profiler): float nodes on the CPU provider.
- A 4-layer MLP of width 4096 at batch 4096 built here with onnx.helper (MatMul + Add + Relu,
  SoftmaxCrossEntropyLoss): median ms/step of the three step graphs, side by side.

Run on a machine with onnxruntime-gpu::

    python3 benchmarks/gpu_relu.py --out results_dir [--steps 100] [--big-steps 30]

Writes ``gpu_relu.json`` and prints a summary. ``--provider cpu`` is a dry run (emulated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_train import profile_placement  # noqa: E402

import mpgraph  # noqa: E402
from mpgraph.data import Batches  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "onnx")
POLICIES = {"fp32": None, "bf16": "bf16", "fp16+dynamic": "fp16"}


def big_mlp(width: int, depth: int, classes: int = 16) -> onnx.ModelProto:
    """``depth`` Linear+ReLU layers of ``width`` and a classifier, with a cross-entropy loss."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    dims = [width] * depth + [classes]
    for i, (fan_in, fan_out) in enumerate(zip([width] + dims[:-1], dims, strict=True)):
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        inits += [helper.make_tensor(f"w{i}", TensorProto.FLOAT, w.shape, w.tobytes(), raw=True),
                  helper.make_tensor(f"b{i}", TensorProto.FLOAT, [fan_out], np.zeros(fan_out, np.float32).tobytes(), raw=True)]
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"mm{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"z{i}"], name=f"add{i}")]
        h = f"z{i}"
        if i < depth:
            nodes.append(helper.make_node("Relu", [h], [f"h{i}"], name=f"relu{i}"))
            h = f"h{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [h, "label"], ["loss"], name="loss", reduction="mean"))
    graph = helper.make_graph(
        nodes, "big_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def graphs(base: ir.Model, emulate: bool) -> dict[str, ir.Model]:
    proto = ir.to_proto(base)
    return {label: ir.from_proto(proto) if pol is None else mpgraph.convert(ir.from_proto(proto), pol, emulate=emulate)
            for label, pol in POLICIES.items()}


def run(model: ir.Model, provider: str, data: dict[str, np.ndarray], batch: int, steps: int) -> dict[str, object]:
    trainer = Trainer(model, provider=provider)
    batches = Batches(data, batch, 0)
    losses, times, skipped = [], [], 0
    for _ in range(steps):
        result = trainer.step(next(batches))
        losses.append(result.loss)
        times.append(result.seconds)
        skipped += int(result.skipped)
    return {"loss": losses, "skipped": skipped, "ms_per_step_median": 1000 * statistics.median(times[5:] or times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--big-steps", type=int, default=30)
    parser.add_argument("--big-width", type=int, default=4096)
    parser.add_argument("--big-batch", type=int, default=4096)
    args = parser.parse_args()
    emulate = args.provider == "cpu"
    rng = np.random.default_rng(0)
    results: dict[str, object] = {"provider": args.provider}

    zoo = {
        "wide_mlp": ({"x": rng.standard_normal((2048, 1024)).astype(np.float32),
                      "label": rng.integers(0, 10, 2048).astype(np.int64)}, 256, 1e-3),
        "dqn_cnn": ({"x": rng.standard_normal((256, 4, 84, 84)).astype(np.float32),
                     "label": rng.standard_normal((256, 18)).astype(np.float32)}, 32, 1e-4),
    }
    for name, (data, batch, lr) in zoo.items():
        base = build_training_graph(os.path.join(ZOO, f"{name}.loss.onnx"), optimizer="adamw", lr=lr)
        for label, model in graphs(base, emulate).items():
            entry = run(model, args.provider, data, batch, args.steps)
            entry["placement"] = profile_placement(model, args.provider, next(Batches(data, batch, 1)))
            results[f"{name}/{label}"] = entry
            print(f"{name:9s} {label:13s} loss {entry['loss'][0]:.4f} -> {np.mean(entry['loss'][-10:]):.4f}  "
                  f"skipped {entry['skipped']}  {entry['ms_per_step_median']:.2f} ms/step  "
                  f"cpu float nodes {len(entry['placement']['cpu_float_nodes'])} {entry['placement']['cpu_float_nodes'][:5]}", flush=True)

    width, batch = args.big_width, args.big_batch
    base = build_training_graph(big_mlp(width, 4), optimizer="adamw", lr=1e-4)
    data = {"x": rng.standard_normal((2 * batch, width)).astype(np.float32),
            "label": rng.integers(0, 16, 2 * batch).astype(np.int64)}
    for label, model in graphs(base, emulate).items():
        entry = run(model, args.provider, data, batch, args.big_steps)
        results[f"big_mlp/{label}"] = entry
        print(f"big_mlp   {label:13s} width {width} batch {batch}: loss {entry['loss'][0]:.4f} -> "
              f"{np.mean(entry['loss'][-5:]):.4f}  {entry['ms_per_step_median']:.2f} ms/step", flush=True)
    fp32 = results["big_mlp/fp32"]["ms_per_step_median"]  # type: ignore[index]
    for label in ("bf16", "fp16+dynamic"):
        print(f"big_mlp   {label} / fp32 step time: {results[f'big_mlp/{label}']['ms_per_step_median'] / fp32:.2f}")  # type: ignore[index]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_relu.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
