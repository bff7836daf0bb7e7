"""``mpgraph.check_grad`` and ``mpgraph check-grad``: passes on zoo models, flags a planted wrong rule."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from typer.testing import CliRunner

from mpgraph.autodiff import registry
from mpgraph.check_grad import InputsError, check_grad
from mpgraph.check_grad.float64 import to_float64
from mpgraph.cli.main import app
from mpgraph.runtime.check_runs import CheckSession

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"


@pytest.fixture
def wrong_rule(request: pytest.FixtureRequest) -> Iterator[str]:
    """Scale the first input cotangent of one op's registered rule by 1.02 (a 2% bug)."""
    op = request.param
    key = ("", op)
    saved = list(registry._RULES[key])
    rule = registry.lookup_rule("", op, 18)
    assert isinstance(rule, registry.GradientRule)

    def wrong(ctx, node, *dys):  # type: ignore[no-untyped-def]
        grads = list(rule.fn(ctx, node, *dys))
        grads[0] = ctx.op("Mul", grads[0], ctx.scalar(1.02, node.inputs[0]))
        return grads

    registry._RULES[key] = [dataclasses.replace(r, fn=wrong) if r is rule else r for r in saved]
    try:
        yield op
    finally:
        registry._RULES[key] = saved


@pytest.mark.parametrize("name", ["tiny_mlp", "gpt"])
def test_zoo_model_passes(name: str) -> None:
    report = check_grad(ZOO / f"{name}.loss.onnx")
    assert report.passed, [p for p in report.params if not p.passed]
    assert report.dtype.startswith("float64")
    assert all(p.status == "pass" for p in report.params)
    assert report.first_bad_node is None and report.nodes_checked == 0
    # The check compares real numbers, not zeros.
    assert all(abs(p.analytic) > 1e-6 for p in report.params)


@pytest.mark.parametrize(("wrong_rule", "name"), [("Relu", "tiny_mlp"), ("MatMul", "gpt")], indirect=["wrong_rule"])
def test_planted_wrong_rule_is_named(wrong_rule: str, name: str) -> None:
    report = check_grad(ZOO / f"{name}.loss.onnx")
    assert not report.passed
    assert any(abs(p.rel_error - 0.02) < 0.05 for p in report.failed)
    node = report.first_bad_node
    assert node is not None
    assert node.op_type == wrong_rule and node.rule.startswith(f"ai.onnx::{wrong_rule}@")
    assert abs(node.rel_error - 0.02 / 1.02) < 2e-3
    # Every other disagreeing node is of the same op: no other rule is blamed.
    assert {n.op_type for n in report.bad_nodes} == {wrong_rule}


def test_token_ids_stay_inside_the_vocabulary() -> None:
    report = check_grad(ZOO / "gpt.loss.onnx", localize=False)
    shapes = {n: s for n, s, _ in report.inputs}
    assert shapes["tokens"] == (2, 16) and shapes["label"] == (2, 16)


def test_npz_key_errors_list_both_sides(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, x=np.zeros((2, 4), np.float32), labels=np.zeros(2, np.int64))
    with pytest.raises(InputsError) as e:
        check_grad(ZOO / "tiny_mlp.loss.onnx", inputs=path)
    msg = str(e.value)
    assert "missing 'label'" in msg and "unknown 'labels'" in msg
    assert "the file has: labels, x" in msg and "the model needs: x, label" in msg


def test_npz_inputs_are_used(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    path = tmp_path / "x.npz"
    np.savez(path, x=rng.standard_normal((5, 4)).astype(np.float32), label=rng.integers(0, 2, 5))
    report = check_grad(ZOO / "tiny_mlp.loss.onnx", inputs=path)
    assert report.passed
    assert dict((n, s) for n, s, _ in report.inputs) == {"x": (5, 4), "label": (5,)}


def test_cli_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["check-grad", str(ZOO / "tiny_mlp.loss.onnx"), "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["passed"] and len(data["params"]) == 6 and data["first_bad_node"] is None

    bad = tmp_path / "x.npz"
    np.savez(bad, y=np.zeros((2, 4), np.float32))
    res = runner.invoke(app, ["check-grad", str(ZOO / "tiny_mlp.loss.onnx"), "--inputs", str(bad)])
    assert res.exit_code == 2
    assert res.output.count("error:") == 1 and "Traceback" not in res.output
    res = runner.invoke(app, ["check-grad", str(tmp_path / "missing.onnx")])
    assert res.exit_code == 2 and "error:" in res.output


@pytest.mark.parametrize("wrong_rule", ["Relu"], indirect=True)
def test_cli_fails_and_names_the_node(wrong_rule: str) -> None:
    res = CliRunner().invoke(app, ["check-grad", str(ZOO / "tiny_mlp.loss.onnx")])
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output and "first wrong gradient rule" in res.output
    assert "(Relu, rule ai.onnx::Relu@" in res.output


def _conv_model(op: str, x_shape: list[int], w: np.ndarray, b: np.ndarray, **attrs: object) -> onnx.ModelProto:
    node = h.make_node(op, ["x", "w", "b"], ["y"], name="conv", **attrs)
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", *x_shape[1:]])],
                         [h.make_tensor_value_info("y", T.FLOAT, None)],
                         [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _assert_float64_rewrite_matches(model: onnx.ModelProto, op: str, x: np.ndarray) -> None:
    expected = CheckSession(model).run(["y"], {"x": x})[0]
    converted, islands = to_float64(ir.from_proto(model), frozenset({op}), {"x": x.shape})
    assert islands == set() and not any(n.op_type == op for n in converted.graph.node)
    got = CheckSession(converted).run(["y"], {"x": x.astype(np.float64)})[0]
    assert got.dtype == np.float64 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("channels", "out", "group", "kernel", "stride", "dilation", "pads", "auto_pad"),
    [(4, 6, 1, 3, 1, 1, [1, 1, 1, 1], "NOTSET"), (4, 8, 2, 3, 2, 1, [0, 1, 1, 0], "NOTSET"),
     (4, 4, 4, 3, 1, 2, [2, 2, 2, 2], "NOTSET"), (3, 5, 1, 8, 4, 1, [0, 0, 0, 0], "NOTSET"),
     (3, 5, 1, 3, 2, 1, None, "SAME_UPPER"), (3, 5, 1, 2, 1, 1, None, "SAME_LOWER")],
)
def test_float64_conv_rewrite_matches_ort_conv(channels, out, group, kernel, stride, dilation, pads, auto_pad) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, channels, 9, 10)).astype(np.float32)
    w = rng.standard_normal((out, channels // group, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    attrs = {"group": group, "strides": [stride] * 2, "dilations": [dilation] * 2, "kernel_shape": [kernel] * 2}
    attrs.update({"pads": pads} if auto_pad == "NOTSET" else {"auto_pad": auto_pad})
    _assert_float64_rewrite_matches(_conv_model("Conv", list(x.shape), w, b, **attrs), "Conv", x)


@pytest.mark.parametrize(
    ("channels", "out", "group", "kernel", "stride", "dilation", "pads", "output_padding"),
    [(4, 6, 1, 2, 2, 1, [0, 0, 0, 0], [0, 0]), (4, 6, 2, 3, 2, 1, [1, 0, 1, 2], [1, 0]),
     (3, 5, 1, 3, 1, 2, [2, 1, 0, 3], [0, 0]), (4, 4, 4, 3, 3, 1, [0, 0, 0, 0], [2, 1]),
     (3, 2, 1, 1, 1, 1, [0, 0, 0, 0], [0, 0]), (2, 3, 1, 2, 2, 1, [1, 1, 1, 1], [0, 0])],
)
def test_float64_conv_transpose_rewrite_matches_ort(channels, out, group, kernel, stride, dilation, pads, output_padding) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, channels, 5, 6)).astype(np.float32)
    w = rng.standard_normal((channels, out // group, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(out // group * group).astype(np.float32)
    attrs = {"group": group, "strides": [stride] * 2, "dilations": [dilation] * 2, "kernel_shape": [kernel] * 2,
             "pads": pads, "output_padding": output_padding}
    _assert_float64_rewrite_matches(_conv_model("ConvTranspose", list(x.shape), w, b, **attrs), "ConvTranspose", x)


def _upsampling_model() -> onnx.ModelProto:
    """A strided Conv, BatchNorm and Relu down, a ConvTranspose up feeding a BatchNorm bias
    and a Relu, a 1x1 Conv head and a per-pixel cross-entropy (issue 12's conv_seg, small)."""
    rng = np.random.default_rng(4)

    def init(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)

    ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"]),
             h.make_node("Relu", ["n1"], ["r1"]),
             h.make_node("ConvTranspose", ["r1", "wt", "bt"], ["up"], strides=[2, 2]),
             h.make_node("BatchNormalization", ["up", "s2", "b2", "m2", "v2"], ["n2"]),
             h.make_node("Relu", ["n2"], ["r2"]),
             h.make_node("Conv", ["r2", "wh"], ["logits"]),
             h.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    inits = [init("w1", 8, 3, 3, 3), init("wt", 8, 8, 2, 2), init("bt", 8), init("wh", 4, 8, 1, 1),
             *(onnx.numpy_helper.from_array(a, n) for a, n in [(ones, "s1"), (zeros, "b1"), (zeros, "m1"), (ones, "v1"),
                                                                (ones, "s2"), (zeros, "b2"), (zeros, "m2"), (ones, "v2")])]
    graph = h.make_graph(nodes, "upsampling", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 8, 8]),
                                               h.make_tensor_value_info("labels", T.INT64, [2, 8, 8])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_conv_transpose_runs_in_float64() -> None:
    # A float32 ConvTranspose made the whole check "mixed": a 1000x larger step, which crossed
    # Relu kinks and failed conv_seg's fuse.1.bias (issue 12). Now it is float64 ops.
    report = check_grad(_upsampling_model(), loss="loss")
    assert report.dtype == "float64" and "ConvTranspose" not in report.analytic_dtype, report.analytic_dtype
    assert report.rtol == 1e-5 and report.passed  # the float64 tolerance: no op rounds in float32
    assert all(p.status == "pass" for p in report.params), report.params
    assert "b2" in {p.name for p in report.params}


def test_conv_seg_torchscript_passes() -> None:
    # The corpus case of issue 12: fuse.1.bias read 9.2e-3 against finite differences that
    # crossed Relu kinks at the float32 step, though it matches torch in float64 to 4e-9.
    pytest.importorskip("torch")
    from tests.corpus import check
    from tests.corpus.models import build

    exported = check.export(build("conv_seg"), "torchscript")
    report = check_grad(exported.model, loss=exported.loss)
    assert report.passed and "ConvTranspose" not in report.dtype, report.failed
    assert {p.name: p.status for p in report.params}["fuse.1.bias"] == "pass"


def _one_op_model(op: str, x_shape: list[int], consts: list[tuple[str, np.ndarray | None]], **attrs: object) -> onnx.ModelProto:
    """``op(x, *consts)``; a ``None`` constant is an omitted input."""
    node = h.make_node(op, ["x", *(n if a is not None else "" for n, a in consts)], ["y"], name=op.lower(), **attrs)
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in consts if a is not None]
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", T.FLOAT, x_shape)],
                         [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("shape", "attrs"),
    [((2, 3, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
     ((2, 3, 7, 9), {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [1, 0, 1, 1]}),
     ((2, 3, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 1, 0], "ceil_mode": 1, "count_include_pad": 1}),
     ((2, 3, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
     ((2, 3, 5, 6), {"kernel_shape": [320, 320], "strides": [320, 320], "ceil_mode": 1, "count_include_pad": 1}),
     ((2, 3, 10), {"kernel_shape": [4], "strides": [3], "pads": [2, 1]}),
     ((2, 3, 7, 9), {"kernel_shape": [2, 2], "auto_pad": "VALID"})],
)
def test_float64_average_pool_rewrite_matches_ort(shape, attrs) -> None:
    # The 320x320 ceil_mode case is HF EfficientNet's pooler (a kernel larger than the input).
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    _assert_float64_rewrite_matches(_one_op_model("AveragePool", list(shape), [], **attrs), "AveragePool", x)


@pytest.mark.parametrize(
    ("shape", "attrs", "scales", "sizes"),
    [((2, 3, 4, 5), {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, None, [2, 3, 8, 8]),
     ((2, 3, 4, 5), {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 2.5, 1.5], None),
     ((2, 3, 4, 5), {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [2, 3, 7, 1]),
     ((2, 3, 4, 5), {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 2, 3], None),
     ((2, 3, 8, 6), {"mode": "linear"}, None, [2, 3, 3, 4]),
     ((2, 3, 4, 5), {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 2, 2], None),
     ((2, 3, 4, 5), {"mode": "nearest"}, None, [2, 3, 7, 9]),
     ((2, 3, 4, 5), {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "round_prefer_ceil"},
      None, [2, 3, 7, 9]),
     ((2, 3, 5), {"mode": "linear"}, [1, 1, 1.7], None)],
)
def test_float64_resize_rewrite_matches_ort(shape, attrs, scales, sizes) -> None:
    # Segformer's decode head: linear, half_pixel, sizes (computed at run time in its export).
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    consts = [("roi", None), ("scales", np.array(scales, np.float32) if scales else None)]
    consts += [("sizes", np.array(sizes, np.int64))] if sizes else []
    model = _one_op_model("Resize", list(shape), consts, **attrs)
    expected = CheckSession(model).run(["y"], {"x": x})[0]
    converted, islands = to_float64(ir.from_proto(model), frozenset({"Resize"}), {"x": x.shape, "y": expected.shape})
    assert islands == set() and not any(n.op_type == "Resize" for n in converted.graph.node)
    got = CheckSession(converted).run(["y"], {"x": x.astype(np.float64)})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


def test_float64_erf_is_float64_accurate() -> None:
    x = np.concatenate([np.linspace(-8, 8, 1601), [0.0, 1e-9, -1e-300]])
    converted, islands = to_float64(ir.from_proto(_one_op_model("Erf", [len(x)], [])), frozenset({"Erf"}), {"x": x.shape})
    assert islands == set()
    got = CheckSession(converted).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, [math.erf(v) for v in x], rtol=0, atol=4e-15)


def _pool_resize_model() -> onnx.ModelProto:
    """Conv, Erf (GELU), an AveragePool with a kernel larger than its input (EfficientNet's
    pooler), a linear Resize back up, a 1x1 Conv head and a per-pixel cross-entropy."""
    rng = np.random.default_rng(5)
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("Erf", ["c1"], ["e1"]),
             h.make_node("AveragePool", ["e1"], ["p1"], kernel_shape=[320, 320], strides=[320, 320], ceil_mode=1),
             h.make_node("Constant", [], ["scales"], value=onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32))),
             h.make_node("Resize", ["e1", "", "scales"], ["up"], mode="linear", coordinate_transformation_mode="half_pixel"),
             h.make_node("AveragePool", ["up"], ["p2"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             h.make_node("Add", ["p2", "p1"], ["s"]),
             h.make_node("Conv", ["s", "wh"], ["logits"]),
             h.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    inits = [onnx.numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in [("w1", (6, 3, 3, 3)), ("b1", (6,)), ("wh", (4, 6, 1, 1))]]
    graph = h.make_graph(nodes, "pool_resize", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 6, 6]),
                                                h.make_tensor_value_info("labels", T.INT64, [2, 6, 6])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_average_pool_resize_erf_run_in_float64() -> None:
    # Before, AveragePool, Resize and Erf ran in float32 inside the check ("mixed": step 1e-4,
    # rtol 1e-3), which left EfficientNet and Segformer noisy. Now every op is float64.
    report = check_grad(_pool_resize_model(), loss="loss")
    assert report.dtype == "float64", report.dtype  # the loss's OneHot is exact in float32
    assert not {"AveragePool", "Resize", "Erf"} & set(report.analytic_dtype.replace(",", " ").split()), report.analytic_dtype
    assert report.rtol == 1e-5 and report.passed, report.params
    assert all(p.status == "pass" for p in report.params), report.params


def test_float64_copy_keeps_resize_scales_float32() -> None:
    # Resize's scales are float32 by schema: retyped to float64, shape inference failed and the
    # whole check fell back to float32 before ORT could name Resize as the op to rewrite.
    model = _one_op_model("Resize", [2, 3, 4, 5], [("roi", None), ("scales", np.array([1, 1, 2, 2], np.float32))], mode="linear")
    converted, islands = to_float64(ir.from_proto(model), frozenset())
    assert islands == set() and converted.graph.output[0].type.tensor_type.elem_type == T.DOUBLE
