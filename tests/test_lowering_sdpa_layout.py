"""The ``sdpa_layout`` lowering rule: fused attention reads and writes ``[B, S, H * D]`` directly.

On the zoo GPT's canonicalised step (its shapes fixed, as in a CUDA-graph session) (eager attention, exported 4-D: per layer the exporter's
reshape + transpose of Q, K, V and back, and autodiff's mirror of each), lowered on ORT CPU
with the library's float32 reference kernels: the rule removes every transpose around the fused
attention, and the step computes bit for bit what it computes with the 4-D fused attention.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph.lowering import DOMAIN, library
from mpgraph.lowering.attention import fuse_attention
from mpgraph.lowering.registry import RULES, Exactness
from mpgraph.lowering.sdpa_layout import read_heads_in_place
from mpgraph.lowering.specialize import specialize_shapes
from mpgraph.training import build_training_graph

GPT = "models/onnx/gpt.loss.onnx"


@pytest.fixture(scope="module")
def fused() -> ir.Model:
    """The zoo GPT's AdamW step with its attention canonicalised and fused (4-D), its shapes
    fixed as a CUDA-graph session's are (the shape arithmetic folded)."""
    step = build_training_graph(GPT, optimizer="adamw", lr=1e-2, canonicalize=True)
    step = specialize_shapes(step, {"tokens": [3, 16], "label": [3, 16]})
    assert fuse_attention(step, "cpu") == 2
    return step


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _run(model: ir.Model, feeds: dict) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(library("cpu")))
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _near_attention(model: ir.Model) -> Counter:
    """Transposes that read or feed a fused attention op, through at most one Reshape."""
    found: Counter = Counter()
    for node in model.graph:
        if node.op_type != "Transpose":
            continue
        ends = [node.inputs[0].producer()] + [u for v in node.outputs for u, _ in v.uses()]
        for end in list(ends):
            if end is not None and end.op_type == "Reshape":
                ends += [end.inputs[0].producer()] + [u for v in end.outputs for u, _ in v.uses()]
        if any(e is not None and e.domain == DOMAIN and e.op_type.startswith("Sdpa") for e in ends):
            found[node.name] += 1
    return found


def test_registered_bit_identical_after_sdpa() -> None:
    names = [r.name for r in RULES]
    rule = RULES[names.index("sdpa_layout")]
    assert names.index("sdpa") < names.index("sdpa_layout") and rule.exactness is Exactness.BIT_IDENTICAL
    assert rule.runs("cuda", "default") and rule.runs("cpu", "all") and not rule.runs("cpu", "default")


def test_no_transpose_is_left_around_the_fused_attention(fused: ir.Model) -> None:
    before = _near_attention(fused)
    assert len(before) == 16  # per layer: Q, K, V and Y forward, dY, dQ, dK and dV backward
    lowered = _copy(fused)
    assert read_heads_in_place(lowered) == 2
    assert not _near_attention(lowered)
    ops = [n for n in lowered.graph if n.domain == DOMAIN and n.op_type.startswith("Sdpa")]
    assert len(ops) == 4 and all(len(n.inputs[0].shape) == 3 and n.attributes["q_num_heads"].as_int() == 4 for n in ops)
    assert read_heads_in_place(lowered) == 0  # nothing left to rewrite


def test_the_step_computes_the_same_bits(fused: ir.Model) -> None:
    lowered = _copy(fused)
    read_heads_in_place(lowered)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 64, (3, 16)), "label": rng.integers(0, 64, (3, 16))}
    want, got = _run(fused, feeds), _run(lowered, feeds)
    assert want.keys() == got.keys()
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_a_forward_whose_output_is_read_in_4d_is_left_alone(fused: ir.Model) -> None:
    """Both ops or neither: a second reader of ``Y`` in ``[B, H, S, D]`` (here: Y made a
    graph output) keeps the pair 4-D."""
    model = _copy(fused)
    forwards = [n for n in model.graph if n.op_type == "SdpaForward"]
    model.graph.outputs.append(forwards[0].outputs[0])
    assert read_heads_in_place(model) == 1
    assert len(forwards[0].inputs[0].shape) == 4 and forwards[0].graph is not None
