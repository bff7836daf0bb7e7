"""``build_training_graph(target=...)``: the per-target gradient forms compute the same gradients."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from mpgraph.errors import GradientError
from mpgraph.training import build_training_graph
from tests.helpers import run_named

ZOO_DIR = Path(__file__).resolve().parents[1] / "models" / "onnx"


def test_cuda_target_uses_im2col_and_matches_the_cpu_forms() -> None:
    path = ZOO_DIR / "dqn_cnn.loss.onnx"
    cpu = build_training_graph(path, optimizer=None)
    cuda = build_training_graph(path, optimizer=None, target="cuda")
    ops = {name: collections.Counter(n.op_type for n in g.graph if n.metadata_props.get("mpgraph.role") == "backward")
           for name, g in (("cpu", cpu), ("cuda", cuda))}
    # The DQN's 8x8/4 layer: single Conv on cpu, SpaceToDepth im2col on cuda; its 3x3/1 layer: Slices on cpu only.
    assert ops["cuda"]["SpaceToDepth"] == 1 and ops["cpu"]["SpaceToDepth"] == 0
    assert ops["cpu"]["Slice"] > 0 and ops["cuda"]["Slice"] == 0
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((4, 4, 84, 84)).astype(np.float32),
            "label": rng.standard_normal((4, 18)).astype(np.float32) * 0.1}
    a, b = run_named(cpu, feed), run_named(cuda, feed)
    assert a.keys() == b.keys() and len(a) > 2
    for key in a:
        scale = float(np.abs(a[key]).max()) or 1.0
        # Measured: 3.7e-7 of a gradient's max at worst (float32 summation order).
        assert float(np.abs(a[key] - b[key]).max()) / scale <= 2e-6, key


def test_unknown_target_is_refused() -> None:
    with pytest.raises(GradientError, match="target must be 'cpu' or 'cuda'"):
        build_training_graph(ZOO_DIR / "dqn_cnn.loss.onnx", target="tpu")
