"""mpgraph's fused kernels on a provider: same numbers as the ONNX ops they replace?

Trains the zoo tiny MLP and the zoo GPT (one AdamW slot per tensor, ``pack=False``; float32,
bf16, and fp16 with dynamic loss scaling, once from a scale that overflows) twice on
the provider, with ``Trainer(kernels=False)`` and ``kernels=True``, from the same state on the
same batches (CUDA graphs as the Trainer decides), and prints how many nodes were fused, the
build time, and how far the losses and the final state differ (0 means bit-identical). A
second plain run shows how far two runs of the same graph drift apart on the provider (ORT
CUDA's atomic adds make them differ), the yardstick for the fused run's difference.

    python3 benchmarks/kernels_check.py --provider cuda --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph import lowering as kernels  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def batches(trainer: Trainer, steps: int, batch: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        feed = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else batch for d in spec.shape]
            if spec.dtype.kind == "i":
                feed[spec.name] = rng.integers(0, 2, shape).astype(spec.dtype)
            else:
                feed[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        out.append(feed)
    return out


def layernorm_model(rows: int, cols: int):
    """loss = sum(LayerNorm(x, w, b) * r), x trainable: its gradient graph exercises dx, dscale
    (many 32-row chunks) and dbias at a GPT's size."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(cols).astype(np.float32), n) for n in ("w", "b", "r")]
    inits.append(numpy_helper.from_array(rng.standard_normal((rows, cols)).astype(np.float32), "x"))
    nodes = [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "ln", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def gradient_check(provider: str, rows: int, cols: int) -> None:
    import onnx_ir as ir
    import onnxruntime as ort

    grads = build_training_graph(ir.from_proto(layernorm_model(rows, cols)), optimizer=None)
    lowered = ir.from_proto(ir.to_proto(grads))
    fused = kernels.lower(lowered)
    provider_name = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[provider]
    results = []
    for model, library in ((grads, None), (lowered, str(kernels.library(provider)))):
        options = ort.SessionOptions()
        if library:
            options.register_custom_ops_library(library)
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=[provider_name])
        results.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, {}))))
    worst = max(float(np.max(np.abs(results[1][k].astype(np.float64) - results[0][k]))) / max(float(np.max(np.abs(results[0][k]))), 1e-12)
                for k in results[0])
    print(f"LayerNorm [{rows}, {cols}] gradients: {fused} node fused; worst |fused - plain| / max|plain| over "
          f"{', '.join(results[0])}: {worst:.3g}")


def convert_for(step, spec: str, provider: str):
    """``spec`` is a preset, or ``fp16@<initial loss scale>``; emulated for the CPU provider."""
    import dataclasses

    from mpgraph.convert import convert
    from mpgraph.policy.loader import load_policy

    name, _, init = spec.partition("@")
    policy = load_policy(name)
    if init:
        policy = dataclasses.replace(policy, loss_scaling=dataclasses.replace(policy.loss_scaling, init=float(init)))
    return convert(step, policy, emulate=provider == "cpu", validate=False, calibrate=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    start = time.perf_counter()
    path = kernels.library(args.provider)
    print(f"library {path} ready in {time.perf_counter() - start:.1f} s")
    for rows, cols in ((64, 64), (4096, 1024), (1000, 768)):
        gradient_check(args.provider, rows, cols)
    mlp, gpt = "models/onnx/tiny_mlp.loss.onnx", "models/onnx/gpt.loss.onnx"
    cases = [("tiny MLP", mlp, {}, 64, None), ("tiny MLP bf16", mlp, {"pack": False}, 64, "bf16"),
             ("tiny MLP fp16", mlp, {"pack": False}, 64, "fp16"),
             ("tiny MLP fp16, scale 2^40 (overflow steps)", mlp, {"pack": False}, 64, "fp16@1099511627776"),
             ("zoo GPT, a slot per tensor", gpt, {"pack": False}, 4, None),
             ("zoo GPT bf16", gpt, {"pack": False}, 4, "bf16"), ("zoo GPT fp16", gpt, {"pack": False}, 4, "fp16")]
    for name, model, options, batch, policy in cases:
        step = build_training_graph(os.path.join(ROOT, model), optimizer="adamw", optimizer_options=options,
                                    target=args.provider)
        if policy is not None:
            step = convert_for(step, policy, args.provider)
        results = []
        for fused in (False, True, False):
            trainer = Trainer(step, args.provider, kernels=fused)
            feeds = batches(trainer, args.steps, batch)
            steps = [trainer.step(f, lr=1e-3) for f in feeds]
            losses = [float(r.loss) for r in steps]
            results.append((losses, trainer.state, trainer.kernels_fused, trainer.cuda_graph, sum(r.skipped for r in steps)))
        (l0, s0, _, g0, k0), (l1, s1, n1, g1, k1), (l2, s2, _, _, _) = results

        def diff(la, sa, lb, sb):
            loss = max(abs(a - b) if np.isfinite(a) or np.isfinite(b) else 0.0 for a, b in zip(la, lb))
            state = max(float(np.max(np.abs(sa[k].astype(np.float64) - sb[k]))) if sa[k].size else 0.0 for k in sa)
            return loss, state, all(np.array_equal(sa[k], sb[k], equal_nan=True) for k in sa)

        print(f"{name}: {n1} rewrites; cuda graph {g0}/{g1}; {args.steps} steps: loss {l0[-1]:.8f} (plain) "
              f"{l1[-1]:.8f} (fused) {l2[-1]:.8f} (plain again); skipped steps {k0} (plain) {k1} (fused)")
        for label, (la, sa, lb, sb) in (("fused vs plain", (l0, s0, l1, s1)), ("plain vs plain again", (l0, s0, l2, s2))):
            loss, state, same = diff(la, sa, lb, sb)
            print(f"  {label:<22} max |loss diff| {loss:.3g}, max |state diff| {state:.3g}, bit-identical state: {same}")


if __name__ == "__main__":
    main()
