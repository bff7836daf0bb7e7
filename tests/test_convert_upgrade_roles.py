"""convert's opset upgrade (onnx.version_converter) must keep node metadata: the training roles
decide that optimizer nodes stay float32. Without them, bf16 lowered optimizer nodes of the
DQN step graph (opset 18 -> 22 for bf16 Conv)."""

from __future__ import annotations

from pathlib import Path

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.training import build_training_graph

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"


def test_opset_upgrade_keeps_roles_so_the_optimizer_stays_float32():
    step = build_training_graph(ZOO / "dqn_cnn.loss.onnx", optimizer="adamw")
    roles = {n.name: n.metadata_props.get(md.NODE_ROLE) for n in step.graph}
    low = mpgraph.convert(step, "bf16")
    assert md.MODEL_OPSET_UPGRADED in low.metadata_props
    lowered_optimizer = [
        n.name for n in low.graph
        if roles.get(n.name) == "optimizer" and n.metadata_props.get(md.NODE_PRECISION) not in ("float32", "none")
    ]
    assert not lowered_optimizer, lowered_optimizer[:5]
    kept = [n for n in low.graph if n.name in roles and roles[n.name]]
    assert kept and all(n.metadata_props.get(md.NODE_ROLE) == roles[n.name] for n in kept)
