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


def test_target_is_an_argument_of_differentiation() -> None:
    """``differentiate(..., target=)`` picks the Conv weight-gradient form with no module
    switch: two graphs differentiated with different targets, one after the other, each get
    their target's form (an 8x8/4 conv: im2col via SpaceToDepth on cuda, one Conv otherwise)."""
    import onnx_ir as ir

    from mpgraph.autodiff import differentiate
    from mpgraph.autodiff.rules import pool_conv

    def graph() -> tuple[ir.Graph, ir.Value, ir.Value]:
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4, 84, 84]))
        w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([8, 4, 8, 8]))
        conv = ir.node("Conv", [x, w], {"strides": [4, 4], "kernel_shape": [8, 8]}, name="conv")
        conv.outputs[0].name, conv.outputs[0].dtype, conv.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([2, 8, 20, 20])
        total = ir.node("ReduceSum", [conv.outputs[0]], {"keepdims": 0}, name="sum")
        total.outputs[0].name, total.outputs[0].dtype, total.outputs[0].shape = "loss", ir.DataType.FLOAT, ir.Shape([])
        return ir.Graph([x, w], [total.outputs[0]], nodes=[conv, total], opset_imports={"": 18}), total.outputs[0], w

    def packed(target: str | None) -> int:
        g, loss, w = graph()
        differentiate(g, loss, [w], opset=18, target=target)
        return sum(n.op_type == "SpaceToDepth" for n in g)

    assert pool_conv.WEIGHT_GRAD_FORM is None
    assert (packed("cuda"), packed(None), packed("cuda"), packed("cpu")) == (1, 0, 1, 0)
