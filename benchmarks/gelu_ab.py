"""A GELU's backward at GPT-2 small's MLP width, fused and not: what the ``gelu`` rule saves.

Side by side in one process: the step graph of ``loss = sum(float(Gelu(x) * dy))`` (x trainable,
``Gelu(approximate="tanh")``, GPT-2's ``gelu_new``, and the erf form), planned with the
``gelu`` rule (``TanhGeluGrad``/``ErfGeluGrad``, one kernel) and without any kernel rule (the
gradient rule's 16 or 10 elementwise ops). On CUDA x and dy are bfloat16 (cast from float32
inside the graph: numpy has no bfloat16 to bind), as the bf16 policy runs GPT-2's MLP; on CPU
float32. Both graphs also hold the same forward, casts and loss, so the difference of the two
times is what the fusion saves per layer; GPT-2 small has 12. Median of ``--rounds`` rounds of
``--iters`` runs, inputs and outputs on the device (IOBinding); dx of both compared.

    python3 benchmarks/gelu_ab.py                                  # the GPU machine, onnxruntime-gpu
    python3 benchmarks/gelu_ab.py --provider cpu --shape 4,256,768  # here, float32
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

from mpgraph.lowering.plan import PlanOptions, plan_session  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

LAYERS = 12  # GPT-2 small


def step(approximate: str, shape: list[int], low: bool) -> ir.Model:
    """The step graph: ``grad/x`` is the Gelu's dx for dy, in bfloat16 when ``low``."""
    f32 = T.FLOAT
    x, dy = ("xb", "dyb") if low else ("x", "dy")
    nodes = [h.make_node("Cast", ["x"], ["xb"], to=T.BFLOAT16), h.make_node("Cast", ["dy"], ["dyb"], to=T.BFLOAT16)] \
        if low else []
    nodes += [h.make_node("Gelu", [x], ["y"], approximate=approximate), h.make_node("Mul", ["y", dy], ["z"])]
    nodes += [h.make_node("Cast", ["z"], ["z32"], to=f32), h.make_node("ReduceSum", ["z32"], ["loss"], keepdims=0)] \
        if low else [h.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    graph = h.make_graph(nodes, "gelu", [h.make_tensor_value_info(n, f32, shape) for n in ("x", "dy")],
                         [h.make_tensor_value_info("loss", f32, [])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    model.ir_version = 9
    return build_training_graph(ir.from_proto(model), optimizer=None, params=[], trainable_inputs=["x"],
                                target="cuda" if low else "cpu")


def timed(graph: bytes, custom_ops: str | None, provider: str, feeds: dict[str, np.ndarray], rounds: int,
          iters: int) -> tuple[float, np.ndarray]:
    """Median ms per run and ``grad/x``."""
    ms, outs = time_graph(graph, provider, feeds, rounds, iters, custom_ops)
    return ms, outs["grad/x"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="8,1024,3072", help="x's shape (GPT-2 small's MLP: 8,1024,3072)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    shape = [int(d) for d in args.shape.split(",")]
    low = args.provider == "cuda"
    rng = np.random.default_rng(0)
    feeds = {"x": 3 * rng.standard_normal(shape).astype(np.float32), "dy": rng.standard_normal(shape).astype(np.float32)}
    print(f"# gelu_ab.py --provider {args.provider} --shape {args.shape} ({'bfloat16' if low else 'float32'}), "
          f"onnxruntime {ort.__version__}, median of {args.rounds} x {args.iters}")
    for approximate, op in (("tanh", "TanhGeluGrad"), ("none", "ErfGeluGrad")):
        graph = step(approximate, shape, low)
        fused = plan_session(graph, args.provider, PlanOptions(scope="all"))
        plain = plan_session(graph, args.provider, PlanOptions(kernels=False))
        assert dict(fused.applied)["gelu"] == 1, fused.applied
        t_fused, dx_fused = timed(fused.graph, fused.custom_ops, args.provider, feeds, args.rounds, args.iters)
        t_plain, dx_plain = timed(plain.graph, None, args.provider, feeds, args.rounds, args.iters)
        same = float(np.mean(dx_fused == dx_plain))
        worst = float(np.max(np.abs(dx_fused - dx_plain)) / np.max(np.abs(dx_plain)))
        print(f"Gelu(approximate={approximate!r}): {op} step {t_fused:.3f} ms, unfused {t_plain:.3f} ms; saves "
              f"{t_plain - t_fused:.3f} ms a layer, {LAYERS * (t_plain - t_fused):.2f} ms for {LAYERS} layers; "
              f"dx equal in {same:.4%} of elements, worst |fused - unfused| / max {worst:.2g}")


if __name__ == "__main__":
    main()
