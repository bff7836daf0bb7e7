#!/usr/bin/env bash
# The examples of docs/numerics.md, run for real: audit --memory, advise-scale, compare on step
# graphs, tune. Output: benchmarks/results/numerics_examples.txt
#   OMP_NUM_THREADS=1 bash benchmarks/numerics_examples.sh > benchmarks/results/numerics_examples.txt 2>&1
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
MPGRAPH="$ROOT/.venv/bin/mpgraph"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export COLUMNS=120
say() { echo; echo "\$ $*"; "$@"; }

# Files the examples use: the underflow model (gradients ~1e-8), a batch for it, the zoo GPT with
# one planted overflowing MatMul (blocks.0.out's weight x 1e5), and a policy without loss scaling.
ROOT="$ROOT" PYTHONPATH="$ROOT" "$PY" - <<'EOF'
import os
import numpy as np, onnx
from onnx import numpy_helper
from models.underflow import underflow_model
onnx.save(underflow_model(16, 4), "underflow.onnx")
rng = np.random.default_rng(0)
np.savez("batches.npz", x=rng.standard_normal((24, 16)).astype(np.float32), t=rng.standard_normal((24, 4)).astype(np.float32))
np.savez("batch.npz", x=rng.standard_normal((8, 16)).astype(np.float32), t=rng.standard_normal((8, 4)).astype(np.float32))
gpt = onnx.load(os.path.join(os.environ["ROOT"], "models/onnx/gpt.onnx"))
for init in gpt.graph.initializer:
    if init.name == "blocks.0.out.weight":
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1e5), init.name))
onnx.save(gpt, "gpt_planted.onnx")
np.savez("tokens.npz", tokens=np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int64))
EOF
printf 'extends: fp16\nloss_scaling: {mode: none}\n' > fp16-noscale.yaml

say "$MPGRAPH" audit "$ROOT/models/onnx/gpt.loss.onnx" --memory --batch 8 --policy bf16
say "$MPGRAPH" audit "$ROOT/models/onnx/tiny_mlp.loss.onnx" --memory --batch 64 --policy bf16 --optimizer adamw

say "$MPGRAPH" train-graph underflow.onnx --optimizer sgd --lr 1 -o underflow.step.onnx
say "$MPGRAPH" advise-scale underflow.step.onnx --data batches.npz --batches 3

say "$MPGRAPH" convert underflow.step.onnx --policy fp16-noscale.yaml --emulate -o underflow.noscale.onnx
say "$MPGRAPH" compare underflow.step.onnx underflow.noscale.onnx --inputs batch.npz --html underflow.html
say "$MPGRAPH" convert underflow.step.onnx --policy fp16 --emulate -o underflow.fp16.onnx
say "$MPGRAPH" compare underflow.step.onnx underflow.fp16.onnx --inputs batch.npz

say "$MPGRAPH" tune gpt_planted.onnx --policy fp16 --objective output:2e-3 --inputs tokens.npz -o gpt_planted.tuned.yaml
say cat gpt_planted.tuned.yaml
