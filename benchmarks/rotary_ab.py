"""A Llama-style step's rotary embeddings as ORT's ``RotaryEmbedding`` and as the library's
(``rotary`` rule): what the rule saves.

Side by side in one process: ``--layers`` layers of the four rotary nodes a Llama-style 125M bf16
step runs per layer once ``sdpa_layout`` has put them in the 3-D ``num_heads`` form (Q
``[B, S, 12 * 64]`` and K ``[B, S, 4 * 64]`` forward with cos/sin, their gradients with cos and
-sin; 3-D caches ``[B, S, 32]``, no position ids, as ``real_models.py``'s dynamo export plans
them), each layer reading the previous one's outputs; as in the plan each Q or K pair reads
caches ``Expand``-ed from ``[1, S, 32]`` to the batch and the gradient a ``Neg`` of sin (48
Expand and 24 Neg a step). Run as ORT CUDA's ``RotaryEmbedding`` (``RotaryEmbeddingBSNH``: 1.96
ms for the step's 48 on the H200) with those Expand and Neg, and with the rule applied alone
(which reads the caches before them, so they go). X and the caches are float32 graph inputs cast once per run (numpy has no bfloat16 to
bind), the same in both graphs; the difference of the two times is what the rule saves for
the step's 48 nodes at the default ``--layers 12``. Median of ``--rounds`` rounds of ``--iters``
runs, inputs and outputs on the device (IOBinding); the outputs of both compared.

    python3 benchmarks/rotary_ab.py                        # the GPU machine, onnxruntime-gpu
    python3 benchmarks/rotary_ab.py --dtype fp16 --interleaved --positions
    python3 benchmarks/rotary_ab.py --provider cpu --dtype fp32 --batch 1 --seq 64 --layers 1   # here: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h
from ort_timing import time_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.lowering.plan import library  # noqa: E402
from mpgraph.lowering.rotary import fuse_rotary  # noqa: E402

DTYPES = {"bf16": T.BFLOAT16, "fp16": T.FLOAT16, "fp32": T.FLOAT}
HEAD = 64


def chain(args: argparse.Namespace) -> onnx.ModelProto:
    """``--layers`` x (Q, K forward; Q, K backward) rotary nodes in ``--dtype``."""
    dtype, f32, b, s = DTYPES[args.dtype], T.FLOAT, args.batch, args.seq
    cache = [s, HEAD // 2] if args.positions else [1, s, HEAD // 2]
    inputs = [h.make_tensor_value_info("q", f32, [b, s, args.q_heads * HEAD]),
              h.make_tensor_value_info("k", f32, [b, s, args.kv_heads * HEAD]),
              h.make_tensor_value_info("cos", f32, cache), h.make_tensor_value_info("sin", f32, cache)]
    nodes = [h.make_node("Cast", [n], [n + "0"], to=dtype) for n in ("q", "k", "cos", "sin")]
    nodes.append(h.make_node("Constant", [], ["batch_shape"],
                             value=h.make_tensor("batch_shape", T.INT64, [3], [b, s, HEAD // 2])))
    extra = []
    if args.positions:
        inputs.append(h.make_tensor_value_info("pos", T.INT64, [b, s]))
        extra = ["pos"]
    q, k = "q0", "k0"
    for layer in range(args.layers):
        for name, heads in (("q", args.q_heads), ("k", args.kv_heads)):
            src = q if name == "q" else k
            fwd, bwd = f"{name}{layer}_rot", f"{name}{layer}_grad"
            cos, sin = "cos0", "sin0"
            if not args.positions:
                cos, sin = f"{fwd}_cos", f"{fwd}_sin"
                nodes += [h.make_node("Expand", ["cos0", "batch_shape"], [cos]),
                          h.make_node("Expand", ["sin0", "batch_shape"], [sin])]
            nodes.append(h.make_node("Neg", [sin], [f"{fwd}_nsin"]))
            nodes.append(h.make_node("RotaryEmbedding", [src, cos, sin, *extra], [fwd], name=fwd,
                                     num_heads=heads, interleaved=int(args.interleaved)))
            nodes.append(h.make_node("RotaryEmbedding", [fwd, cos, f"{fwd}_nsin", *extra], [bwd], name=bwd,
                                     num_heads=heads, interleaved=int(args.interleaved)))
            q, k = (bwd, k) if name == "q" else (q, bwd)
    nodes += [h.make_node("Cast", [q], ["q_out"], to=f32), h.make_node("Cast", [k], ["k_out"], to=f32)]
    outputs = [h.make_tensor_value_info("q_out", f32, [b, s, args.q_heads * HEAD]),
               h.make_tensor_value_info("k_out", f32, [b, s, args.kv_heads * HEAD])]
    model = h.make_model(h.make_graph(nodes, "rotary_chain", inputs, outputs),
                         opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def feeds_for(args: argparse.Namespace) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, s = args.batch, args.seq
    angle = np.arange(s)[:, None] / 10000 ** (np.arange(HEAD // 2)[None, :] * 2 / HEAD)
    if not args.positions:
        angle = angle[None]
    feeds = {"q": rng.standard_normal((b, s, args.q_heads * HEAD)).astype(np.float32),
             "k": rng.standard_normal((b, s, args.kv_heads * HEAD)).astype(np.float32),
             "cos": np.cos(angle).astype(np.float32), "sin": np.sin(angle).astype(np.float32)}
    if args.positions:
        feeds["pos"] = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    return feeds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--q-heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--positions", action="store_true", help="2-D caches read through position_ids")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    plain = chain(args)
    fused = ir.from_proto(plain)
    taken = fuse_rotary(fused, args.provider)
    nodes = sum(n.op_type == "RotaryEmbedding" for n in plain.graph.node)
    small = {op: sum(n.op_type == op for n in plain.graph.node) - sum(n.op_type == op for n in fused.graph)
             for op in ("Expand", "Neg")}
    lib = str(library(args.provider))
    feeds = feeds_for(args)
    t_plain, out_plain = time_graph(plain.SerializeToString(), args.provider, feeds, args.rounds, args.iters)
    t_fused, out_fused = time_graph(ir.to_proto(fused).SerializeToString(), args.provider, feeds, args.rounds,
                                    args.iters, custom_ops=lib)
    diff = max(float(np.abs(out_fused[k] - out_plain[k]).max()) for k in out_plain)
    print(f"# {args.dtype} B {args.batch} S {args.seq} heads {args.q_heads}/{args.kv_heads} x {HEAD}, "
          f"{args.layers} layers, interleaved {int(args.interleaved)}, position_ids {int(args.positions)}, "
          f"{args.provider}: the rule took {taken} of {nodes} nodes, and removed {small['Expand']} Expand and "
          f"{small['Neg']} Neg")
    print(f"ORT RotaryEmbedding  {t_plain:8.3f} ms/run")
    print(f"library (rotary)     {t_fused:8.3f} ms/run  ({t_fused / t_plain:.2f}x; saves {t_plain - t_fused:.3f} ms, "
          f"{(t_plain - t_fused) / max(nodes, 1) * 1e3:.1f} us a node)")
    print(f"max |difference| of the outputs: {diff:.3g} (max |output| {max(float(np.abs(v).max()) for v in out_plain.values()):.3g})")


if __name__ == "__main__":
    main()
