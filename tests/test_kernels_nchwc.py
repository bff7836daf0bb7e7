"""Convolutions on ORT CPU's NCHWc kernels (``mpgraph.lowering.nchwc``): the block probe, the
rewrite's results against the plain ``Conv`` for every shape class it takes (first layer,
blocked channels, channels it pads, the weight gradient's symbolic batch), the convolutions it
must leave alone, and a DQN trained through the ``Trainer`` with and without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mpgraph import lowering as kernels
from mpgraph.lowering.nchwc import NCHWC_DOMAIN, to_nchwc
from mpgraph.runtime.probe import nchwc_block
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph
from tests.helpers import run_cpu

ROOT = Path(__file__).resolve().parents[1]
DQN = ROOT / "models/onnx/dqn_cnn.loss.onnx"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _expected_block() -> int | None:
    flags = _cpu_flags()
    if not flags:
        return None
    return 16 if "avx512f" in flags else 8 if "avx2" in flags and "fma" in flags else 0


needs_nchwc = pytest.mark.skipif(nchwc_block() == 0, reason="ORT has no NCHWc kernels on this CPU")


def test_block_size_is_the_machines():
    """AVX-512 machines block channels by 16, AVX2 by 8 (MLAS's choice, found by the probe)."""
    expected = _expected_block()
    if expected is None:
        pytest.skip("no /proc/cpuinfo here")
    assert nchwc_block() == expected


def _conv_model(x_shape: list, w_shape: list, bias: bool, **attrs) -> ir.Model:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)]
    if bias:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [w_shape[0]]))
    node = helper.make_node("Conv", [i.name for i in inputs], ["y"], name="conv", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return ir.from_proto(model)


def _run(model: ir.Model, feeds: dict) -> np.ndarray:
    return run_cpu(model, feeds)


CASES = [
    # (name, x shape, w shape, bias, attributes)
    ("first layer, 4 channels, 8x8/4", [3, 4, 36, 36], [32, 4, 8, 8], True, {"strides": [4, 4]}),
    ("blocked channels, 4x4/2", [2, 32, 20, 20], [64, 32, 4, 4], True, {"strides": [2, 2]}),
    ("blocked, padded 3x3", [2, 16, 9, 9], [16, 16, 3, 3], False, {"pads": [1, 1, 1, 1]}),
    ("20 channels: padded to the block", [2, 20, 7, 7], [16, 20, 3, 3], True, {}),
    ("dilated, as a weight gradient", [3, 16, 13, 13], [32, 16, 5, 5], False, {"dilations": [2, 2]}),
    # kh != kw: on a square kernel, swapping the filter's two spatial axes changes nothing
    ("non-square 3x5, unequal strides and pads", [2, 16, 11, 13], [16, 16, 3, 5], True,
     {"strides": [1, 2], "pads": [1, 2, 0, 1]}),
    ("first layer, non-square 2x4/2", [2, 3, 12, 14], [16, 3, 2, 4], False, {"strides": [2, 2]}),
    ("20 channels, non-square 1x3", [2, 20, 7, 9], [16, 20, 1, 3], True, {}),
]


@needs_nchwc
@pytest.mark.parametrize("name,xs,ws,bias,attrs", CASES, ids=[c[0] for c in CASES])
def test_rewrite_computes_the_plain_conv(name, xs, ws, bias, attrs):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(ws[0]).astype(np.float32)
    plain = _run(_conv_model(xs, ws, bias, **attrs), feeds)
    model = _conv_model(xs, ws, bias, **attrs)
    assert to_nchwc(model, block=nchwc_block()) == 1
    assert [n.op_type for n in model.graph if n.domain == NCHWC_DOMAIN][-2:] == ["Conv", "ReorderOutput"]
    out = _run(model, feeds)
    assert out.shape == plain.shape
    np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@needs_nchwc
@pytest.mark.parametrize("batch", [32, 5, 1])
def test_weight_gradient_conv_over_a_symbolic_batch(batch):
    """The weight gradient's Conv reads the batch as its input channels; a symbolic batch is
    padded with zero channels to the block at run time, any batch size gives the plain result."""
    xs, dys = ["batch", 8, 20, 20], ["batch", 16, 9, 9]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
             helper.make_node("Conv", ["xt", "dyt"], ["dwt"], dilations=[2, 2], name="dw")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs),
                                           helper.make_tensor_value_info("dy", TensorProto.FLOAT, dys)],
                              [helper.make_tensor_value_info("dwt", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal([batch, 8, 20, 20]).astype(np.float32),
             "dy": rng.standard_normal([batch, 16, 9, 9]).astype(np.float32)}
    model = ir.from_proto(proto)
    ir.passes.common.ShapeInferencePass()(model)
    plain = _run(ir.from_proto(proto), feeds)
    assert to_nchwc(model, block=nchwc_block()) == 1
    assert any(n.op_type == "Pad" for n in model.graph)
    np.testing.assert_allclose(_run(model, feeds), plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@needs_nchwc
def test_leaves_alone_what_it_cannot_or_should_not_take():
    """Grouped, output channels off the block, a constant weight (ORT's own transformer takes
    it), more taps than ``max_kernel``, an explicit auto_pad: no rewrite."""
    assert to_nchwc(_conv_model([1, 16, 9, 9], [16, 8, 3, 3], False, group=2), block=nchwc_block()) == 0
    assert to_nchwc(_conv_model([1, 16, 9, 9], [20, 16, 3, 3], False), block=nchwc_block()) == 0  # off both blocks, 8 and 16
    assert to_nchwc(_conv_model([1, 16, 30, 30], [16, 16, 13, 13], False), block=nchwc_block()) == 0
    assert to_nchwc(_conv_model([1, 16, 30, 30], [16, 16, 13, 13], False), max_kernel=169, block=nchwc_block()) == 1
    assert to_nchwc(_conv_model([1, 16, 9, 9], [16, 16, 3, 3], False, auto_pad="SAME_UPPER"), block=nchwc_block()) == 0
    const = _conv_model([1, 16, 9, 9], [16, 16, 3, 3], False)
    w = const.graph.inputs.pop()
    w.const_value = ir.tensor(np.ones([16, 16, 3, 3], np.float32))
    const.graph.register_initializer(w)
    assert to_nchwc(const, block=nchwc_block()) == 0
    assert to_nchwc(_conv_model([1, 16, 9, 9], [16, 16, 3, 3], False), block=0) == 0


@needs_nchwc
def test_dqn_trains_the_same_with_the_cpu_default():
    """The zoo DQN through the CPU Trainer: the default lowering (NCHWc convolutions, the fused
    AdamW and Relu backward) against none, 10 steps on the same batches: the convolutions sum
    in another order, so the losses agree to float32 rounding, not bit for bit."""
    step = build_training_graph(DQN, optimizer="adamw", lr=1e-3)
    default, plain = Trainer(step, "cpu", threads=2), Trainer(step, "cpu", threads=2, kernels=False)
    lowered = ir.from_proto(ir.to_proto(step))
    kernels.lower(lowered, "cpu", "default", nchwc_block=nchwc_block())
    made = {n.op_type for n in lowered.graph if n.domain == NCHWC_DOMAIN}
    assert made == {"Conv", "ReorderInput", "ReorderOutput"} and default.kernels_fused > 3
    names = [s for s in default.data_inputs]
    rng = np.random.default_rng(0)
    shapes = {s.name: [d if isinstance(d, int) else 8 for d in s.shape] for s in names}
    batches = [{n: rng.standard_normal(shape).astype(s.dtype) for (n, shape), s in zip(shapes.items(), names)} for _ in range(3)]
    a = [default.step(batches[i % 3]).loss for i in range(10)]
    b = [plain.step(batches[i % 3]).loss for i in range(10)]
    assert a[-1] < a[0]  # it trains
    np.testing.assert_allclose(a, b, rtol=1e-4)


def _convt_model(x_shape: list, w_shape: list, **attrs) -> ir.Model:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)]
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="convt", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return ir.from_proto(model)


CONVT_CASES = [
    # (name, x shape, w shape [in, out, kh, kw], attributes, rewritten)
    ("the DQN's 3x3/1 data gradient", [3, 64, 7, 7], [64, 64, 3, 3], {}, True),
    ("padded 3x3/1, a ResNet layer's", [2, 16, 8, 8], [16, 32, 3, 3], {"pads": [1, 1, 1, 1]}, True),
    ("dilated 3x3/1, asymmetric pads", [2, 16, 9, 9], [16, 16, 3, 3], {"dilations": [2, 2], "pads": [1, 0, 2, 1]}, True),
    ("non-square 3x5/1, unequal pads", [2, 16, 8, 9], [16, 16, 3, 5], {"pads": [1, 2, 0, 1]}, True),
    ("non-square 2x4/1, dilated", [2, 16, 9, 10], [16, 16, 2, 4], {"dilations": [2, 1]}, True),
    ("strided: left to ConvTranspose", [2, 64, 9, 9], [64, 32, 4, 4], {"strides": [2, 2]}, False),
    ("grouped: left alone", [2, 32, 8, 8], [32, 16, 3, 3], {"group": 2}, False),
    ("output_padding: left alone", [2, 16, 8, 8], [16, 16, 3, 3], {"output_padding": [0, 0]}, False),
]


@needs_nchwc
@pytest.mark.parametrize("name,xs,ws,attrs,rewritten", CONVT_CASES, ids=[c[0] for c in CONVT_CASES])
def test_unit_stride_conv_transpose_runs_as_a_blocked_conv(name, xs, ws, attrs, rewritten):
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    plain = _run(_convt_model(xs, ws, **attrs), feeds)
    model = _convt_model(xs, ws, **attrs)
    assert to_nchwc(model, block=nchwc_block()) == int(rewritten)
    assert any(n.op_type == "ConvTranspose" for n in model.graph) != rewritten
    out = _run(model, feeds)
    np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))



@needs_nchwc
def test_without_a_compiler_the_cpu_default_still_moves_the_convolutions(monkeypatch):
    """No C++ compiler: the library's ops are off (``kernels_reason`` says why), but ORT's own
    NCHWc convolutions need no library and still run; ``kernels=True`` fails loudly."""
    def no_compiler(provider: str):
        raise kernels.KernelBuildError("the CPU kernels need a C++ compiler ($CXX, g++, c++ or clang++)")

    monkeypatch.setattr(kernels.plan, "library", no_compiler)
    step = build_training_graph(DQN, optimizer="adamw")
    trainer = Trainer(step, "cpu")
    native = ir.from_proto(ir.to_proto(step))
    # The three forward convs, the 4x4/2 layer's weight gradient, the 3x3/1 layer's data gradient
    # and its weight gradient (per-tap slices rebuilt as one Conv, ``slices_dw``).
    assert trainer.kernels_fused == kernels.lower(native, "cpu", "native", nchwc_block=nchwc_block()) == 6
    assert "C++ compiler" in trainer.kernels_reason
    with pytest.raises(kernels.KernelBuildError):
        Trainer(step, "cpu", kernels=True)


@needs_nchwc
def test_train_summary_says_why_only_the_convolutions_moved(tmp_path, monkeypatch):
    """``mpgraph train`` on CPU without a kernel library: the summary counts the convolutions
    moved and names what is missing."""
    from tests.helpers import mpgraph_cli

    monkeypatch.setattr(kernels.plan, "library", lambda provider: (_ for _ in ()).throw(
        kernels.KernelBuildError("the CPU kernels need a C++ compiler ($CXX, g++, c++ or clang++)")))
    step = tmp_path / "dqn.step.onnx"
    ir.save(build_training_graph(DQN, optimizer="adamw"), step)
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    trainer = Trainer(step, "cpu", kernels=False)
    arrays = {s.name: rng.standard_normal([d if isinstance(d, int) else 8 for d in s.shape]).astype(s.dtype)
              for s in trainer.data_inputs}
    np.savez(data, **arrays)
    ran = mpgraph_cli("train", str(step), "--data", str(data), "--steps", "2", "--batch", "8", "--no-eval")
    assert ran.returncode == 0, ran.stderr + ran.stdout
    assert "fused kernels (6 rewrites; no kernel library: the CPU kernels need a C++ compiler" in ran.stdout
