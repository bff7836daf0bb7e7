"""Emulated fp8 (the ``fp8`` preset on ORT CPU) trains as well as bf16: the digits MLP and the zoo GPT.

Same step graph, weights, data order, learning rate and steps on both sides; only the policy
differs. Measured here (ORT 1.32 CPU, one thread): digits MLP, 250 AdamW steps of 64: test
accuracy 96.66% for both; zoo GPT, 100 steps of 16 sequences: mean loss of the last 10 steps
3.4374 (bf16) and 3.4393 (fp8), 0.06% apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.data import dataset_for_model
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _quantised_tensors(model) -> list[dict[str, object]]:
    return json.loads(model.metadata_props[md.MODEL_FP8])["tensors"]


@pytest.mark.slow
def test_digits_mlp_fp8_accuracy_within_one_point_of_bf16(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    bench = load_benchmark("train_digits")
    loss_model = bench.export("mlp", str(tmp_path))
    runs = {policy: bench.train(loss_model, "mlp", policy, steps=250, batch=64, threads=1) for policy in ("bf16", "fp8")}
    bf16, fp8 = runs["bf16"], runs["fp8"]
    assert abs(fp8.accuracy - bf16.accuracy) <= 0.01, (fp8.accuracy, bf16.accuracy)
    assert fp8.accuracy > 0.93
    assert np.isfinite(fp8.metrics.loss).all() and fp8.metrics.loss[-1] < 0.1 * fp8.metrics.loss[0]
    # Really fp8: the same batches give other losses than bf16.
    assert np.abs(np.asarray(fp8.metrics.loss) - np.asarray(bf16.metrics.loss)).max() > 0


def test_zoo_gpt_fp8_loss_within_two_percent_of_bf16() -> None:
    steps, losses = 100, {}
    for policy in ("bf16", "fp8"):
        step = build_training_graph(ROOT / "models" / "onnx" / "gpt.loss.onnx", optimizer="adamw", lr=3e-3)
        step = mpgraph.convert(step, policy, emulate=True)
        if policy == "fp8":
            tensors = _quantised_tensors(step)
            # Every product's operands: 13 forward products, 26 tensors forward, 13 gradients.
            assert len(tensors) == 39 and sum(t["kind"] == "gradient" for t in tensors) == 13
        trainer = Trainer(step, provider="cpu", threads=1)
        data = dataset_for_model("sequence", trainer.data_inputs, size=1024)
        losses[policy] = np.asarray(trainer.fit(data, steps=steps, batch_size=16, seed=0).loss)
    bf16, fp8 = losses["bf16"], losses["fp8"]
    assert np.isfinite(fp8).all() and fp8[-10:].mean() < 0.85 * fp8[0]  # it learns
    assert abs(fp8[-10:].mean() - bf16[-10:].mean()) <= 0.02 * bf16[-10:].mean(), (fp8[-10:].mean(), bf16[-10:].mean())
    assert np.abs(fp8 - bf16).max() > 0
