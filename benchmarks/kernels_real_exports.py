"""mpgraph's kernel lowering on exports of models we did not write, on ORT's CPU provider.

For transformers' GPT-2, BERT and ViT (random init from small configs, tests/corpus/models.py),
exported with both torch exporters: what the whole lowering (``kernels.lower``, as the CUDA
Trainer runs it, here with the CPU provider's float32 kernels) makes of the gradient graph (the
non-ONNX ops it writes, by op; transposes and scales folded) and how many AdamW slots it fuses in
the step graph, and how far the lowered gradient graph's gradients are from the plain one's. Gradients
that are zero in exact arithmetic (an attention key's bias: softmax ignores a shift; 1e-13 of
rounding noise here) have no scale of their own: they are reported apart, against the model's
largest gradient.

    python3 benchmarks/kernels_real_exports.py
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpgraph import lowering as kernels  # noqa: E402
from mpgraph.lowering.fuse import fuse_adamw  # noqa: E402
from mpgraph.lowering.transpose import fold_scales, fold_transposes  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402
from tests.corpus import check, models  # noqa: E402

#: The ops the lowering writes are counted by what it writes (every op outside the ONNX
#: domain that the lowered graph has more of): mpgraph's kernels (LayerNormGrad, ErfGeluGrad,
#: SoftmaxGradDot, ...) and ORT's contrib ops (FusedMatMul). The forward GELU is not among
#: them: it is the canonical ONNX ``Gelu`` (CanonicalizeOpsPass), which ORT runs.
ONNX_DOMAINS = ("", "ai.onnx")


def custom_ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph if n.domain not in ONNX_DOMAINS)


def run(model: ir.Model, library: str | None, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if library:
        options.register_custom_ops_library(library)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def main() -> None:
    library = str(kernels.library("cpu"))
    for name in ("gpt2", "bert", "vit"):
        case = models.build(name)
        for exporter in check.EXPORTERS:
            exported = check.export(case, exporter)
            grads = build_training_graph(ir.from_proto(exported.model), optimizer=None)
            step = build_training_graph(ir.from_proto(exported.model), optimizer="adamw", optimizer_options={"pack": False})
            norms = sum(1 for n in grads.graph if n.op_type == "LayerNormalization" and len(n.outputs) == 3)
            lowered = ir.from_proto(ir.to_proto(grads))
            kernels.lower(lowered, "cpu")
            made = custom_ops(lowered) - custom_ops(grads)
            gelus = sum(1 for n in grads.graph if n.op_type == "Gelu" and n.domain in ONNX_DOMAINS)
            alone = ir.from_proto(ir.to_proto(grads))
            folded = fold_transposes(alone, "cpu")
            scales = fold_scales(alone, "cpu")
            fused_norms = made["LayerNormGrad"] + made["LayerNormGradBias"]
            slots = sum(1 for v in step.graph.inputs if (v.name or "").startswith("optim/") and v.name.endswith("/m"))
            fused_slots = fuse_adamw(step)
            feeds = {n: t.numpy() for n, t in zip(case.input_names, case.inputs, strict=True)}
            plain, fused = run(grads, None, feeds), run(lowered, library, feeds)
            top = max(float(np.max(np.abs(v))) for v in plain.values() if v.size)
            scaled, zero = 0.0, 0.0
            for key, value in plain.items():
                if not value.size:
                    continue
                diff = float(np.max(np.abs(fused[key].astype(np.float64) - value)))
                own = float(np.max(np.abs(value)))
                if own < 1e-9 * top:
                    zero = max(zero, diff / top)
                else:
                    scaled = max(scaled, diff / own)
            ops = ", ".join(f"{op} {count}" for op, count in sorted(made.items()) if not op.startswith("LayerNorm"))
            print(f"{name:5s} {exporter:11s} LayerNorm backwards fused {fused_norms}/{norms} ({made['LayerNormGradBias']} with "
                  f"dbias), {ops or 'no other fused op'} (forward Gelu, ORT's: {gelus}), transposes folded {folded}, "
                  f"power-of-two scales folded {scales}; AdamW slots "
                  f"fused {fused_slots}/{slots}; worst |fused - plain| / max|plain| {scaled:.2g}; zero gradients "
                  f"{zero:.2g} of the largest gradient")


if __name__ == "__main__":
    main()
