"""Llama's RMSNorm and SwiGLU, fused and not: what ``rmsnorm_grad``, ``swiglu_grad`` and ``swiglu`` save.

Side by side in one process, each session planned for the provider's default lowering, once with
every rule and once without these three (everything else the same), inputs and outputs on the
device (IOBinding), median of ``--rounds`` rounds of ``--iters`` runs; the outputs of both
compared.

- default: one Llama MLP sub-layer's step graph, ``x + down(silu(gate(n)) * up(n))`` with
  ``n = RMSNormalization(x, gamma)``, at a Llama-style 125M's widths (x ``[8, 1024, 768]``,
  intermediate 2048), the bf16 policy for CUDA (matmuls and the SwiGLU in bfloat16, the norm in
  float32, as the real step has them). The difference of the two times is what the fusions save
  per layer (12 layers; each has two norms, this graph one).
- ``--graph FILE``: a converted step graph, e.g. ``benchmarks/real_models.py``'s
  ``llama_dynamo_bf16.onnx``: the whole step, fused and not (no CUDA graph, no shape
  specialisation: the kernels' difference, not the runtime's best time).

    python3 benchmarks/llama_ab.py                                            # GPU machine, onnxruntime-gpu
    python3 benchmarks/llama_ab.py --graph DIR/llama_dynamo_bf16.onnx
    python3 benchmarks/llama_ab.py --provider cpu --shape 2,64,64,128         # here, float32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.lowering import plan as plan_module  # noqa: E402
from mpgraph.lowering.plan import PlanOptions, plan_session  # noqa: E402

RULES = ("rmsnorm_grad", "swiglu_grad", "swiglu")
LAYERS = 12  # the Llama-style 125M


def block(shape: tuple[int, int, int, int], seed: int = 0) -> ir.Model:
    """``loss = sum((x + down(silu(gate(n)) * up(n))) * c)``, ``n = RMSNormalization(x, gamma)``,
    as the exporters write a Llama MLP sub-layer (SiLU as ``a * Sigmoid(a)``), float32 with
    gamma and the three weights as initializers; ``shape`` is (batch, seq, hidden, intermediate)."""
    batch, seq, hidden, inner = shape
    rng = np.random.default_rng(seed)
    n = h.make_node
    nodes = [n("RMSNormalization", ["x", "gamma"], ["n"], axis=-1, epsilon=1e-6),
             n("MatMul", ["n", "wg"], ["a"]), n("MatMul", ["n", "wu"], ["b"]), n("Sigmoid", ["a"], ["s"]),
             n("Mul", ["a", "s"], ["silu"]), n("Mul", ["silu", "b"], ["y"]), n("MatMul", ["y", "wd"], ["o"]),
             n("Add", ["x", "o"], ["r"]), n("Mul", ["r", "c"], ["rc"]), n("ReduceSum", ["rc"], ["loss"], keepdims=0)]

    def weight(name: str, dims: tuple[int, ...], scale: float, offset: float = 0.0) -> T:
        values = (offset + scale * rng.standard_normal(dims)).astype(np.float32)
        return h.make_tensor(name, T.FLOAT, dims, values.ravel())

    inits = [weight("gamma", (hidden,), 0.1, 1.0), weight("wg", (hidden, inner), hidden ** -0.5),
             weight("wu", (hidden, inner), hidden ** -0.5), weight("wd", (inner, hidden), inner ** -0.5),
             weight("c", (hidden,), 1.0)]
    graph = h.make_graph(nodes, "llama_mlp", [h.make_tensor_value_info("x", T.FLOAT, [batch, seq, hidden])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    model.ir_version = 10
    return ir.from_proto(model)


def block_step(shape: tuple[int, int, int, int], low: bool) -> ir.Model:
    """``block``'s step graph (gradients of x and the four parameters, no optimizer); with
    ``low``, converted by the bf16 policy for CUDA."""
    from mpgraph.convert import convert
    from mpgraph.training import build_training_graph

    grads = build_training_graph(block(shape), optimizer=None, params=["gamma", "wg", "wu", "wd"],
                                 trainable_inputs=["x"], target="cuda" if low else None)
    return convert(grads, "bf16", validate=False, calibrate=None, target="cuda") if low else grads


@contextlib.contextmanager
def without(names: tuple[str, ...]) -> Iterator[None]:
    """Plan sessions with the rules ``names`` left out of the registry."""
    saved = plan_module.RULES
    plan_module.RULES = tuple(r for r in saved if r.name not in names)
    try:
        yield
    finally:
        plan_module.RULES = saved


def block_feeds(shape: tuple[int, int, int, int], seed: int = 1) -> dict[str, np.ndarray]:
    """``block_step``'s inputs: x standard normal, the parameters ``block``'s initial values."""
    params = {v.name: v.const_value.numpy() for v in block(shape).graph.initializers.values()  # type: ignore[union-attr]
              if v.name != "c"}
    x = np.random.default_rng(seed).standard_normal(shape[:3]).astype(np.float32)
    return {"x": x, **params}


def feeds_for(model: ir.Model, seed: int = 1) -> dict[str, np.ndarray]:
    """Each graph input of a step graph that is no initializer: tokens 1 (ints), floats small
    and positive (parameters, state, lr: a second moment must be), ``x`` standard normal."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        if value.const_value is not None:
            continue
        shape = [d if isinstance(d, int) else 1 for d in value.shape]  # type: ignore[union-attr]
        dtype = value.dtype.numpy()  # type: ignore[union-attr]
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = np.ones(shape, dtype)
        elif value.name == "x":
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[value.name] = (0.01 + 0.02 * np.abs(rng.standard_normal(shape))).astype(dtype)
    return feeds


def timed(plan: plan_module.SessionPlan, feeds: dict[str, np.ndarray], rounds: int,
          iters: int) -> tuple[float, dict[str, np.ndarray]]:
    from ort_timing import time_graph

    return time_graph(plan.graph, plan.provider, feeds, rounds, iters, plan.custom_ops)


def compare(model: ir.Model, provider: str, feeds: dict[str, np.ndarray], rounds: int,
            iters: int) -> tuple[float, float, dict[str, int], float]:
    """(fused ms, unfused ms, the two rules' rewrites, worst |fused - unfused| / max over the
    float outputs)."""
    options = PlanOptions(scope="all") if provider == "cpu" else PlanOptions()
    fused = plan_session(model, provider, options)
    with without(RULES):
        plain = plan_session(model, provider, options)
    counts = {name: n for name, n in fused.applied if name in RULES}
    t_fused, got = timed(fused, feeds, rounds, iters)
    t_plain, want = timed(plain, feeds, rounds, iters)
    worst = max((float(np.max(np.abs(got[k].astype(np.float64) - v)) / max(float(np.max(np.abs(v))), 1e-30))
                 for k, v in want.items() if v.dtype.kind == "f" and v.size), default=0.0)
    return t_fused, t_plain, counts, worst


def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="8,1024,768,2048", help="batch,seq,hidden,intermediate of the block")
    parser.add_argument("--graph", help="a converted step graph instead of the block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if args.graph:
        model, what = ir.load(args.graph), args.graph
        feeds = feeds_for(model)
    else:
        shape = tuple(int(d) for d in args.shape.split(","))
        model, what = block_step(shape, args.provider == "cuda"), f"block {args.shape}"  # type: ignore[arg-type]
        feeds = block_feeds(shape)  # type: ignore[arg-type]
    print(f"# llama_ab.py --provider {args.provider}: {what}, onnxruntime {ort.__version__}, "
          f"median of {args.rounds} x {args.iters}")
    t_fused, t_plain, counts, worst = compare(model, args.provider, feeds, args.rounds, args.iters)
    print(f"fused ({', '.join(f'{k} {v}' for k, v in counts.items())}) {t_fused:.3f} ms, unfused {t_plain:.3f} ms: "
          f"{t_plain / t_fused:.2f}x, saves {t_plain - t_fused:.3f} ms"
          + ("" if args.graph else f" a layer's MLP half, ~{LAYERS * (t_plain - t_fused):.2f} ms for {LAYERS} layers")
          + f"; outputs: worst |fused - unfused| / max {worst:.2g}")


if __name__ == "__main__":
    main()
