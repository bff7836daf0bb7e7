"""The CPU lowerings built on the library's ``Permute`` (``mpgraph.lowering.permute``,
``nchwc._phase_conv``, ``slices_dw``): ``Permute`` against numpy's transpose bit for bit (merged
axes, size-1 and empty axes, reversed axes folded from a flip), which transposes it takes and
which it leaves to ORT, strided ``ConvTranspose`` as a phase Conv against ORT's, the per-tap
slices weight gradient rebuilt as one Conv against the slices, and the DQN's step with all of
it against the step without ``Permute`` (a copy: the same bits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mpgraph import lowering as kernels
from mpgraph.lowering.nchwc import MIN_PHASE_OUTPUTS, to_nchwc
from mpgraph.lowering.permute import fast_transposes
from mpgraph.lowering.slices_dw import slices_to_conv
from mpgraph.runtime.probe import nchwc_block
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.helpers import random_batches, run_cpu

ROOT = Path(__file__).resolve().parents[1]
DQN = ROOT / "models/onnx/dqn_cnn.loss.onnx"

needs_nchwc = pytest.mark.skipif(nchwc_block() == 0, reason="ORT has no NCHWc kernels on this CPU")


def _model(nodes: list, inputs: list, initializers: list | None = None) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializers or [])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    return ir.from_proto(proto)


def _run(model: ir.Model, feeds: dict) -> np.ndarray:
    return run_cpu(model, feeds, library=True)


def _transpose(shape: list, perm: list | None, flip: list | None = None, dtype=TensorProto.FLOAT) -> ir.Model:
    nodes, source, inits = [], "x", []
    if flip:
        inits = [helper.make_tensor(n, TensorProto.INT64, [len(flip)], v)
                 for n, v in (("s", [-1] * len(flip)), ("e", [-(2**62)] * len(flip)), ("a", flip), ("k", [-1] * len(flip)))]
        nodes.append(helper.make_node("Slice", ["x", "s", "e", "a", "k"], ["flipped"]))
        source = "flipped"
    attrs = {"perm": perm} if perm is not None else {}
    nodes.append(helper.make_node("Transpose", [source], ["y"], **attrs))
    return _model(nodes, [helper.make_tensor_value_info("x", dtype, shape)], inits)


PERMUTES = [
    # (name, shape, perm, flipped axes)
    ("the NCHWc filter reorder", [8, 8, 4, 8, 9, 9], [0, 2, 4, 5, 3, 1], None),
    ("the phase interleave", [3, 8, 2, 2, 5, 6], [0, 1, 4, 2, 5, 3], None),
    ("axes reversed, no perm attribute", [4, 5, 6], None, None),
    ("NCHW to NHWC", [2, 16, 7, 7], [0, 2, 3, 1], None),
    ("size-1 axes", [1, 5, 1, 3], [3, 2, 1, 0], None),
    ("an empty axis", [0, 3, 4, 2], [2, 0, 3, 1], None),
    ("a flip folded, channels swapped", [6, 4, 3, 3], [1, 0, 2, 3], [2, 3]),
    ("a flip folded, phases stacked", [4, 8, 2, 2, 2, 2], [1, 3, 5, 0, 2, 4], [2, 4]),
    ("a flip of a negative axis", [3, 4, 5], [2, 1, 0], [-1]),
    ("a flip between kept axes: no merge across directions", [3, 4, 5], [0, 1, 2], [1]),
]


@pytest.mark.parametrize("name,shape,perm,flip", PERMUTES, ids=[c[0] for c in PERMUTES])
def test_permute_is_numpys_transpose_bit_for_bit(name, shape, perm, flip):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    model = _transpose(shape, perm, flip)
    assert fast_transposes(model) == 1
    assert [n.op_type for n in model.graph] == ["Permute"]  # the flip's Slice folded in
    expected = x if not flip else np.flip(x, axis=tuple(flip))
    np.testing.assert_array_equal(_run(model, {"x": x}), np.transpose(expected, perm))


def test_permute_takes_only_what_ort_copies_element_by_element():
    """Whole-row moves (the innermost axis stays last), 2-D transposes, transposes a matmul
    reads and non-float tensors stay ORT's ``Transpose``."""
    for shape, perm in (([32, 4, 8, 8], [1, 0, 2, 3]), ([16, 9], [1, 0]), ([4, 8, 9], [2, 0, 1]), ([5], [0])):
        assert fast_transposes(_transpose(shape, perm)) == 0, perm
    assert fast_transposes(_transpose([4, 6, 5], [2, 1, 0], dtype=TensorProto.DOUBLE)) == 0
    into_matmul = _model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
                          helper.make_node("MatMul", ["t", "x"], ["y"])],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 4])])
    assert fast_transposes(into_matmul) == 0


def test_permute_refuses_a_perm_that_is_no_permutation():
    model = _model([helper.make_node("Permute", ["x", "p"], ["y"], domain=kernels.DOMAIN)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor("p", TensorProto.INT64, [2], [0, 0])])
    model.opset_imports[kernels.DOMAIN] = 1
    with pytest.raises(Exception, match="not a permutation"):
        _run(model, {"x": np.zeros([2, 3], np.float32)})


def _convt(xs: list, ws: list, **attrs) -> ir.Model:
    return _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="convt", **attrs)],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs),
                   helper.make_tensor_value_info("w", TensorProto.FLOAT, ws)])


PHASES = [
    # (name, x shape, w shape [in, out, kh, kw], attributes)
    ("the DQN's 4x4/2 data gradient", [4, 64, 9, 9], [64, 32, 4, 4], {"strides": [2, 2]}),
    ("a symbolic batch", ["batch", 64, 9, 9], [64, 32, 4, 4], {"strides": [2, 2]}),
    ("3x3/2: taps padded to the phases, border cropped", [2, 32, 16, 17], [32, 16, 3, 3], {"strides": [2, 2]}),
    ("pads and unequal strides", [2, 32, 13, 21], [32, 16, 5, 3], {"strides": [3, 2], "pads": [2, 1, 1, 0]}),
    ("8x8/4", [2, 16, 6, 6], [16, 32, 8, 8], {"strides": [4, 4]}),
]


@needs_nchwc
@pytest.mark.parametrize("name,xs,ws,attrs", PHASES, ids=[c[0] for c in PHASES])
def test_strided_conv_transpose_as_one_phase_conv(name, xs, ws, attrs):
    rng = np.random.default_rng(3)
    x = rng.standard_normal([d if isinstance(d, int) else 5 for d in xs]).astype(np.float32)
    feeds = {"x": x, "w": rng.standard_normal(ws).astype(np.float32)}
    plain = _run(_convt(xs, ws, **attrs), feeds)
    model = _convt(xs, ws, **attrs)
    assert to_nchwc(model, phases=True, block=nchwc_block()) == 1 and fast_transposes(model) >= 2
    assert not any(n.op_type == "ConvTranspose" for n in model.graph)
    out = _run(model, feeds)
    assert out.shape == plain.shape
    np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@needs_nchwc
def test_phase_conv_leaves_alone_small_maps_bias_and_the_default():
    assert to_nchwc(_convt([2, 64, 9, 9], [64, 32, 4, 4], strides=[2, 2]), block=nchwc_block()) == 0  # phases is opt-in
    small = [2, 16, 5, 6], [16, 8, 3, 3]  # 8 channels of 11x13: under MIN_PHASE_OUTPUTS
    assert 8 * 11 * 13 < MIN_PHASE_OUTPUTS and to_nchwc(_convt(*small, strides=[2, 2]), phases=True, block=nchwc_block()) == 0
    assert to_nchwc(_convt([2, 64, 9, 9], [64, 32, 4, 4], strides=[2, 2], dilations=[2, 2]), phases=True, block=nchwc_block()) == 0
    biased = _model([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2])],
                    [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                     for n, s in (("x", [2, 64, 9, 9]), ("w", [64, 32, 4, 4]), ("b", [32]))])
    assert to_nchwc(biased, phases=True, block=nchwc_block()) == 0


def _slices_dw(taps_order: list | None = None, m: int = 16, cols: list | None = None) -> ir.Model:
    """The Conv rule's per-tap slices weight gradient of a 3x3/1 conv (x [N, 16, 9, 9], dy
    [N, m, 7, 7]), written out as ``pool_conv._slices_weight_grad`` writes it."""
    c, kernel = 16, [3, 3]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["dy"], ["dyn"], perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["dyn", "rows_shape"], ["rows"])]
    inits = [helper.make_tensor("rows_shape", TensorProto.INT64, [2], [-1, m]),
             helper.make_tensor("cols", TensorProto.INT64, [2], cols or [c, -1]),
             helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3]),
             helper.make_tensor("one", TensorProto.INT64, [2], [1, 1]),
             helper.make_tensor("stack", TensorProto.INT64, [3], [9, c, m]),
             helper.make_tensor("dw", TensorProto.INT64, [4], [m, c, *kernel])]
    taps = list(np.ndindex(*kernel))
    for t in taps_order or range(len(taps)):
        i, j = taps[t]
        inits += [helper.make_tensor(f"s{t}", TensorProto.INT64, [2], [i, j]),
                  helper.make_tensor(f"e{t}", TensorProto.INT64, [2], [i + 7, j + 7])]
        nodes += [helper.make_node("Slice", ["xt", f"s{t}", f"e{t}", "axes", "one"], [f"tap{t}"]),
                  helper.make_node("Reshape", [f"tap{t}", "cols"], [f"flat{t}"]),
                  helper.make_node("MatMul", [f"flat{t}", "rows"], [f"part{t}"])]
    nodes += [helper.make_node("Concat", [f"part{t}" for t in taps_order or range(len(taps))], ["parts"], axis=0),
              helper.make_node("Reshape", ["parts", "stack"], ["stacked"]),
              helper.make_node("Transpose", ["stacked"], ["swapped"], perm=[2, 1, 0]),
              helper.make_node("Reshape", ["swapped", "dw"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", c, 9, 9]),
                           helper.make_tensor_value_info("dy", TensorProto.FLOAT, ["batch", m, 7, 7])], inits)
    ir.passes.common.ShapeInferencePass()(model)
    return model


@needs_nchwc
@pytest.mark.parametrize("batch", [32, 3])
def test_slices_weight_gradient_rebuilt_as_one_conv(batch):
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal([batch, 16, 9, 9]).astype(np.float32),
             "dy": rng.standard_normal([batch, 16, 7, 7]).astype(np.float32)}
    plain = _run(_slices_dw(), feeds)
    model = _slices_dw()
    assert slices_to_conv(model, nchwc_block(), 144) == 1
    assert sorted(n.op_type for n in model.graph) == ["Conv", "Transpose", "Transpose", "Transpose"]
    assert to_nchwc(model, block=nchwc_block()) == 1
    np.testing.assert_allclose(_run(model, feeds), plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@needs_nchwc
def test_slices_left_alone_when_the_layout_differs_or_the_conv_would_not_move():
    swapped = [1, 0, 2, 3, 4, 5, 6, 7, 8]  # the Concat's first two parts exchanged: another layout
    assert slices_to_conv(_slices_dw(swapped), nchwc_block(), 144) == 0
    assert slices_to_conv(_slices_dw(m=12), nchwc_block(), 144) == 0  # 12 output channels: off the block
    assert slices_to_conv(_slices_dw(), nchwc_block(), 48) == 0  # 49 taps over max_kernel
    assert slices_to_conv(_slices_dw(cols=[-1, 49]), nchwc_block(), 144) == 0  # another reshape of the taps


@needs_nchwc
def test_dqn_step_is_the_same_bits_with_and_without_permute(monkeypatch):
    """``Permute`` only copies: the CPU default with it and the same lowering with ORT's own
    ``Transpose`` train the zoo DQN to the same bits."""
    step = build_training_graph(DQN, optimizer="adamw", lr=1e-3)
    with_permute = Trainer(step, "cpu", threads=2)
    lowered = ir.from_proto(ir.to_proto(step))
    kernels.lower(lowered, "cpu", "default", nchwc_block=nchwc_block())
    ops = {n.op_type for n in lowered.graph}
    assert "Permute" in ops and "ConvTranspose" not in ops  # the 4x4/2 data gradient went to phases
    monkeypatch.setattr(kernels.registry, "fast_transposes", lambda model: 0)
    without = Trainer(step, "cpu", threads=2)
    assert with_permute.kernels_fused > without.kernels_fused
    batches = random_batches(with_permute, 3, batch=8)
    a = [with_permute.step(batches[i % 3]).loss for i in range(6)]
    b = [without.step(batches[i % 3]).loss for i in range(6)]
    assert a == b
    for name, value in with_permute.state.items():
        np.testing.assert_array_equal(value, without.state[name], err_msg=name)
