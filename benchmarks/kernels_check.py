"""mpgraph's fused kernels on a provider: same numbers as the ONNX ops they replace?

Trains the zoo tiny MLP and the zoo GPT (one AdamW slot per tensor, ``pack=False``) twice on
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

from mpgraph import kernels  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    start = time.perf_counter()
    path = kernels.library(args.provider)
    print(f"library {path} ready in {time.perf_counter() - start:.1f} s")
    cases = [("tiny MLP", "models/onnx/tiny_mlp.loss.onnx", {}, 64),
             ("zoo GPT, a slot per tensor", "models/onnx/gpt.loss.onnx", {"pack": False}, 4)]
    for name, model, options, batch in cases:
        step = build_training_graph(os.path.join(ROOT, model), optimizer="adamw", optimizer_options=options,
                                    target=args.provider)
        results = []
        for fused in (False, True, False):
            trainer = Trainer(step, args.provider, kernels=fused)
            feeds = batches(trainer, args.steps, batch)
            losses = [float(trainer.step(f, lr=1e-3).loss) for f in feeds]
            results.append((losses, trainer.state, trainer.kernels_fused, trainer.cuda_graph))
        (l0, s0, _, g0), (l1, s1, n1, g1), (l2, s2, _, _) = results

        def diff(la, sa, lb, sb):
            loss = max(abs(a - b) for a, b in zip(la, lb))
            state = max(float(np.max(np.abs(sa[k].astype(np.float64) - sb[k]))) if sa[k].size else 0.0 for k in sa)
            return loss, state, all(np.array_equal(sa[k], sb[k]) for k in sa)

        print(f"{name}: {n1} nodes fused; cuda graph {g0}/{g1}; {args.steps} steps: loss {l0[-1]:.8f} (plain) "
              f"{l1[-1]:.8f} (fused) {l2[-1]:.8f} (plain again)")
        for label, (la, sa, lb, sb) in (("fused vs plain", (l0, s0, l1, s1)), ("plain vs plain again", (l0, s0, l2, s2))):
            loss, state, same = diff(la, sa, lb, sb)
            print(f"  {label:<22} max |loss diff| {loss:.3g}, max |state diff| {state:.3g}, bit-identical state: {same}")


if __name__ == "__main__":
    main()
