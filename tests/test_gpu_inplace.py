"""In-place state updates on ORT CUDA (``Trainer(inplace_state=True)``), captured as CUDA graphs:
one device buffer per state value, and the same bits as two buffer sets after 4 AdamW steps
(``deterministic=True``, so that the two trainers' reductions add in the same order). Marked
``gpu``: skipped without CUDA or onnxruntime-gpu."""

from __future__ import annotations

import numpy as np
import pytest

import mpgraph

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu's CUDAExecutionProvider")
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_in_place_cuda_steps_equal_two_sets(policy):
    from mpgraph.runtime.trainer import Trainer

    step = mpgraph.build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    step = step if policy is None else mpgraph.convert(step, policy)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((64, 4)).astype(np.float32), "label": rng.integers(0, 2, 64)}
               for _ in range(4)]
    runs = {}
    for inplace in (False, True):
        trainer = Trainer(step, "cuda", inplace_state=inplace, deterministic=True, tf32=False)
        losses = [trainer.step(b).loss for b in batches]
        sets = trainer.executor.sets
        shared = {n for n, _ in trainer.pairs if sets[0][n].data_ptr() == sets[1][n].data_ptr()}
        assert trainer.cuda_graph, trainer.cuda_graph_reason
        assert trainer.provider_options["arena_extend_strategy"] == "kSameAsRequested"
        assert shared == set(trainer.inplace) and (len(shared) == len(trainer.pairs) - 1 if inplace else not shared)
        runs[inplace] = (losses, trainer.state)
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        assert np.array_equal(runs[True][1][name], value), name
