"""Gradients of Resize, AveragePool with ceil_mode and CastLike (mpgraph/autodiff/rules/resize.py).

1. ``TABLE_CASES``: rows in the format of tests/test_gradients.py's table, checked by its own
   function (central differences along a random direction, and torch.autograd in float64).
   They run in float32: ORT CPU has no float64 Resize or AveragePool kernel.
2. The same ops as the two torch exporters write them (``F.interpolate`` in every mode they
   emit, ``AvgPool2d(ceil_mode=True)``), each behind its own 1x1 conv so that each conv's
   weight gradient checks one op against torch.autograd.
3. What torch cannot say: Resize forms it has no twin for (pytorch_half_pixel with one output
   pixel, tf_crop_and_resize, half_pixel_symmetric, antialias, runtime sizes and dynamic spatial
   dims), checked against the forward map itself: Resize and AveragePool are linear in X, so
   ``<grad, d>`` must equal ``<r, A d>`` for any direction ``d`` (a difference quotient with
   no truncation error).
4. CastLike, which the dynamo exporter writes for every Python scalar when its optimizer is off.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpgraph.training import build_training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tests.test_gradients import Case, Var  # noqa: E402
from tests.test_gradients import test_gradient as check_table_case  # noqa: E402

FP32_RESIZE = "ORT CPU has no float64 Resize kernel"
FP32_POOL = "ORT CPU has no float64 AveragePool kernel"


def _scales(*v: float) -> np.ndarray:
    return np.asarray(v, np.float32)


def _sizes(*v: int) -> np.ndarray:
    return np.asarray(v, np.int64)


def _resize(name: str, shape: tuple, attrs: dict, fn, scales=None, sizes=None, opset: int = 18, rtol: float = 5e-7) -> Case:
    inputs = [Var(shape), None, scales] + ([sizes] if sizes is not None else [])
    return Case(name, "Resize", inputs, attrs, fn, dtype="float32", note=FP32_RESIZE, opset=opset, rtol=rtol)


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
LINEAR = {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}

# rtol bounds the error against torch float64 (measured with the table's seeds, and with three
# other seeds): 0 (exactly) for nearest-sizes-down, linear-half-pixel-down and the exact tiling (bound 1e-7),
# 1.1e-7 to 2.0e-7 for align_corners and axes (2e-6), 4.0e-7 to 5.5e-7 for pytorch_half_pixel
# and cubic (5e-6), 2e-8 to 9e-8 for the rest (5e-7). The central-difference check uses the
# table's float32 bound.
TABLE_CASES: list[Case] = [
    _resize("Resize-nearest-scales", ("N", 2, 3, 4), NEAREST, lambda x, s: F.interpolate(x, scale_factor=(2, 3), mode="nearest"),
            scales=_scales(1, 1, 2, 3)),
    _resize("Resize-nearest-sizes-down", (2, 2, 7, 9), NEAREST, lambda x, z: F.interpolate(x, size=(3, 4), mode="nearest"),
            sizes=_sizes(2, 2, 3, 4), rtol=1e-7),
    _resize("Resize-nearest-exact", (2, 2, 5, 7), {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                                                   "nearest_mode": "round_prefer_ceil"},
            lambda x, z: F.interpolate(x, size=(8, 4), mode="nearest-exact"), sizes=_sizes(2, 2, 8, 4)),
    _resize("Resize-linear-half-pixel-scales", ("N", 2, 5, 7), LINEAR,
            lambda x, s: F.interpolate(x, scale_factor=2, mode="bilinear"), scales=_scales(1, 1, 2, 2)),
    _resize("Resize-linear-half-pixel-down", (2, 2, 8, 6), LINEAR,
            lambda x, s: F.interpolate(x, scale_factor=0.5, mode="bilinear"), scales=_scales(1, 1, 0.5, 0.5), rtol=1e-7),
    _resize("Resize-linear-align-corners", (2, 2, 5, 7), {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
            lambda x, z: F.interpolate(x, size=(9, 11), mode="bilinear", align_corners=True), sizes=_sizes(2, 2, 9, 11), rtol=2e-6),
    _resize("Resize-linear-pytorch-half-pixel", (2, 2, 5, 7), {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
            lambda x, z: F.interpolate(x, size=(9, 4), mode="bilinear"), sizes=_sizes(2, 2, 9, 4), rtol=5e-6),
    _resize("Resize-linear-1d", (2, 3, 7), LINEAR, lambda x, s: F.interpolate(x, scale_factor=2, mode="linear"),
            scales=_scales(1, 1, 2)),
    _resize("Resize-cubic", (2, 2, 5, 7), {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75},
            lambda x, z: F.interpolate(x, size=(8, 10), mode="bicubic"), sizes=_sizes(2, 2, 8, 10), rtol=5e-6),
    _resize("Resize-trilinear", (2, 2, 3, 4, 5), LINEAR, lambda x, s: F.interpolate(x, scale_factor=(2, 1.5, 2), mode="trilinear"),
            scales=_scales(1, 1, 2, 1.5, 2)),
    _resize("Resize-linear-axes", (2, 2, 5, 7), {**LINEAR, "axes": [2, 3]},
            lambda x, s: F.interpolate(x, scale_factor=(1.5, 2), mode="bilinear"), scales=_scales(1.5, 2), rtol=2e-6),
    _resize("Resize-linear-opset19", (2, 2, 5, 7), LINEAR, lambda x, s: F.interpolate(x, scale_factor=2, mode="bilinear"),
            scales=_scales(1, 1, 2, 2), opset=19),
    Case("AveragePool2d-ceil", "AveragePool", [Var(("N", 2, 8, 10))], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
         lambda x: F.avg_pool2d(x, 3, 2, ceil_mode=True), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("AveragePool2d-ceil-kernel-past-input", "AveragePool", [Var((2, 3, 5, 6))],
         {"kernel_shape": [40, 40], "strides": [40, 40], "ceil_mode": 1, "count_include_pad": 1},
         lambda x: F.avg_pool2d(x, 40, ceil_mode=True), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("AveragePool2d-ceil-pad-include", "AveragePool", [Var((2, 2, 8, 10))],
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1},
         lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=True), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("AveragePool2d-ceil-pad-exclude", "AveragePool", [Var((2, 2, 8, 10))],
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 0},
         lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("AveragePool2d-ceil-exact-tiling", "AveragePool", [Var(("N", 2, 8, 6))],  # timm's ResNet-D shortcut
         {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 0},
         lambda x: F.avg_pool2d(x, 2, 2, ceil_mode=True, count_include_pad=False), dtype="float32", note=FP32_POOL, rtol=1e-7),
    Case("AveragePool1d-ceil", "AveragePool", [Var((2, 3, 9))], {"kernel_shape": [4], "strides": [3], "ceil_mode": 1},
         lambda x: F.avg_pool1d(x, 4, 3, ceil_mode=True), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("CastLike", "CastLike", [Var((3, 4)), np.zeros((), np.float64)], {}, lambda x, t: x * 1.0),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[c.id for c in TABLE_CASES])
def test_table_case(case: Case) -> None:
    check_table_case(case)


OPS = {
    "nearest_scale": lambda h: F.interpolate(h, scale_factor=2, mode="nearest"),
    "nearest_size": lambda h: F.interpolate(h, size=(9, 11), mode="nearest"),
    "nearest_exact": lambda h: F.interpolate(h, size=(4, 13), mode="nearest-exact"),  # dynamo only
    "bilinear": lambda h: F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False),
    "bilinear_corners": lambda h: F.interpolate(h, size=(9, 11), mode="bilinear", align_corners=True),
    "bilinear_down": lambda h: F.interpolate(h, scale_factor=0.5, mode="bilinear"),
    "bicubic": lambda h: F.interpolate(h, size=(7, 10), mode="bicubic"),
    "avgpool_ceil": lambda h: F.avg_pool2d(h, 3, 2, ceil_mode=True),
    "avgpool_wide": lambda h: F.avg_pool2d(h, 40, ceil_mode=True),  # HF EfficientNet's pooler
}
#: The TorchScript exporter refuses aten::_upsample_nearest_exact2d at opset 18.
TORCHSCRIPT_LACKS = {"nearest_exact"}


class _Branches(torch.nn.Module):
    """One 1x1 conv per op, so that each conv's weight gradient checks that op alone."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleDict({name: torch.nn.Conv2d(3, 2, 1) for name in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((OPS[name](conv(x)) ** 2).mean() for name, conv in self.convs.items())


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_exported_interpolate_and_pool_match_torch(exporter: str) -> None:
    """Both exporters' Resize and ceil_mode AveragePool, differentiated by mpgraph's step graph:
    every conv parameter's gradient against torch.autograd (fp32), bound 5e-6 (measured 6.1e-7
    at most)."""
    from tests.corpus import check
    from tests.corpus.models import Case as CorpusCase

    torch.manual_seed(0)
    names = [n for n in OPS if exporter == "dynamo" or n not in TORCHSCRIPT_LACKS]
    case = CorpusCase("branches", _Branches(names), (torch.randn(2, 3, 6, 8),), ("x",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = check.export(case, exporter)
    ops = {n.op_type for n in exported.model.graph.node}
    assert {"Resize", "AveragePool"} <= ops, ops
    errors = check.gradient_errors(exported)
    assert {f"convs.{name}.weight" for name in names} <= set(errors)
    worst = max(e.vs_torch for e in errors.values())
    assert worst <= 5e-6, {k: e.vs_torch for k, e in errors.items()}


def _session(model: onnx.ModelProto | ir.Model) -> ort.InferenceSession:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _linear_check(node: onnx.NodeProto, x_type: list, feeds: dict[str, np.ndarray], inits: list, opset: int = 18,
                  extra_inputs: tuple = ()) -> float:
    """The step graph's gradient of ``sum(y * r)`` (``r`` a random graph input) against the
    forward map along three random directions: ``<grad, d> = <r, A d - A 0>`` for the affine
    ``A`` (tf_crop_and_resize's extrapolated border is a constant). Returns the worst error
    relative to ``|r| |A d|``, the size of the dot product before its terms cancel."""
    forward = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_type), *extra_inputs],
                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    forward_model = helper.make_model(forward, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    run_forward = _session(forward_model)
    rng = np.random.default_rng(0)
    y = run_forward.run(None, feeds)[0]
    r = rng.standard_normal(y.shape).astype(np.float32)
    nodes = [node, helper.make_node("Mul", ["y", "r"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    inputs = [*forward.input, helper.make_tensor_value_info("r", TensorProto.FLOAT, [f"r{i}" for i in range(len(x_type))])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])
    grad = _session(step).run(["grad/x"], {**feeds, "r": r})[0]
    offset = run_forward.run(None, {**feeds, "x": np.zeros_like(feeds["x"])})[0].astype(np.float64)  # affine maps
    worst = 0.0
    for _ in range(3):
        d = rng.standard_normal(feeds["x"].shape).astype(np.float32)
        moved = run_forward.run(None, {**feeds, "x": d})[0] - offset
        along = float(np.vdot(r.astype(np.float64), moved))
        scale = float(np.linalg.norm(r) * np.linalg.norm(moved))  # |<r, Ad>| at most, without cancellation
        worst = max(worst, abs(float(np.vdot(grad.astype(np.float64), d)) - along) / scale)
    return worst


def _resize_node(inputs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node("Resize", inputs, ["y"], name="resize", **attrs)


X = np.random.default_rng(1).standard_normal((2, 2, 5, 7)).astype(np.float32)

FORMS = {
    # pytorch_half_pixel maps a 1-pixel output to input 0 (torch's bilinear samples the middle).
    "pytorch_half_pixel-one-row": (_resize_node(["x", "", "", "z"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
                                   [numpy_helper.from_array(_sizes(2, 2, 1, 10), "z")], 18),
    # The extrapolated border is a constant: no gradient leaks into it.
    "tf_crop_and_resize": (_resize_node(["x", "roi", "s"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
                                        extrapolation_value=5.0),
                           [numpy_helper.from_array(np.asarray([0, 0, -0.2, 0.1, 1, 1, 1.1, 0.8], np.float32), "roi"),
                            numpy_helper.from_array(_scales(1, 1, 1.6, 1.3), "s")], 18),
    "half_pixel_symmetric": (_resize_node(["x", "", "s"], mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
                             [numpy_helper.from_array(_scales(1, 1, 1.7, 0.6), "s")], 19),
    "antialias-down": (_resize_node(["x", "", "s"], mode="linear", antialias=1), [numpy_helper.from_array(_scales(1, 1, 0.4, 0.6), "s")], 18),
    "cubic-exclude-outside": (_resize_node(["x", "", "", "z"], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5),
                              [numpy_helper.from_array(_sizes(2, 2, 9, 4), "z")], 18),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_resize_forms_without_a_torch_twin(form: str) -> None:
    """Resize forms torch has no twin for, against the forward map (bound 1e-7; measured 4.6e-9
    to 1.2e-8)."""
    node, inits, opset = FORMS[form]
    assert _linear_check(node, list(X.shape), {"x": X}, inits, opset) <= 1e-7


def test_resize_runtime_sizes_and_dynamic_dims() -> None:
    """Sizes fed at run time (every axis may be resampled, the batch axis too) and scales on an
    input whose spatial dims are dynamic (the identity is built from its runtime shape). Bound
    1e-7; measured 6.3e-9 and 3.5e-9."""
    sizes = helper.make_tensor_value_info("z", TensorProto.INT64, [4])
    node = _resize_node(["x", "", "", "z"], mode="linear")
    assert _linear_check(node, list(X.shape), {"x": X, "z": _sizes(2, 2, 9, 4)}, [], extra_inputs=(sizes,)) <= 1e-7
    node = _resize_node(["x", "", "s"], mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    scales = [numpy_helper.from_array(_scales(1, 1, 2, 1.5), "s")]
    assert _linear_check(node, ["N", 2, "H", "W"], {"x": X}, scales) <= 1e-7


def test_average_pool_dilated_and_dynamic_channels() -> None:
    """AveragePool with dilations (opset 19): the separable form under ceil_mode, the box form
    with per-window divisors (padded, count_include_pad=0: its divisor pool needs the dilations
    too); and the separable form where channels are dynamic. Bound 1e-7; measured 2.5e-9,
    6.3e-9 and 5.8e-9."""
    pool = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 3], strides=[2, 1], dilations=[2, 1], ceil_mode=1,
                            pads=[1, 0, 0, 1])
    assert _linear_check(pool, list(X.shape), {"x": X}, [], opset=19) <= 1e-7
    pool = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], dilations=[1, 2], pads=[1, 1, 1, 1])
    assert _linear_check(pool, list(X.shape), {"x": X}, [], opset=19) <= 1e-7
    pool = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 0, 0])
    assert _linear_check(pool, ["N", "C", 5, 7], {"x": X}, []) <= 1e-7


@pytest.mark.parametrize(("shape", "separable"), [((2, 2, 8, 6), False), ((2, 2, 7, 6), True)])
def test_average_pool_ceil_mode_keeps_the_box_form_where_it_adds_no_window(shape: tuple, separable: bool) -> None:
    """``AvgPool2d(2, ceil_mode=True)`` on an even map has no partial window: the ConvTranspose
    form, not the dense MatMuls (an odd height adds one)."""
    nodes = [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    step = build_training_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
                                optimizer=None, loss="loss", trainable_inputs=["x"])
    backward = {n.op_type for n in step.graph if n.name.startswith("grad/")}
    assert ("MatMul" in backward) is separable and ("ConvTranspose" in backward or "Conv" in backward) is not separable


def test_cast_like_casts_the_gradient_back() -> None:
    """CastLike float64 -> float32: the gradient is the float32 cotangent cast back to float64."""
    nodes = [helper.make_node("CastLike", ["x", "t"], ["y"]), helper.make_node("Mul", ["y", "c"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    c = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.zeros((), np.float32), "t"), numpy_helper.from_array(c, "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])
    grad = _session(step).run(["grad/x"], {"x": np.ones((3, 4))})[0]
    assert grad.dtype == np.float64 and np.array_equal(grad, c.astype(np.float64))


def test_torchscript_sizes_with_dynamic_batch_resample_only_spatial_axes() -> None:
    """With a dynamic batch the TorchScript exporter computes ``sizes`` at run time as
    ``Concat(Slice(Shape(x), 0, 2), [h, w])``: the rule sees that batch and channels are copied,
    and emits two matrices (H, W), not four. Gradients against torch: bound 1e-6 (measured 8.2e-8)."""
    from tests.corpus import check
    from tests.corpus.models import Case as CorpusCase

    torch.manual_seed(0)
    module = _Branches(["bilinear_corners"])
    inputs = (torch.randn(2, 3, 6, 8),)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, inputs, f, dynamo=False, opset_version=18, do_constant_folding=False,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    proto = onnx.load_from_string(f.getvalue())
    resize = next(n for n in proto.graph.node if n.op_type == "Resize")
    assert resize.input[3] and not any(i.name == resize.input[3] for i in proto.graph.initializer)  # runtime sizes
    exported = check.Exported(CorpusCase("dyn", module, inputs, ("x",)), "torchscript", proto, proto.graph.output[0].name, 0.0)
    step = build_training_graph(proto, optimizer=None, loss=exported.loss)
    assert sum(n.op_type == "Resize" and n.name.startswith("grad/") for n in step.graph) == 2
    errors = check.gradient_errors(exported)
    assert max(e.vs_torch for e in errors.values()) <= 1e-6, errors


def test_dynamo_export_without_its_optimizer_needs_cast_like() -> None:
    """``torch.onnx.export(dynamo=True, optimize=False)`` writes ``CastLike(constant, x)`` for
    every Python scalar: the corpus BERT's gradients pass the corpus check against torch, and
    are within 5e-6 relative L2 (measured 8.1e-7)."""
    import copy

    from onnx import numpy_helper

    from tests.corpus import check
    from tests.corpus.models import build

    case = build("bert")
    module = copy.deepcopy(case.module).eval()
    names = check.param_names(module)
    params = tuple(p.detach() for p in module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(check.Functional(module, names), params + case.inputs, dynamo=True, optimize=False,
                                    opset_version=18, input_names=names + list(case.input_names), verbose=False)
    proto = program.model_proto
    assert any(n.op_type == "CastLike" for n in proto.graph.node)
    present = {i.name for i in proto.graph.input}
    proto.graph.initializer.extend(numpy_helper.from_array(p.numpy(), n) for n, p in zip(names, params, strict=True) if n in present)
    errors = check.gradient_errors(check.Exported(case, "dynamo", proto, proto.graph.output[0].name, 0.0))
    assert all(e.ok for e in errors.values()) and errors["<loss>"].vs_torch <= check.LOSS_TOL, errors
    assert max(e.vs_torch for e in errors.values()) <= 5e-6


@pytest.mark.parametrize(("attrs", "message"), [
    ({"keep_aspect_ratio_policy": "not_larger"}, "keep_aspect_ratio_policy=not_larger"),
    ({"coordinate_transformation_mode": "tf_crop_and_resize"}, "needs a constant roi"),
])
def test_resize_forms_without_a_rule_are_named(attrs: dict, message: str) -> None:
    """What the rule does not cover is a one-line GradientError naming the node and the form."""
    from mpgraph.errors import GradientError

    nodes = [helper.make_node("Resize", ["x", "roi", "", "z"], ["y"], name="up", mode="linear", **attrs),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 5, 7]),
                                           helper.make_tensor_value_info("roi", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(_sizes(2, 2, 9, 14), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(GradientError, match=message) as info:
        build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])
    assert "'up'" in str(info.value) and "\n" not in str(info.value)


def test_average_pool_ceil_window_past_the_input_is_refused() -> None:
    """A ceil_mode window that would start after the input (here in the right padding of W: 7
    wide, pads 1, kernel 2, stride 2) is dropped by ONNX Runtime (4 outputs, as torch) and
    counted by onnx's shape inference (5): the step graph could not load, so the rule says so."""
    from mpgraph.errors import GradientError

    nodes = [helper.make_node("AveragePool", ["x"], ["y"], name="pool", kernel_shape=[3, 2], strides=[2, 2],
                              pads=[1, 1, 1, 1], ceil_mode=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 7])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    assert onnx.shape_inference.infer_shapes(model).graph.value_info[0].type.tensor_type.shape.dim[3].dim_value == 5
    assert _session(model).run(None, {"x": np.ones((2, 3, 8, 7), np.float32)})[0] == 2 * 3 * 5 * 4
    with pytest.raises(GradientError, match="'pool': with ceil_mode=1 the last window on spatial axis 1 starts after"):
        build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("model", ["efficientnet", "segformer"])
def test_check_grad_passes_on_the_corpus_models_these_rules_unblocked(model: str, exporter: str,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """``mpgraph.check_grad`` (finite differences, no torch) on the corpus's EfficientNet
    (AveragePool ceil_mode) and SegFormer (Resize) exports: no parameter fails."""
    from mpgraph.check_grad import check_grad
    from tests.corpus import cache

    cache.share(tmp_path_factory.getbasetemp())  # the corpus tests' exports of the same models
    exported = cache.exported(model, exporter)
    feeds = {n: t.numpy() for n, t in zip(exported.case.input_names, exported.case.inputs, strict=True)}
    report = check_grad(exported.model, inputs=feeds)
    assert report.passed, [p for p in report.params if p.status == "fail"]
    assert not any(p.status == "fail" for p in report.params)
