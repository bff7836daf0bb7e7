"""GPT-2 small's forward linear layers with their bias in the GEMM's epilogue and not: what the
``gemm_bias`` rule saves.

Side by side in one process: a chain of ``--layers`` GPT-2 blocks' four linear layers at
``--rows`` rows (8 x 1024 tokens by default), each a bfloat16 (``--dtype``) ``Gemm`` with a bias
row as the GPT-2 exports write them once lowered: c_attn 768 -> 2304 (its first 768 columns
go on, a Slice standing in for the attention), attn c_proj 768 -> 768, c_fc 768 -> 3072 and its
tanh Gelu, mlp c_proj 3072 -> 768. Run as ORT CUDA's ``Gemm`` (``BroadcastBiasKernel`` then the
GEMM with beta = 1) and with the rule applied alone (``GemmBias``: one cuBLASLt matmul with the
bias epilogue); ``--gelu`` also folds each fc's Gelu into its GEMM (the opt-in
``gemm_bias_gelu``: ``GemmBiasGelu``, cuBLASLt's GELU_AUX_BIAS, the GELU input still written). The weights and the input are float32 graph inputs cast once per run (numpy has no
bfloat16 to bind), the same in both graphs; the difference of the two times is what the rule
saves, for GPT-2 small's 48 forward linear layers at the default ``--layers 12``. Median of
``--rounds`` rounds of ``--iters`` runs, inputs and outputs on the device (IOBinding); the
outputs of both compared.

    python3 benchmarks/gemm_bias_ab.py                  # the GPU machine, onnxruntime-gpu
    python3 benchmarks/gemm_bias_ab.py --dtype fp16
    python3 benchmarks/gemm_bias_ab.py --gelu
    python3 benchmarks/gemm_bias_ab.py --provider cpu --dtype fp16 --rows 16 --layers 1   # here: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from ort_timing import time_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph.lowering.build import cublaslt_flags  # noqa: E402
from mpgraph.lowering.gemm_bias import fuse_gemm_bias, fuse_gemm_bias_gelu  # noqa: E402
from mpgraph.lowering.plan import has_gemm_bias, library  # noqa: E402

WIDTH = 768
#: GPT-2 small's linear layers in a block: (name, in, out).
LINEARS = (("c_attn", WIDTH, 3 * WIDTH), ("attn_proj", WIDTH, WIDTH), ("c_fc", WIDTH, 4 * WIDTH),
           ("mlp_proj", 4 * WIDTH, WIDTH))
DTYPES = {"bf16": T.BFLOAT16, "fp16": T.FLOAT16}


def chain(rows: int, layers: int, dtype: int) -> ir.Model:
    """``y = float(block^layers(low(x)))``, each block the four linear layers (weights shared
    across blocks: the same Gemms, other activations)."""
    n = h.make_node
    nodes = [n("Cast", ["x"], ["h0"], to=dtype)]
    nodes += [n("Cast", [f"{name}_{p}"], [f"{name}_{p}_low"], to=dtype) for name, _, _ in LINEARS for p in "wb"]
    for name, value in (("start", 0), ("end", WIDTH), ("axis", 1)):
        nodes.append(n("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array([value], np.int64))))
    last = "h0"
    for layer in range(layers):
        for name, _, _ in LINEARS:
            out = f"l{layer}_{name}"
            nodes.append(n("Gemm", [last, f"{name}_w_low", f"{name}_b_low"], [out], name=out))
            last = out
            if name == "c_attn":
                nodes.append(n("Slice", [out, "start", "end", "axis"], [f"{out}_q"]))
                last = f"{out}_q"
            if name == "c_fc":
                nodes.append(n("Gelu", [out], [f"{out}_gelu"], approximate="tanh"))
                last = f"{out}_gelu"
    nodes.append(n("Cast", [last], ["y"], to=T.FLOAT))
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [rows, WIDTH])]
    for name, fan_in, fan_out in LINEARS:
        inputs += [h.make_tensor_value_info(f"{name}_w", T.FLOAT, [fan_in, fan_out]),
                   h.make_tensor_value_info(f"{name}_b", T.FLOAT, [fan_out])]
    graph = h.make_graph(nodes, "linears", inputs, [h.make_tensor_value_info("y", T.FLOAT, [rows, WIDTH])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    model.ir_version = 9
    return ir.from_proto(onnx.shape_inference.infer_shapes(model, strict_mode=True))


def feeds(rows: int) -> dict[str, np.ndarray]:
    """Weights N(0, 1/fan_in) and biases N(0, 0.1): the activations stay near unit scale."""
    rng = np.random.default_rng(0)
    out = {"x": rng.standard_normal((rows, WIDTH)).astype(np.float32)}
    for name, fan_in, fan_out in LINEARS:
        out[f"{name}_w"] = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
        out[f"{name}_b"] = (0.1 * rng.standard_normal(fan_out)).astype(np.float32)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--rows", type=int, default=8 * 1024, help="tokens (GPT-2 small at batch 8: 8192)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--gelu", action="store_true", help="also fold each fc's tanh Gelu (GemmBiasGelu)")
    args = parser.parse_args(argv)
    custom_ops = str(library(args.provider))
    if args.provider == "cuda" and not has_gemm_bias(custom_ops):
        raise SystemExit(f"the kernel library has no CUDA GemmBias: {cublaslt_flags()[1]}")
    plain = chain(args.rows, args.layers, DTYPES[args.dtype])
    fused = chain(args.rows, args.layers, DTYPES[args.dtype])
    rewritten = fuse_gemm_bias(fused)
    assert rewritten == 4 * args.layers, rewritten
    if args.gelu:
        os.environ["MPGRAPH_GEMM_GELU"] = "1"
        assert fuse_gemm_bias_gelu(fused) == args.layers
    data = feeds(args.rows)
    print(f"# gemm_bias_ab.py --provider {args.provider} --dtype {args.dtype} --rows {args.rows} --layers {args.layers}"
          f"{' --gelu' if args.gelu else ''}, "
          f"onnxruntime {ort.__version__}, median of {args.rounds} x {args.iters}")
    t_plain, out_plain = time_graph(ir.to_proto(plain).SerializeToString(), args.provider, data, args.rounds, args.iters)
    t_fused, out_fused = time_graph(ir.to_proto(fused).SerializeToString(), args.provider, data, args.rounds, args.iters,
                                    custom_ops)
    y_plain, y_fused = out_plain["y"], out_fused["y"]
    worst = float(np.max(np.abs(y_fused - y_plain)) / np.max(np.abs(y_plain)))
    print(f"{rewritten} linear layers: Gemm {t_plain:.3f} ms, GemmBias{'(+Gelu)' if args.gelu else ''} {t_fused:.3f} ms; saves {t_plain - t_fused:.3f} ms "
          f"({(t_plain - t_fused) / rewritten * 1e3:.1f} us a layer), {t_fused / t_plain:.3f}x; "
          f"output equal in {float(np.mean(y_fused == y_plain)):.2%} of elements, worst |fused - plain| / max {worst:.2g}")


if __name__ == "__main__":
    main()
