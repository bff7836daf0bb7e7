"""GPT-2 small's language-model loss head with and without the ``cross_entropy`` rule, side by side.

The step graph of ``loss = SoftmaxCrossEntropyLoss(Reshape(MatMul(h, W), [-1, V]), labels)``
(mean, ignore_index -100; h [8, 1024, 768] and W [768, 50257] trainable, so both lm_head
gradient GEMMs run), built for CUDA (``PadGemmColumnsPass`` pads W to 50304 columns) and
converted with the bf16 policy, as GPT-2's step has its head; labels with every sequence's last
position -100, as HF's shifted labels. Planned like the trainer's CUDA-graph session
(specialised, every CUDA rule) once with and once without ``cross_entropy``: the difference of
the two times is what the rule saves a step (the GEMMs are in both). Median of ``--rounds``
rounds of ``--iters`` runs, inputs and outputs on the device (IOBinding); the loss and both
gradients compared.

    python3 benchmarks/cross_entropy_ab.py                                   # the GPU machine, onnxruntime-gpu
    python3 benchmarks/cross_entropy_ab.py --provider cpu --shape 2,64,32,1030  # here, float32
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from ort_timing import time_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mpgraph  # noqa: E402
from mpgraph.lowering.plan import has_sdpa, library  # noqa: E402
from mpgraph.lowering.registry import RULES, Target  # noqa: E402
from mpgraph.lowering.specialize import specialize_shapes  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402


def step(batch: int, seq: int, width: int, vocab: int, provider: str) -> ir.Model:
    rng = np.random.default_rng(0)
    nodes = [h.make_node("MatMul", ["h", "W"], ["logits"]), h.make_node("Reshape", ["logits", "flat"], ["rows"]),
             h.make_node("Reshape", ["labels", "flat1"], ["lab"]),
             h.make_node("SoftmaxCrossEntropyLoss", ["rows", "lab"], ["loss"], reduction="mean", ignore_index=-100)]
    inits = [h.make_tensor("W", T.FLOAT, [width, vocab], (rng.standard_normal((width, vocab)) * 0.02).astype(np.float32).ravel()),
             h.make_tensor("flat", T.INT64, [2], [-1, vocab]), h.make_tensor("flat1", T.INT64, [1], [-1])]
    graph = h.make_graph(nodes, "head", [h.make_tensor_value_info("h", T.FLOAT, [batch, seq, width]),
                                         h.make_tensor_value_info("labels", T.INT64, [batch, seq])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 9
    target = "cuda" if provider == "cuda" else "cpu"
    made = build_training_graph(ir.from_proto(model), optimizer=None, trainable_inputs=["h"], target=target,
                                pad_gemms=True)
    return mpgraph.convert(made, "bf16", target="cuda", calibrate=None, validate=False) if provider == "cuda" else made


def plan(model: ir.Model, provider: str, fused: bool, shapes: dict[str, tuple[int, ...]]) -> tuple[bytes, dict]:
    """The session graph: specialised, then every rule the provider's session runs (CUDA: its
    default; CPU: scope all), ``cross_entropy`` only when ``fused``; and what each rule did."""
    lib = str(library(provider))
    lowered = specialize_shapes(ir.from_proto(ir.to_proto(model)), shapes)
    scope = "default" if provider == "cuda" else "all"
    target = Target(provider, scope, sdpa=has_sdpa(lib) if provider == "cuda" else False)
    applied = {r.name: r.apply(lowered, target) for r in RULES
               if r.runs(provider, scope) and (fused or r.name != "cross_entropy")}
    return ir.to_proto(lowered).SerializeToString(), applied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="8,1024,768,50257", help="batch,seq,width,vocab (GPT-2 small)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    batch, seq, width, vocab = (int(d) for d in args.shape.split(","))
    rng = np.random.default_rng(1)
    labels = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    labels[:, -1] = -100
    feeds = {"h": rng.standard_normal((batch, seq, width)).astype(np.float32), "labels": labels}
    model = step(batch, seq, width, vocab, args.provider)
    shapes = {"h": (batch, seq, width), "labels": (batch, seq)}
    print(f"# cross_entropy_ab.py --provider {args.provider} --shape {args.shape} "
          f"({'bf16 policy' if args.provider == 'cuda' else 'float32'}), onnxruntime {ort.__version__}, "
          f"median of {args.rounds} x {args.iters}")
    results = {}
    for fused in (True, False):
        graph, applied = plan(model, args.provider, fused, shapes)
        ms, outs = time_graph(graph, args.provider, feeds, args.rounds, args.iters, str(library(args.provider)))
        results[fused] = (ms, outs)
        print(f"{'fused  ' if fused else 'unfused'}: {ms:.3f} ms a step; rules {applied}")
    (t_fused, got), (t_plain, want) = results[True], results[False]
    worst = {k: float(np.max(np.abs(got[k] - v)) / max(float(np.max(np.abs(v))), 1e-30)) for k, v in want.items()}
    print(f"saves {t_plain - t_fused:.3f} ms a step ({t_fused / t_plain:.2f}x); loss {float(want['loss']):.6f} vs "
          f"{float(got['loss']):.6f}; worst |fused - unfused| / max: {worst}")


if __name__ == "__main__":
    main()
