"""The fp16 range check and values that are infinite in float32 already.

Attention's ``masked_fill(~causal, -inf)`` makes ``-inf`` scores by design. ``-inf`` is
``-inf`` in float16 too, so lowering cannot overflow it; the range check used to read
``|x| = inf`` as an overflow and keep the whole attention path float32 (the zoo GPT's
masked fill and softmax under ``--policy fp16``). Both ways of measuring (arrays back to
numpy, and reductions added to the graph for large models) must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.runtime import probe
from tests.helpers import h, init, make_model, run, vi


def _masked_attention(big: float) -> object:
    """``softmax(where(causal, s * scale, -inf)) @ v`` with scores scaled by ``scale``."""
    t = 4
    causal = np.tril(np.ones((t, t), dtype=bool))
    nodes = [
        h.make_node("MatMul", ["q", "k"], ["s"], name="allow1"),
        h.make_node("Mul", ["s", "scale"], ["ss"], name="infer1"),
        h.make_node("Where", ["causal", "ss", "ninf"], ["masked"], name="masked_fill"),
        h.make_node("Softmax", ["masked"], ["p"], axis=-1, name="deny1"),
        h.make_node("MatMul", ["p", "v"], ["y"], name="allow2"),
    ]
    inits = [init("causal", causal), init("ninf", np.float32(-np.inf)), init("scale", np.float32(big))]
    return make_model(nodes, [vi("q", [2, t, 8]), vi("k", [2, 8, t]), vi("v", [2, t, 8])], [vi("y", [2, t, 8])], inits)


def _decisions(model: object) -> dict[str, str]:
    return {n.name: n.metadata_props[md.NODE_PRECISION] for n in model.graph}


@pytest.mark.parametrize("in_graph", [False, True], ids=["numpy", "in-graph"])
def test_minus_inf_of_a_masked_fill_is_no_overflow(monkeypatch: pytest.MonkeyPatch, in_graph: bool) -> None:
    if in_graph:
        monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    got = _decisions(mpgraph.convert(_masked_attention(1.0), "fp16", emulate=True))
    assert got["masked_fill"] == "float16"
    assert got["deny1"] == "float16"  # the softmax between low ops takes float16 I/O


@pytest.mark.parametrize("in_graph", [False, True], ids=["numpy", "in-graph"])
def test_finite_overflow_next_to_minus_inf_is_still_caught(monkeypatch: pytest.MonkeyPatch, in_graph: bool) -> None:
    if in_graph:
        monkeypatch.setattr(probe, "MATERIALIZE_BYTES", 0)
    model = _masked_attention(1e6)  # scores far beyond float16's 65504, beside the -inf ones
    got = _decisions(mpgraph.convert(model, "fp16", emulate=True))
    assert got["infer1"] == "float32" and got["masked_fill"] == "float32"
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("q", (2, 4, 8)), ("k", (2, 8, 4)), ("v", (2, 4, 8)))}
    assert np.isfinite(run(mpgraph.convert(_masked_attention(1e6), "fp16", emulate=True), feeds)[0]).all()
