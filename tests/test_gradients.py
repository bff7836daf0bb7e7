"""One test table for every gradient rule.

Each case builds a one-op model, attaches ``loss = sum_k sum(y_k * c_k)`` with fixed random
cotangents ``c_k``, builds its gradient graph with ``build_training_graph(optimizer=None)``
and checks the gradients two ways:

1. central finite differences of the loss along a random direction (the directional
   derivative ``<grad, d>``), and
2. ``torch.autograd`` on the same inputs (torch computes in float64).

Cases run in float64 where ORT CPU has float64 kernels for every op of the forward and the
backward graph; the others run in float32 with looser tolerances, and say why in ``note``.
``test_every_rule_has_a_case`` fails when a registered rule has no case.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpgraph.autodiff import lookup_rule, registered_rules
from mpgraph.training import build_training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional


@dataclasses.dataclass(frozen=True)
class Var:
    """A differentiable float input of the given shape (``"N"`` marks a dynamic dim)."""

    shape: tuple[Any, ...]
    positive: bool = False
    grad: bool = True


@dataclasses.dataclass
class Case:
    """One row of the table.

    Attributes:
        id: Test id.
        op: ONNX op type.
        inputs: ``Var`` (float input), ``np.ndarray`` (constant initializer) or ``None``
            (omitted optional input).
        attrs: Node attributes.
        torch_fn: Same function in torch, taking the inputs (Vars as tensors, arrays as
            tensors) and returning the outputs the loss uses.
        dtype: ``float64`` or ``float32``.
        note: Why the case is not float64, when it is not.
        outputs: Number of node outputs; ``used`` lists those the loss uses.
        opset: Model opset.
        rtol: Tolerance of the torch check, and in float64 of the differences too (defaults:
            ``TORCH_RTOL``, ``FD_RTOL``).
    """

    id: str
    op: str
    inputs: Sequence[Any]
    attrs: dict[str, Any]
    torch_fn: Callable[..., Any]
    dtype: str = "float64"
    note: str = ""
    outputs: int = 1
    used: tuple[int, ...] = (0,)
    opset: int = 18
    rtol: float | None = None
    build: dict[str, Any] = dataclasses.field(default_factory=dict)


FP32_CONV = "ORT CPU has no float64 Conv/ConvTranspose kernels"
FP32_POOL = "ORT CPU has no float64 AveragePool/ConvTranspose kernels"
FP32_RNN = "ORT CPU has RNN/GRU/LSTM kernels in float32 only"
R = np.random.default_rng(1234)


def ints(*v: int) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


def _binary_cases() -> list[Case]:
    shapes = [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 4), (1, 4)), ((3, 1), (1, 4)), ((2, 3, 4), (3, 1)),
              ((4,), (2, 3, 4)), ((3, 4), ()), (("N", 4), (4,)), (("N", 1), ("N", 4))]
    fns = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow}
    cases = []
    for op, fn in fns.items():
        for a, b in shapes:
            positive = op in ("Div", "Pow")
            cases.append(Case(f"{op}-{a}-{b}", op, [Var(a, positive), Var(b, positive)], {}, fn))
    return cases


def _where(c, x, y):
    return torch.where(c, x, y)


def torch_gather_nd(x: Any, indices: Any, batch_dims: int = 0) -> Any:
    """ONNX GatherND in torch (advanced indexing), negative indices and batch_dims included."""
    k = indices.shape[-1]
    lead = x.reshape(-1, *x.shape[batch_dims:])  # [P, *x.shape[b:]]
    tuples = indices.long().reshape(lead.shape[0], -1, k) % torch.tensor(x.shape[batch_dims:batch_dims + k])
    picked = lead[(torch.arange(lead.shape[0])[:, None], *tuples.unbind(-1))]  # [P, M, *x.shape[b + k:]]
    return picked.reshape(*indices.shape[:-1], *x.shape[batch_dims + k:])


def torch_attention(q: Any, k: Any, v: Any, mask: Any = None, *, causal: bool = False, scale: float | None = None,
                    softcap: float = 0.0, heads: tuple[int, int] | None = None) -> Any:
    """ONNX Attention in torch: 3-D inputs split into ``heads = (q heads, kv heads)``, the causal
    triangle and the mask as one additive bias, then SDPA with GQA; with a softcap (SDPA has
    none) the same by hand, fully masked rows zeroed as the spec and SDPA do. The scale is
    the op's: Q and K each times ``sqrt(scale)`` rounded to float32, as its function body
    and ORT's float64 kernel compute it (1e-7 from the exact scale)."""
    if heads is not None:
        q, k, v = (x.reshape(*x.shape[:2], h, -1).transpose(1, 2) for x, h in zip((q, k, v), (heads[0], *heads[1:] * 2)))
    scale = float(np.float32(np.sqrt(np.float32(scale or q.shape[-1] ** -0.5)))) ** 2
    bias = torch.zeros(q.shape[2], k.shape[2], dtype=q.dtype)
    if causal:
        bias = bias.masked_fill(~torch.ones_like(bias, dtype=torch.bool).tril(), -torch.inf)
    if mask is not None:
        bias = bias + (torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else mask)
    if not softcap:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    else:
        reps = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
        scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
        y = torch.softmax(scores + bias, -1).nan_to_num(0.0) @ v
    return y if heads is None else y.transpose(1, 2).flatten(2)


def torch_rotary(x: Any, cos: Any, sin: Any, position_ids: Any = None, *, interleaved: int = 0, dim: int = 0,
                 num_heads: int = 0) -> Any:
    """ONNX RotaryEmbedding in torch: each pair (x1, x2) of the first ``dim`` features (halves,
    or even/odd with ``interleaved``) turned by the cached angle of its position."""
    shape = x.shape
    x = x.transpose(1, 2) if x.dim() == 4 else x.reshape(*shape[:2], num_heads, -1)  # [B, S, H, D]
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rot, rest = x[..., :dim or x.shape[-1]], x[..., dim or x.shape[-1]:]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, -1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rot = torch.stack((real, imag), -1).flatten(-2) if interleaved else torch.cat((real, imag), -1)
    out = torch.cat((rot, rest), -1)
    return out.transpose(1, 2) if len(shape) == 4 else out.reshape(shape)


def _angles(positions: int, half: int, batch: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin caches of RoPE's angles ``p / 10000^(2i/dim)``, with an optional batch
    of random positions in front (the caches a model without position_ids passes)."""
    p = R.integers(0, 16, (*batch, positions)) if batch else np.arange(positions)
    theta = p[..., None] / 10000.0 ** (np.arange(half) / half)
    return np.cos(theta), np.sin(theta)


COS, SIN = _angles(16, 4)
COS2, SIN2 = _angles(16, 2)
BCOS, BSIN = _angles(5, 4, (2,))
FP32_ROPE = "ORT CPU RotaryEmbedding is float32 only"


CASES: list[Case] = _binary_cases() + [
    Case("Sum-3-broadcast", "Sum", [Var((3, 4)), Var((4,)), Var((3, 1))], {}, lambda a, b, c: a + b + c),
    Case("Where-broadcast", "Where", [R.random((3, 4)) > 0.5, Var((3, 1)), Var((4,))], {}, _where),
    Case("PRelu-channel", "PRelu", [Var((2, 3, 4)), Var((3, 1))], {}, lambda x, s: torch.where(x > 0, x, s * x)),
    Case("Pow-const-2", "Pow", [Var((3, 4)), np.asarray(2.0)], {}, lambda x, e: x**e),
    Case("Pow-const-3", "Pow", [Var((3, 4)), np.asarray(3.0)], {}, lambda x, e: x**e),
    Case("Neg", "Neg", [Var((3, 4))], {}, torch.neg),
    Case("Reciprocal", "Reciprocal", [Var((3, 4), positive=True)], {}, torch.reciprocal),
    Case("Sqrt", "Sqrt", [Var((3, 4), positive=True)], {}, torch.sqrt),
    Case("Exp", "Exp", [Var((3, 4))], {}, torch.exp),
    Case("Log", "Log", [Var((3, 4), positive=True)], {}, torch.log),
    Case("Tanh", "Tanh", [Var((3, 4))], {}, torch.tanh),
    Case("Sigmoid", "Sigmoid", [Var((3, 4))], {}, torch.sigmoid),
    Case("Erf", "Erf", [Var((3, 4))], {}, torch.erf, dtype="float32", note="ORT CPU Erf is float32 only"),
    Case("Abs", "Abs", [Var((3, 4))], {}, torch.abs),
    Case("Relu", "Relu", [Var(("N", 4))], {}, torch.relu),
    Case("LeakyRelu", "LeakyRelu", [Var((3, 4))], {"alpha": 0.2}, lambda x: F.leaky_relu(x, 0.2)),
    Case("Elu", "Elu", [Var((3, 4))], {"alpha": 0.7}, lambda x: F.elu(x, 0.7)),
    Case("Selu", "Selu", [Var((3, 4))], {}, F.selu),
    Case("Softplus", "Softplus", [Var((3, 4))], {}, F.softplus),
    Case("Clip", "Clip", [Var((3, 4)), np.asarray(-0.5), np.asarray(0.6)], {}, lambda x, lo, hi: torch.clamp(x, lo, hi)),
    Case("Clip-min-only", "Clip", [Var((3, 4)), np.asarray(-0.5)], {}, lambda x, lo: torch.clamp(x, min=lo)),
    Case("Gelu-erf", "Gelu", [Var((3, 4))], {}, F.gelu, opset=20, dtype="float32", note="ORT CPU Gelu is float32 only"),
    Case("Gelu-tanh", "Gelu", [Var((3, 4))], {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh"),
         opset=20, dtype="float32", note="ORT CPU Gelu is float32 only"),
    Case("Identity", "Identity", [Var((3, 4))], {}, lambda x: x),
    Case("Cast-f32-f64", "Cast", [Var((3, 4))], {"to": TensorProto.DOUBLE}, lambda x: x.double(),
         dtype="float32", note="the input of a widening Cast is float32 by construction"),
    Case("Expand", "Expand", [Var((3, 1)), ints(2, 3, 4)], {}, lambda x, s: x.expand(2, 3, 4)),
    Case("Expand-rank-up-dynamic", "Expand", [Var(("N", 1)), ints(2, 1, 4)], {}, lambda x, s: x.expand(2, -1, 4)),
    Case("Expand-shape-of-ones", "Expand", [Var((2, 3, 4)), ints(3, 1)], {}, lambda x, s: x * 1),
    Case("Expand-middle", "Expand", [Var((3, 1, 2)), ints(3, 4, 1)], {}, lambda x, s: x.expand(3, 4, 2)),
    Case("Dropout-train-p0", "Dropout", [Var((3, 4)), np.asarray(0.0), np.asarray(True)], {},
         lambda x, r, t: F.dropout(x, 0.0, True), outputs=2),
    Case("Dropout-eval", "Dropout", [Var((3, 4))], {}, lambda x: x),
    # linear algebra
    Case("MatMul-2d", "MatMul", [Var((3, 4)), Var((4, 5))], {}, torch.matmul),
    Case("MatMul-3d-2d", "MatMul", [Var(("N", 3, 4)), Var((4, 5))], {}, torch.matmul),
    Case("MatMul-batched", "MatMul", [Var((2, 3, 4)), Var((2, 4, 5))], {}, torch.matmul),
    Case("MatMul-broadcast", "MatMul", [Var((2, 1, 3, 4)), Var((3, 4, 5))], {}, torch.matmul),
    Case("MatMul-1d-left", "MatMul", [Var((4,)), Var((2, 4, 5))], {}, torch.matmul),
    Case("MatMul-1d-right", "MatMul", [Var((3, 4)), Var((4,))], {}, torch.matmul),
    Case("Gemm", "Gemm", [Var(("N", 4)), Var((4, 5)), Var((5,))], {}, lambda a, b, c: a @ b + c),
    Case("Gemm-tA-tB-alpha-beta", "Gemm", [Var((4, 3)), Var((5, 4)), Var((1, 5))],
         {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}, lambda a, b, c: 0.5 * a.T @ b.T + 2.0 * c),
    Case("Gemm-tB-C-full", "Gemm", [Var((3, 4)), Var((5, 4)), Var((3, 5))], {"transB": 1}, lambda a, b, c: a @ b.T + c),
    Case("Gemm-tA-noC", "Gemm", [Var((4, 3)), Var((4, 5))], {"transA": 1}, lambda a, b: a.T @ b),
    # convolution and pooling
    Case("Conv1d", "Conv", [Var(("N", 2, 9)), Var((3, 2, 3)), Var((3,))], {"pads": [1, 1]},
         lambda x, w, b: F.conv1d(x, w, b, padding=1), dtype="float32", note=FP32_CONV),
    Case("Conv2d-stride-pad-dil", "Conv", [Var((2, 3, 9, 8)), Var((4, 3, 3, 2)), Var((4,))],
         {"strides": [2, 1], "pads": [1, 0, 1, 0], "dilations": [1, 2]},
         lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
         dtype="float32", note=FP32_CONV),
    Case("Conv2d-stride-remainder", "Conv", [Var((2, 2, 10, 9)), Var((3, 2, 3, 3))], {"strides": [3, 2]},
         lambda x, w: F.conv2d(x, w, stride=(3, 2)), dtype="float32", note=FP32_CONV),
    Case("Conv2d-big-kernel-slices", "Conv", [Var(("N", 2, 20, 19)), Var((3, 2, 5, 4)), Var((3,))],
         {"strides": [3, 2], "pads": [1, 2, 0, 1], "dilations": [1, 2]},
         lambda x, w, b: F.conv2d(F.pad(x, (2, 1, 1, 0)), w, b, stride=(3, 2), dilation=(1, 2)),
         dtype="float32", note=FP32_CONV),
    Case("Conv2d-groups", "Conv", [Var((2, 4, 7, 7)), Var((6, 2, 3, 3)), Var((6,))], {"group": 2, "pads": [1, 1, 1, 1]},
         lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2), dtype="float32", note=FP32_CONV),
    Case("Conv2d-depthwise-stride", "Conv", [Var(("N", 3, 8, 8)), Var((3, 1, 3, 3))], {"group": 3, "strides": [2, 2]},
         lambda x, w: F.conv2d(x, w, stride=2, groups=3), dtype="float32", note=FP32_CONV),
    # Output positions per sample <= 2x output channels per group: the weight gradient's
    # single-GEMM layout (the cases above take the per-sample one).
    Case("Conv2d-small-map-gemm", "Conv", [Var(("N", 3, 4, 4)), Var((8, 3, 3, 3)), Var((8,))], {"pads": [1, 1, 1, 1]},
         lambda x, w, b: F.conv2d(x, w, b, padding=1), dtype="float32", note=FP32_CONV),
    Case("Conv2d-groups-small-map", "Conv", [Var((2, 4, 3, 3)), Var((8, 2, 2, 2))], {"group": 2},
         lambda x, w: F.conv2d(x, w, groups=2), dtype="float32", note=FP32_CONV),
    Case("ConvTranspose2d-small-map", "ConvTranspose", [Var(("N", 6, 2, 2)), Var((6, 3, 3, 3))], {"strides": [2, 2]},
         lambda x, w: F.conv_transpose2d(x, w, stride=2), dtype="float32", note=FP32_CONV),
    # Stride dividing the kernel, no pads, one group: the weight gradient through SpaceToDepth
    # (odd sizes: the rows past the last whole block are cropped).
    Case("Conv2d-space-to-depth-crop", "Conv", [Var(("N", 2, 13, 12)), Var((3, 2, 4, 4)), Var((3,))], {"strides": [2, 2]},
         lambda x, w, b: F.conv2d(x, w, b, stride=2), dtype="float32", note=FP32_CONV),
    Case("Conv2d-space-to-depth-8x8-4", "Conv", [Var((2, 1, 16, 16)), Var((2, 1, 8, 8))], {"strides": [4, 4]},
         lambda x, w: F.conv2d(x, w, stride=4), dtype="float32", note=FP32_CONV),
    Case("Conv2d-asym-pads", "Conv", [Var((1, 2, 6, 6)), Var((2, 2, 3, 3))], {"pads": [0, 1, 2, 0]},
         lambda x, w: F.conv2d(F.pad(x, (1, 0, 0, 2)), w), dtype="float32", note=FP32_CONV),
    Case("Conv2d-same-upper", "Conv", [Var((1, 2, 7, 7)), Var((2, 2, 3, 3))], {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
         lambda x, w: F.conv2d(F.pad(x, (1, 1, 1, 1)), w, stride=2), dtype="float32", note=FP32_CONV),
    Case("ConvTranspose2d", "ConvTranspose", [Var(("N", 4, 5, 4)), Var((4, 3, 3, 2)), Var((3,))],
         {"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]},
         lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 1), dilation=(1, 2))[:, :, 1:, :-1],
         dtype="float32", note=FP32_CONV),
    Case("ConvTranspose1d-groups-outpad", "ConvTranspose", [Var((2, 4, 6)), Var((4, 3, 3))],
         {"strides": [2], "group": 2, "output_padding": [1]},
         lambda x, w: F.conv_transpose1d(x, w, stride=2, groups=2, output_padding=1), dtype="float32", note=FP32_CONV),
    Case("MaxPool2d", "MaxPool", [Var(("N", 2, 6, 6))], {"kernel_shape": [2, 2], "strides": [2, 2]},
         lambda x: F.max_pool2d(x, 2, 2)),
    Case("MaxPool2d-overlap-pad", "MaxPool", [Var((2, 2, 7, 7))], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         lambda x: F.max_pool2d(x, 3, 2, 1)),
    Case("MaxPool1d-dilation-pad", "MaxPool", [Var((2, 2, 40))], {"kernel_shape": [5], "strides": [3], "pads": [2, 2], "dilations": [2]},
         lambda x: F.max_pool1d(x, 5, 3, 2, dilation=2)),
    Case("MaxPool1d", "MaxPool", [Var((2, 3, 9))], {"kernel_shape": [3], "strides": [2]}, lambda x: F.max_pool1d(x, 3, 2)),
    Case("AveragePool2d", "AveragePool", [Var(("N", 2, 6, 6))], {"kernel_shape": [2, 2], "strides": [2, 2]},
         lambda x: F.avg_pool2d(x, 2, 2), dtype="float32", note=FP32_POOL),
    Case("AveragePool2d-pad-exclude", "AveragePool", [Var((2, 2, 7, 7))],
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), dtype="float32", note=FP32_POOL),
    Case("AveragePool2d-pad-include", "AveragePool", [Var((2, 2, 7, 7))],
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
         lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=True), dtype="float32", note=FP32_POOL),
    Case("GlobalAveragePool", "GlobalAveragePool", [Var(("N", 3, 4, 5))], {}, lambda x: x.mean((2, 3), keepdim=True),
         dtype="float32", note="ORT CPU GlobalAveragePool is float32 only"),
    # normalization and softmax
    Case("Softmax", "Softmax", [Var(("N", 5))], {}, lambda x: torch.softmax(x, -1)),
    Case("Softmax-axis1", "Softmax", [Var((2, 3, 4))], {"axis": 1}, lambda x: torch.softmax(x, 1)),
    Case("LogSoftmax", "LogSoftmax", [Var((3, 5))], {}, lambda x: torch.log_softmax(x, -1)),
    Case("LayerNormalization", "LayerNormalization", [Var(("N", 3, 6)), Var((6,)), Var((6,))], {},
         lambda x, s, b: F.layer_norm(x, (6,), s, b, eps=1e-5), outputs=3,
         dtype="float32", note="ORT CPU LayerNormalization statistics are float32 (stash_type)"),
    Case("LayerNormalization-axis1", "LayerNormalization", [Var((2, 3, 4)), Var((3, 4)), Var((3, 4))], {"axis": 1},
         lambda x, s, b: F.layer_norm(x, (3, 4), s, b, eps=1e-5), outputs=3,
         dtype="float32", note="ORT CPU LayerNormalization statistics are float32 (stash_type)"),
    Case("RMSNormalization", "RMSNormalization", [Var(("N", 3, 6)), Var((6,))], {},
         lambda x, s: F.rms_norm(x, (6,), s, eps=1e-5), opset=23),
    Case("RMSNormalization-axis1-eps", "RMSNormalization", [Var((2, 3, 4)), Var((3, 4))], {"axis": 1, "epsilon": 1e-3},
         lambda x, s: F.rms_norm(x, (3, 4), s, eps=1e-3), opset=23),
    # scale broadcast over the normalized axes (only its last one given): dscale sums over the rest
    Case("RMSNormalization-axis-neg2-scale-broadcast", "RMSNormalization", [Var((2, 3, 4)), Var((4,))], {"axis": -2},
         lambda x, s: F.rms_norm(x, (3, 4), eps=1e-5) * s, opset=23),
    Case("BatchNormalization-train", "BatchNormalization",
         [Var(("N", 3, 4, 5)), Var((3,)), Var((3,)), np.zeros(3), np.ones(3)], {"training_mode": 1},
         lambda x, s, b, m, v: F.batch_norm(x, None, None, s, b, training=True, eps=1e-5), outputs=3,
         dtype="float32", note="ORT CPU BatchNormalization training mode is float32 only"),
    Case("BatchNormalization-eval", "BatchNormalization",
         [Var((2, 3, 4)), Var((3,)), Var((3,)), R.standard_normal(3), R.random(3) + 0.5], {},
         lambda x, s, b, m, v: F.batch_norm(x, m, v, s, b, training=False, eps=1e-5), build={"batchnorm": "eval"}),
    Case("LRN", "LRN", [Var(("N", 7, 3, 2))], {"size": 3, "alpha": 0.3, "beta": 0.75, "bias": 2.0},
         lambda x: F.local_response_norm(x, 3, 0.3, 0.75, 2.0), dtype="float32", note="ORT CPU LRN and Conv are float32 only"),
    Case("LRN-size5", "LRN", [Var((2, 6, 4, 1))], {"size": 5, "alpha": 0.5, "beta": 0.6},
         lambda x: F.local_response_norm(x, 5, 0.5, 0.6, 1.0), dtype="float32", note="ORT CPU LRN and Conv are float32 only"),
    # transformer ops (rules/attention.py), opsets 23 and 24: MHA cross attention (Sq != Skv),
    # causal, GQA/MQA, boolean and float masks (a float mask is differentiated: T5's learned
    # position bias arrives that way), a row the mask leaves without keys, 3-D inputs, scale, softcap
    Case("Attention-4d-cross", "Attention", [Var(("N", 2, 4, 8)), Var(("N", 2, 5, 8)), Var(("N", 2, 5, 8))], {},
         torch_attention, opset=23),
    Case("Attention-4d-causal-opset24", "Attention", [Var((2, 2, 5, 8)), Var((2, 2, 5, 8)), Var((2, 2, 5, 8))],
         {"is_causal": 1}, lambda q, k, v: torch_attention(q, k, v, causal=True), opset=24),
    Case("Attention-4d-gqa-causal-bool-mask", "Attention",
         [Var((2, 4, 5, 8)), Var((2, 2, 5, 8)), Var((2, 2, 5, 6)), R.random((2, 1, 5, 5)) > 0.3], {"is_causal": 1},
         lambda q, k, v, m: torch_attention(q, k, v, m, causal=True), opset=23),
    Case("Attention-4d-bool-mask-empty-row", "Attention",
         [Var((2, 2, 4, 8)), Var((2, 2, 6, 8)), Var((2, 2, 6, 8)), np.arange(6) < np.asarray([[3], [0], [6], [1]])], {},
         torch_attention, opset=24),
    Case("Attention-4d-mqa-float-mask-grad", "Attention",
         [Var((2, 4, 5, 8)), Var((2, 1, 6, 8)), Var((2, 1, 6, 8)), Var((1, 4, 5, 6))], {"scale": 0.2},
         lambda q, k, v, m: torch_attention(q, k, v, m, scale=0.2), opset=23),
    Case("Attention-3d-gqa-scale-softcap", "Attention", [Var(("N", 5, 16)), Var(("N", 6, 8)), Var(("N", 6, 6))],
         {"q_num_heads": 4, "kv_num_heads": 2, "scale": 0.3, "softcap": 2.0},
         lambda q, k, v: torch_attention(q, k, v, scale=0.3, softcap=2.0, heads=(4, 2)), opset=23),
    Case("Attention-3d-causal-float-mask-softcap", "Attention",
         [Var((2, 5, 12)), Var((2, 5, 12)), Var((2, 5, 9)), R.standard_normal((5, 5))],
         {"q_num_heads": 3, "kv_num_heads": 3, "is_causal": 1, "softcap": 1.5},
         lambda q, k, v, m: torch_attention(q, k, v, m, causal=True, softcap=1.5, heads=(3, 3)), opset=24),
    Case("RotaryEmbedding-4d-position-ids", "RotaryEmbedding", [Var((2, 3, 5, 8)), COS, SIN, R.integers(0, 16, (2, 5))], {},
         torch_rotary, opset=23, dtype="float32", note=FP32_ROPE),
    Case("RotaryEmbedding-4d-interleaved-no-position-ids", "RotaryEmbedding", [Var((2, 3, 5, 8)), BCOS, BSIN],
         {"interleaved": 1}, lambda x, c, s: torch_rotary(x, c, s, interleaved=1), opset=23, dtype="float32", note=FP32_ROPE),
    Case("RotaryEmbedding-3d-partial-position-ids", "RotaryEmbedding", [Var(("N", 5, 24)), COS2, SIN2, R.integers(0, 16, (3, 5))],
         {"num_heads": 3, "rotary_embedding_dim": 4},
         lambda x, c, s, p: torch_rotary(x, c, s, p, dim=4, num_heads=3), opset=23, dtype="float32", note=FP32_ROPE),
    Case("RotaryEmbedding-3d-interleaved-partial", "RotaryEmbedding", [Var((2, 5, 24)), BCOS[..., :2], BSIN[..., :2]],
         {"num_heads": 3, "rotary_embedding_dim": 4, "interleaved": 1},
         lambda x, c, s: torch_rotary(x, c, s, interleaved=1, dim=4, num_heads=3), opset=23, dtype="float32", note=FP32_ROPE),
    # data movement
    Case("Reshape", "Reshape", [Var((2, 3, 4)), ints(6, 4)], {}, lambda x, s: x.reshape(6, 4)),
    Case("Flatten", "Flatten", [Var(("N", 3, 4))], {"axis": 1}, lambda x: x.flatten(1)),
    Case("Transpose", "Transpose", [Var((2, 3, 4))], {"perm": [2, 0, 1]}, lambda x: x.permute(2, 0, 1)),
    Case("Squeeze", "Squeeze", [Var((3, 1, 4)), ints(1)], {}, lambda x, a: x.squeeze(1)),
    Case("Unsqueeze", "Unsqueeze", [Var((3, 4)), ints(0, 2)], {}, lambda x, a: x.unsqueeze(0).unsqueeze(2)),
    Case("Concat", "Concat", [Var(("N", 2)), Var(("N", 3)), Var(("N", 1))], {"axis": 1}, lambda a, b, c: torch.cat([a, b, c], 1)),
    Case("Split-num-outputs", "Split", [Var((3, 6))], {"axis": 1, "num_outputs": 2},
         lambda x: torch.split(x, 3, 1), outputs=2, used=(0, 1)),
    Case("Split-sizes-one-used", "Split", [Var((5, 3)), ints(2, 3)], {"axis": 0},
         lambda x, s: torch.split(x, [2, 3], 0)[1:], outputs=2, used=(1,)),
    Case("Split-num-outputs-uneven", "Split", [Var((7, 2))], {"axis": 0, "num_outputs": 3},
         lambda x: torch.split(x, 3, 0), outputs=3, used=(0, 1, 2)),
    Case("Split-sizes-neg-axis-middle-unused", "Split", [Var((2, 6, 3)), ints(1, 2, 3)], {"axis": -2},
         lambda x, s: torch.split(x, [1, 2, 3], 1)[::2], outputs=3, used=(0, 2)),
    Case("Split-num-outputs-dynamic", "Split", [Var(("N", 4))], {"axis": -1, "num_outputs": 4},
         lambda x: torch.split(x, 1, 1)[1:], outputs=4, used=(1, 2, 3)),
    Case("Slice-unit-step", "Slice", [Var(("N", 6, 5)), ints(1, 0), ints(4, 3), ints(1, 2)], {},
         lambda x, s, e, a: x[:, 1:4, 0:3]),
    Case("Slice-negative-step", "Slice", [Var((6, 5)), ints(-1, 1), ints(-100, 5), ints(0, 1), ints(-2, 2)], {},
         lambda x, s, e, a, st: torch.flip(x, [0])[::2, 1:5:2]),
    # Slice bounds as exporters write them: negative, clamped (out of range), omitted axes.
    Case("Slice-negative-starts-unit-step", "Slice", [Var((6, 5)), ints(-4, -3), ints(-1, 100), ints(0, -1)], {},
         lambda x, s, e, a: x[-4:-1, -3:]),
    Case("Slice-clamped-bounds-omitted-axes", "Slice", [Var((4, 5)), ints(-100, 1), ints(3, 2**63 - 1)], {},
         lambda x, s, e: x[0:3, 1:]),
    Case("Slice-start-past-end", "Slice", [Var((4, 5)), ints(9, 0), ints(12, 5)], {}, lambda x, s, e: x[9:12]),
    Case("Slice-dynamic-dim-negative-start", "Slice", [Var(("N", 6)), ints(-2), ints(2**63 - 1), ints(0)], {},
         lambda x, s, e, a: x[-2:]),
    Case("Slice-negative-step-clamped-neg-axis", "Slice", [Var((5, 6)), ints(100), ints(-100), ints(-1), ints(-3)], {},
         lambda x, s, e, a, st: torch.flip(x, [1])[:, ::3]),
    Case("Slice-step2-negative-start", "Slice", [Var((3, 9)), ints(-8), ints(-1), ints(1), ints(2)], {},
         lambda x, s, e, a, st: x[:, -8:-1:2]),
    Case("Gather-embedding", "Gather", [Var((5, 3)), ints(0, 2, 2, 4, -1, 0).reshape(2, 3)], {},
         lambda w, i: w[i]),
    Case("Gather-axis1", "Gather", [Var((2, 5, 3)), ints(4, 1, 1)], {"axis": 1}, lambda w, i: w[:, i]),
    # Gather for every index rank (0, 1, 2+), axis (negative too), negative and repeated indices.
    # Rank-0 index on axis 1 is the BERT/ViT pooler's hidden[:, 0].
    Case("Gather-axis1-scalar-index", "Gather", [Var(("N", 5, 3)), np.asarray(0, np.int64)], {"axis": 1},
         lambda w, i: w[:, i]),
    Case("Gather-axis0-scalar-negative-index", "Gather", [Var((5, 3)), np.asarray(-2, np.int64)], {}, lambda w, i: w[i]),
    Case("Gather-last-axis-scalar-index", "Gather", [Var((3, 4)), np.asarray(-1, np.int64)], {"axis": -1},
         lambda w, i: w[:, i]),
    Case("Gather-neg-axis", "Gather", [Var((2, 3, 5)), ints(4, 0, 2)], {"axis": -1}, lambda w, i: w[..., i]),
    Case("Gather-neg-indices", "Gather", [Var((4, 6)), ints(-1, -6, 2)], {"axis": 1}, lambda w, i: w[:, i]),
    Case("Gather-repeated", "Gather", [Var((3, 4, 2)), ints(1, 1, -3, 1, 0)], {"axis": 1}, lambda w, i: w[:, i]),
    Case("Gather-2d-indices-axis1", "Gather", [Var((2, 5, 3)), ints(0, 4, -1, 4, 2, 0).reshape(2, 3)], {"axis": 1},
         lambda w, i: w[:, i]),
    Case("Gather-3d-indices-neg-axis", "Gather", [Var(("N", 2, 4)), ints(3, -4, 1, 1, 0, 3, 2, -1).reshape(2, 2, 2)],
         {"axis": -1}, lambda w, i: w[:, :, i]),
    Case("Gather-int32-indices", "Gather", [Var((5, 3)), np.asarray([[1, -1], [1, 0]], np.int32)], {},
         lambda w, i: w[i.long()]),
    Case("GatherElements-axis1", "GatherElements", [Var((3, 4)), ints(0, 3, -1, 3, 1, 1, 2, -4, 0, 0, 3, 2, 1, -2, 1).reshape(3, 5)],
         {"axis": 1}, lambda x, i: torch.gather(x, 1, i % 4)),
    Case("GatherElements-axis0-smaller", "GatherElements", [Var((4, 3)), ints(3, 0, -1, 3, 3, 1).reshape(2, 3)], {},
         lambda x, i: torch.gather(x, 0, i % 4)),
    Case("GatherElements-neg-axis-int32", "GatherElements", [Var(("N", 3, 4)), R.integers(-4, 4, (3, 3, 6)).astype(np.int32)],
         {"axis": -1}, lambda x, i: torch.gather(x, 2, i.long() % 4)),
    Case("GatherND-tuples", "GatherND", [Var((3, 4)), ints(0, 1, 2, -1, 0, 1, -3, 1).reshape(4, 2)], {},
         lambda x, i: torch_gather_nd(x, i)),
    Case("GatherND-rows", "GatherND", [Var((3, 4, 2)), ints(2, -1, 0, 2).reshape(2, 2, 1)], {},
         lambda x, i: torch_gather_nd(x, i)),
    Case("GatherND-batch-dims1", "GatherND", [Var((2, 3, 4)), ints(2, 0, 2, -1, 1, 1, 0, 1).reshape(2, 2, 2)], {"batch_dims": 1},
         lambda x, i: torch_gather_nd(x, i, 1)),
    Case("GatherND-batch-dims2", "GatherND", [Var((2, 3, 4, 5)), R.integers(-4, 4, (2, 3, 3, 1))], {"batch_dims": 2},
         lambda x, i: torch_gather_nd(x, i, 2)),
    Case("Tile", "Tile", [Var((2, 3)), ints(2, 3)], {}, lambda x, r: x.repeat(2, 3)),
    Case("Tile-dynamic-ones", "Tile", [Var(("N", 2, 1)), ints(1, 2, 3)], {}, lambda x, r: x.repeat(1, 2, 3)),
    Case("Pad-constant", "Pad", [Var(("N", 3, 4)), ints(0, 1, 2, 0, 0, 1)], {},
         lambda x, p: F.pad(x, (2, 1, 1, 0))),
    Case("Pad-reflect", "Pad", [Var(("N", 2, 5, 4)), ints(0, 0, 2, 1, 0, 0, 1, 3)], {"mode": "reflect"},
         lambda x, p: F.pad(x, (1, 3, 2, 1), mode="reflect")),
    Case("Pad-edge-axes", "Pad", [Var((2, 3, 4)), ints(2, 0, 1, 3), None, ints(1, 2)], {"mode": "edge"},
         lambda x, p, a: F.pad(x, (0, 3, 2, 1), mode="replicate")),
    Case("Pad-constant-negative-crop", "Pad", [Var((3, 5)), ints(1, -2, -1, 1)], {}, lambda x, p: F.pad(x, (-2, 1, 1, -1))),
    Case("Pad-constant-negative-axes", "Pad", [Var((2, 4, 3)), ints(-1, 2, 0, -1), None, ints(-1, 1)], {},
         lambda x, p, a: F.pad(x, (-1, 0, 2, -1))),
    Case("ReduceSum", "ReduceSum", [Var(("N", 3, 4)), ints(1)], {"keepdims": 0}, lambda x, a: x.sum(1)),
    Case("ReduceSum-all", "ReduceSum", [Var((3, 4))], {}, lambda x: x.sum().reshape(1, 1)),
    Case("ReduceMean", "ReduceMean", [Var(("N", 3, 4)), ints(-1, 1)], {}, lambda x, a: x.mean((1, 2), keepdim=True)),
    Case("ReduceMean-all-nokeep", "ReduceMean", [Var((3, 4))], {"keepdims": 0}, lambda x: x.mean()),
    Case("ReduceMax", "ReduceMax", [Var((3, 4, 5)), ints(1)], {"keepdims": 0}, lambda x, a: x.amax(1)),
    Case("ReduceMax-all", "ReduceMax", [Var((3, 4))], {}, lambda x: x.amax().reshape(1, 1)),
    # losses
    Case("SoftmaxCrossEntropyLoss-mean", "SoftmaxCrossEntropyLoss", [Var(("N", 5)), ints(0, 3, 4)], {},
         lambda s, y: F.cross_entropy(s, y), dtype="float32", note="ORT CPU SoftmaxCrossEntropyLoss is float32 only"),
    Case("SoftmaxCrossEntropyLoss-weights-ignore-logprob", "SoftmaxCrossEntropyLoss",
         [Var((4, 5, 2)), ints(0, 3, 4, 1, 2, 2, 0, 1).reshape(4, 2), R.random(5) + 0.5], {"ignore_index": 1},
         lambda s, y, w: (F.cross_entropy(s, y, w, ignore_index=1), torch.log_softmax(s, 1)), outputs=2, used=(0, 1),
         dtype="float32", note="ORT CPU SoftmaxCrossEntropyLoss is float32 only"),
    # Only the loss differentiated: the rule's (softmax - one_hot) * scale form.
    Case("SoftmaxCrossEntropyLoss-weights-ignore", "SoftmaxCrossEntropyLoss",
         [Var((4, 5, 2)), ints(0, 3, 4, 1, 2, 2, 0, 1).reshape(4, 2), R.random(5) + 0.5], {"ignore_index": 1},
         lambda s, y, w: F.cross_entropy(s, y, w, ignore_index=1), dtype="float32",
         note="ORT CPU SoftmaxCrossEntropyLoss is float32 only"),
    Case("SoftmaxCrossEntropyLoss-none", "SoftmaxCrossEntropyLoss", [Var((3, 4)), ints(0, 3, 2)], {"reduction": "none"},
         lambda s, y: F.cross_entropy(s, y, reduction="none"), dtype="float32", note="ORT CPU SoftmaxCrossEntropyLoss is float32 only"),
    Case("NegativeLogLikelihoodLoss-sum", "NegativeLogLikelihoodLoss", [Var((3, 4)), ints(0, 3, 2)], {"reduction": "sum"},
         lambda s, y: F.nll_loss(s, y, reduction="sum"), dtype="float32", note="ORT CPU NegativeLogLikelihoodLoss is float32 only"),
    Case("NegativeLogLikelihoodLoss-weights", "NegativeLogLikelihoodLoss", [Var((3, 4, 2)), ints(0, 3, 2, 1, 1, 0).reshape(3, 2), R.random(4) + 0.5],
         {}, lambda s, y, w: F.nll_loss(s, y, w), dtype="float32", note="ORT CPU NegativeLogLikelihoodLoss is float32 only"),
    # activations exporters emit as single ops (rules/activation.py)
    Case("HardSigmoid", "HardSigmoid", [Var((4, 6))], {}, lambda x: torch.clamp(0.2 * x + 0.5, 0, 1)),
    Case("HardSigmoid-saturating", "HardSigmoid", [Var((4, 6))], {"alpha": 1.0, "beta": 0.3},
         lambda x: torch.clamp(x + 0.3, 0, 1)),
    Case("HardSwish", "HardSwish", [Var((16, 32))], {}, F.hardswish),
    Case("Mish", "Mish", [Var(("N", 5))], {}, F.mish),
    Case("Softsign", "Softsign", [Var((3, 4))], {}, F.softsign),
    Case("Celu", "Celu", [Var((3, 4))], {"alpha": 0.7}, lambda x: F.celu(x, 0.7),
         dtype="float32", note="ORT CPU Celu is float32 only"),
    Case("ThresholdedRelu", "ThresholdedRelu", [Var((4, 6))], {"alpha": 0.3},
         lambda x: torch.where(x > 0.3, x, torch.zeros_like(x))),
    Case("Swish", "Swish", [Var((3, 4))], {"alpha": 1.5}, lambda x: x * torch.sigmoid(1.5 * x), opset=24),
    Case("Sin", "Sin", [Var((3, 4))], {}, torch.sin),
    Case("Cos", "Cos", [Var((3, 4))], {}, torch.cos),
    Case("Shrink", "Shrink", [Var((4, 6))], {"lambd": 0.6, "bias": 0.2},
         lambda x: torch.where(x > 0.6, x - 0.2, torch.where(x < -0.6, x + 0.2, torch.zeros_like(x))),
         dtype="float32", note="ORT CPU's float64 Shrink rounds to float32 (finite differences off by 1%)"),
    # instance and group normalization (rules/groupnorm.py)
    Case("InstanceNormalization", "InstanceNormalization", [Var(("N", 3, 4, 5)), Var((3,)), Var((3,))], {"epsilon": 1e-3},
         lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-3),
         dtype="float32", note="ORT CPU InstanceNormalization is float32 only"),
    # torch's GroupNorm export: Reshape -> InstanceNormalization(ones, zeros) -> Reshape -> Mul -> Add.
    Case("InstanceNormalization-groupnorm-export", "InstanceNormalization", [Var((2, 4, 6)), np.ones(4), np.zeros(4)], {},
         lambda x, s, b: F.instance_norm(x, eps=1e-5), dtype="float32", note="ORT CPU InstanceNormalization is float32 only"),
    # The checker refuses GroupNormalization-18 (deprecated), but ORT runs it: build unvalidated.
    Case("GroupNormalization-18", "GroupNormalization", [Var(("N", 6, 3, 2)), Var((3,)), Var((3,))], {"num_groups": 3},
         lambda x, s, b: (F.group_norm(x, 3, eps=1e-5).reshape(x.shape[0], 3, -1) * s[:, None] + b[:, None]).reshape(x.shape),
         build={"validate": False}),
    Case("GroupNormalization-21", "GroupNormalization", [Var((2, 6, 5)), Var((6,)), Var((6,))], {"num_groups": 2, "epsilon": 1e-4},
         lambda x, s, b: F.group_norm(x, 2, s, b, eps=1e-4), opset=21,
         dtype="float32", note="ORT CPU GroupNormalization-21 keeps its statistics in float32 (stash_type)"),
    # recurrent ops, differentiated through their unrolled form (autodiff/lower_recurrent.py);
    # references: torch.nn.LSTM/GRU/RNN with the ONNX weights reordered (torch_recurrent below)
    Case("LSTM-forward-states", "LSTM", [Var((5, "N", 3)), Var((1, 8, 3)), Var((1, 8, 2)), Var((1, 16)), None,
                                         Var((1, "N", 2)), Var((1, "N", 2))], {"hidden_size": 2},
         lambda x, w, r, b, h, c: torch_recurrent("LSTM", x, w, r, b, h0=h, c0=c), outputs=3, used=(0, 1, 2),
         dtype="float32", note=FP32_RNN),
    Case("LSTM-reverse", "LSTM", [Var((4, 2, 3)), Var((1, 12, 3)), Var((1, 12, 3))], {"hidden_size": 3, "direction": "reverse"},
         lambda x, w, r: torch_recurrent("LSTM", x, w, r, direction="reverse")[::2], outputs=3, used=(0, 2),
         dtype="float32", note=FP32_RNN),
    Case("LSTM-bidirectional", "LSTM", [Var((4, "N", 3)), Var((2, 8, 3)), Var((2, 8, 2)), Var((2, 16)), None,
                                        Var((2, "N", 2)), Var((2, "N", 2))], {"hidden_size": 2, "direction": "bidirectional"},
         lambda x, w, r, b, h, c: torch_recurrent("LSTM", x, w, r, b, h0=h, c0=c, direction="bidirectional"),
         outputs=3, used=(0, 1, 2), dtype="float32", note=FP32_RNN),
    Case("LSTM-bidirectional-sequence-lens", "LSTM", [Var((4, 3, 3)), Var((2, 8, 3)), Var((2, 8, 2)), Var((2, 16)),
                                                      np.asarray([4, 2, 3], np.int32)], {"hidden_size": 2, "direction": "bidirectional"},
         lambda x, w, r, b, n: torch_recurrent("LSTM", x, w, r, b, lens=n, direction="bidirectional")[:2],
         outputs=2, used=(0, 1), dtype="float32", note=FP32_RNN),
    Case("GRU-linear-before-reset-bidirectional", "GRU", [Var((4, "N", 3)), Var((2, 6, 3)), Var((2, 6, 2)), Var((2, 12)), None,
                                                          Var((2, "N", 2))],
         {"hidden_size": 2, "direction": "bidirectional", "linear_before_reset": 1},
         lambda x, w, r, b, h: torch_recurrent("GRU", x, w, r, b, h0=h, direction="bidirectional"),
         outputs=2, used=(0, 1), dtype="float32", note=FP32_RNN),
    Case("GRU-reset-before-linear", "GRU", [Var((5, 2, 3)), Var((1, 9, 3)), Var((1, 9, 3)), Var((1, 18)), None, Var((1, 2, 3))],
         {"hidden_size": 3}, lambda x, w, r, b, h: torch_recurrent("GRU", x, w, r, b, h0=h, linear_before_reset=0),
         outputs=2, used=(0, 1), dtype="float32", note=FP32_RNN),
    Case("GRU-reset-before-linear-reverse-seqlens", "GRU", [Var((4, 3, 2)), Var((1, 6, 2)), Var((1, 6, 2)), Var((1, 12)),
                                                            np.asarray([2, 4, 1], np.int32)],
         {"hidden_size": 2, "direction": "reverse"},
         lambda x, w, r, b, n: torch_recurrent("GRU", x, w, r, b, lens=n, direction="reverse", linear_before_reset=0),
         outputs=2, used=(0, 1), dtype="float32", note=FP32_RNN),
    Case("RNN-tanh-bidirectional", "RNN", [Var((4, "N", 3)), Var((2, 2, 3)), Var((2, 2, 2)), Var((2, 4)), None, Var((2, "N", 2))],
         {"hidden_size": 2, "direction": "bidirectional"},
         lambda x, w, r, b, h: torch_recurrent("RNN", x, w, r, b, h0=h, direction="bidirectional"),
         outputs=2, used=(0, 1), dtype="float32", note=FP32_RNN),
    Case("RNN-relu", "RNN", [Var((5, 2, 3)), Var((1, 3, 3)), Var((1, 3, 3))], {"hidden_size": 3, "activations": ["Relu"]},
         lambda x, w, r: torch_recurrent("RNN", x, w, r, nonlinearity="relu"), outputs=2, used=(0, 1),
         dtype="float32", note=FP32_RNN),
]


def torch_recurrent(kind: str, x: Any, w: Any, r: Any, b: Any = None, *, lens: Any = None, h0: Any = None, c0: Any = None,
                    direction: str = "forward", layout: int = 0, linear_before_reset: int = 1,
                    nonlinearity: str = "tanh") -> tuple[Any, ...]:
    """ONNX RNN/GRU/LSTM outputs (Y, Y_h[, Y_c]) computed by torch.nn.RNN/GRU/LSTM.

    The ONNX-layout weights are reordered into torch's gate order (LSTM iofc -> ifgo, GRU
    zrh -> rzn) and passed through ``functional_call``, so gradients reach them. A reverse
    direction runs forward on each sequence flipped within its length; ``sequence_lens`` packs.
    GRU with ``linear_before_reset=0`` has no torch module: an explicit loop of the ONNX equations.
    """
    order = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}[kind]
    if layout:
        x, h0, c0 = x.transpose(0, 1), None if h0 is None else h0.transpose(0, 1), None if c0 is None else c0.transpose(0, 1)
    steps, batch, hidden = x.shape[0], x.shape[1], r.shape[-1]
    lengths = torch.full((batch,), steps) if lens is None else lens.long()
    t = torch.arange(steps)[:, None]
    flip = torch.where(t < lengths[None], lengths[None] - 1 - t, t)  # [T, B]: reverse each sequence within its length

    def reorder(m: Any) -> Any:
        return torch.cat([m.chunk(len(order))[g] for g in order])

    extra = {"nonlinearity": nonlinearity} if kind == "RNN" else {}
    module = getattr(torch.nn, kind)(x.shape[-1], hidden, bias=b is not None, **extra).double()
    ys, hs, cs = [], [], []
    for d, reverse in enumerate([False, True] if direction == "bidirectional" else [direction == "reverse"]):
        seq = x.gather(0, flip[:, :, None].expand(x.shape)) if reverse else x
        h = x.new_zeros(1, batch, hidden) if h0 is None else h0[d:d + 1]
        if kind == "GRU" and not linear_before_reset:
            y, hn = _gru_reset_before_linear(seq, w[d], r[d], None if b is None else b[d], h[0], lengths)
        else:
            params = {"weight_ih_l0": reorder(w[d]), "weight_hh_l0": reorder(r[d])}
            if b is not None:
                wb, rb = b[d].chunk(2)
                params.update(bias_ih_l0=reorder(wb), bias_hh_l0=reorder(rb))
            state = (h, x.new_zeros(1, batch, hidden) if c0 is None else c0[d:d + 1]) if kind == "LSTM" else h
            packed = torch.nn.utils.rnn.pack_padded_sequence(seq, lengths, enforce_sorted=False)
            out, hn = torch.func.functional_call(module, params, (packed, state))
            y = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=steps)[0]
            if kind == "LSTM":
                hn, cn = hn
                cs.append(cn)
        ys.append(y.gather(0, flip[:, :, None].expand(y.shape)) if reverse else y)
        hs.append(hn)
    y_all, states = torch.stack(ys, 1), [torch.cat(hs, 0)] + ([torch.cat(cs, 0)] if cs else [])
    if layout:
        y_all, states = y_all.permute(2, 0, 1, 3), [s.transpose(0, 1) for s in states]
    return (y_all, *states)


def _gru_reset_before_linear(x: Any, w: Any, r: Any, b: Any, h: Any, lengths: Any) -> tuple[Any, Any]:
    """ONNX GRU, linear_before_reset=0: h~ = tanh(x Wh^T + (r * H) Rh^T + Rbh + Wbh)."""
    (wz, wr, wh), (rz, rr, rh) = w.chunk(3), r.chunk(3)
    (bz, br, bh), (rbz, rbr, rbh) = (b.chunk(6)[:3], b.chunk(6)[3:]) if b is not None else ([0] * 3, [0] * 3)
    ys = []
    for t in range(x.shape[0]):
        z = torch.sigmoid(x[t] @ wz.T + h @ rz.T + bz + rbz)
        rt = torch.sigmoid(x[t] @ wr.T + h @ rr.T + br + rbr)
        cand = torch.tanh(x[t] @ wh.T + (rt * h) @ rh.T + rbh + bh)
        new = (1 - z) * cand + z * h
        valid = (t < lengths)[:, None]
        ys.append(torch.where(valid, new, torch.zeros_like(new)))
        h = torch.where(valid, new, h)
    return torch.stack(ys), h[None]


def _np_dtype(dtype: str) -> Any:
    return np.float64 if dtype == "float64" else np.float32


def _build(case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    """The one-op model with its loss, the random feeds, and the names of the Var inputs."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))  # hash() of a str changes per process
    ftype = TensorProto.DOUBLE if case.dtype == "float64" else TensorProto.FLOAT
    npf = _np_dtype(case.dtype)
    inputs, inits, feeds, names, var_names = [], [], {}, [], []
    for i, spec in enumerate(case.inputs):
        name = f"in{i}"
        if spec is None:
            names.append("")
            continue
        names.append(name)
        if isinstance(spec, Var):
            concrete = [3 if d == "N" else d for d in spec.shape]
            value = rng.standard_normal(concrete)
            if spec.positive:
                value = np.abs(value) + 0.5
            feeds[name] = np.asarray(value, dtype=npf)
            inputs.append(helper.make_tensor_value_info(name, ftype, list(spec.shape)))
            var_names.append(name)
        else:
            arr = np.asarray(spec)
            if arr.dtype.kind == "f":
                arr = arr.astype(npf)
            inits.append(numpy_helper.from_array(arr, name))
    outs = [f"y{k}" for k in range(case.outputs)]
    nodes = [helper.make_node(case.op, names, outs, name="op", **case.attrs)]
    probe = helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits),
                              opset_imports=[helper.make_opsetid("", case.opset)], ir_version=8)
    inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in list(inferred.graph.output) + list(inferred.graph.value_info)}
    session = ort.InferenceSession(inferred.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip(outs, session.run(None, feeds), strict=True))
    terms = []
    for k in case.used:
        y = outs[k]
        c = rng.standard_normal(values[y].shape).astype(values[y].dtype)
        inits.append(numpy_helper.from_array(c, f"c{k}"))
        nodes += [helper.make_node("Mul", [y, f"c{k}"], [f"p{k}"]), helper.make_node("ReduceSum", [f"p{k}"], [f"s{k}"], keepdims=0)]
        term = f"s{k}"
        if types[y].elem_type != ftype:
            nodes.append(helper.make_node("Cast", [term], [f"t{k}"], to=ftype))
            term = f"t{k}"
        terms.append(term)
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", ftype, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=8 if case.opset <= 18 else 9)
    return model, feeds, var_names


# Default tolerances per dtype, each within 10x of the worst error the table produces (measured
# over this file's cases, every forced conv form and tests/test_resize_pool_gradients.py):
# against float64 torch, float64 3.1e-8 (Selu) and float32 4.4e-6 (RNN-tanh-bidirectional; the
# next worst 4e-7); central differences (eps 1e-6 in float64, 1e-3 in float32, relative to
# max(1, |numeric|)), float64 6.8e-9 (HardSwish) and float32 2.7e-3 (Conv2d-asym-pads-stride).
TORCH_RTOL = {"float64": 1e-7, "float32": 1e-5}
FD_RTOL = {"float64": 5e-8, "float32": 1e-2}


def _tolerance(case: Case) -> float:
    return case.rtol if case.rtol is not None else TORCH_RTOL[case.dtype]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradient(case: Case) -> None:
    model, feeds, var_names = _build(case)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=var_names, **case.build)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), options, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in session.get_outputs()]
    result = dict(zip(out_names, session.run(None, feeds), strict=True))
    grads = {n: result[f"grad/{n}"].astype(np.float64) for n in var_names}
    tol = _tolerance(case)

    # 1. Central differences along a random direction.
    rng = np.random.default_rng(7)
    direction = {n: rng.standard_normal(feeds[n].shape) for n in var_names}
    eps = 1e-6 if case.dtype == "float64" else 1e-3

    def loss_at(sign: float) -> float:
        shifted = {**feeds, **{n: np.asarray(feeds[n] + sign * eps * direction[n], dtype=feeds[n].dtype) for n in var_names}}
        return float(session.run(["loss"], shifted)[0])

    numeric = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps)
    analytic = sum(float(np.vdot(grads[n], direction[n])) for n in var_names)
    # A case's rtol bounds the float32 torch check only: float32 differences stay at FD_RTOL.
    fd_tol = case.rtol if case.rtol is not None and case.dtype == "float64" else FD_RTOL[case.dtype]
    assert abs(numeric - analytic) <= fd_tol * max(1.0, abs(numeric)), (numeric, analytic)

    # 2. torch.autograd in float64 on the same inputs and cotangents.
    tensors, leaves = [], {}
    for i, spec in enumerate(case.inputs):
        if spec is None:
            continue
        if isinstance(spec, Var):
            t = torch.tensor(feeds[f"in{i}"].astype(np.float64), requires_grad=True)
            leaves[f"in{i}"] = t
        else:
            arr = np.asarray(spec)
            t = torch.tensor(arr.astype(np.float64) if arr.dtype.kind == "f" else arr)
        tensors.append(t)
    ys = case.torch_fn(*tensors)
    ys = list(ys) if isinstance(ys, (tuple, list)) else [ys]
    cots = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name.startswith("c")}
    loss = sum((y.double() * torch.tensor(cots[f"c{k}"].astype(np.float64))).sum() for k, y in zip(case.used, ys, strict=True))
    loss.backward()
    for n in var_names:
        expected = leaves[n].grad.numpy()
        err = np.linalg.norm(grads[n] - expected) / max(np.linalg.norm(expected), 1e-12)
        assert err <= tol, (n, err)


# The Conv weight gradient has three forms (one Conv of x and dy with batch and channels swapped,
# one Slice + MatMul per kernel tap, or the one-hot im2col forms); the rule picks one per layer
# shape, so each form is forced here on every conv case. These extra cases stress the single-Conv form's geometry: its stride and
# dilation swap roles, and its output is cut back to the kernel where input rows go unread.
CONV_FORM_CASES = [
    Case("Conv2d-8x8-4-form", "Conv", [Var(("N", 2, 20, 20)), Var((3, 2, 8, 8)), Var((3,))], {"strides": [4, 4]},
         lambda x, w, b: F.conv2d(x, w, b, stride=4), dtype="float32", note=FP32_CONV),
    Case("Conv2d-stride2-odd-sliced", "Conv", [Var((2, 2, 11, 10)), Var((3, 2, 4, 3))], {"strides": [2, 2]},
         lambda x, w: F.conv2d(x, w, stride=2), dtype="float32", note=FP32_CONV),
    Case("Conv2d-dilation2", "Conv", [Var((2, 3, 9, 10)), Var((4, 3, 3, 2))],
         {"strides": [1, 2], "pads": [1, 0, 1, 0], "dilations": [2, 2]},
         lambda x, w: F.conv2d(x, w, stride=(1, 2), padding=(1, 0), dilation=2), dtype="float32", note=FP32_CONV),
    Case("Conv2d-asym-pads-stride", "Conv", [Var((2, 2, 7, 6)), Var((3, 2, 3, 3))], {"strides": [2, 1], "pads": [0, 2, 1, 0]},
         lambda x, w: F.conv2d(F.pad(x, (2, 0, 0, 1)), w, stride=(2, 1)), dtype="float32", note=FP32_CONV),
    Case("Conv2d-groups2-stride", "Conv", [Var(("N", 4, 8, 8)), Var((6, 2, 3, 3))], {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]},
         lambda x, w: F.conv2d(x, w, stride=2, padding=1, groups=2), dtype="float32", note=FP32_CONV),
    Case("Conv3d-stride-asym-pads", "Conv", [Var((2, 2, 5, 6, 5)), Var((3, 2, 2, 3, 2))],
         {"strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]},
         lambda x, w: F.conv3d(F.pad(x, (0, 1, 0, 1, 1, 0)), w, stride=(2, 1, 2)), dtype="float32", note=FP32_CONV),
]


@pytest.mark.parametrize("form", ["conv", "slices", "im2col"])
@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("Conv", "ConvTranspose")] + CONV_FORM_CASES,
                         ids=lambda c: c.id)
def test_conv_weight_grad_forms(case: Case, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight-gradient form, forced, passes the table's checks; the step graph holds it
    (the single-Conv form's kernel is dy transposed, the others never convolve with dy; the
    slices form, for one group, has one MatMul per kernel tap)."""
    from mpgraph.autodiff.rules import pool_conv

    monkeypatch.setattr(pool_conv, "WEIGHT_GRAD_FORM", form)
    test_gradient(case)
    model, _, var_names = _build(case)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=var_names, **case.build)
    convs = [n for n in step.graph if n.op_type == "Conv" and n.name.startswith("grad/")]
    by_dy = [n for n in convs if n.inputs[1] is not None and n.inputs[1].producer() is not None
             and n.inputs[1].producer().op_type == "Transpose"]
    assert len(by_dy) == (1 if form == "conv" else 0), [n.name for n in convs]
    if form == "slices" and case.op == "Conv" and case.attrs.get("group", 1) == 1:
        matmuls = [n for n in step.graph if n.op_type == "MatMul" and n.name.startswith("grad/")]
        assert len(matmuls) == int(np.prod(case.inputs[1].shape[2:])), [n.name for n in matmuls]


def test_dropout_training_mask_routes_gradient() -> None:
    """ratio 0.5 in training mode: each gradient entry is 0 or 2 * cotangent (the mask)."""
    case = Case("Dropout-train", "Dropout", [Var((64, 32)), np.asarray(0.5, np.float32), np.asarray(True)], {},
                lambda *a: None, dtype="float32", outputs=2)
    model, feeds, names = _build(case)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=names)
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
    grad = session.run(["grad/in0"], feeds)[0]
    cot = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c0"))
    ratio = grad / cot
    kept = np.isclose(ratio, 2.0)
    assert np.all(kept | np.isclose(ratio, 0.0))
    assert 0.35 < kept.mean() < 0.65


@pytest.mark.parametrize("training", [True, False])
def test_dropout_runtime_training_flag(training: bool) -> None:
    """training_mode as a graph input: the gradient follows the flag given at run time."""
    helper_nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], name="op"),
                    helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        helper_nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 32]), helper.make_tensor_value_info("t", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [numpy_helper.from_array(np.asarray(0.25, np.float32), "r")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), "t": np.asarray(training)}
    grad = session.run(["grad/x"], feeds)[0]
    if training:
        assert np.all(np.isclose(grad, 0.0) | np.isclose(grad, 1 / 0.75)) and 0.6 < (grad > 0).mean() < 0.9
    else:
        assert np.allclose(grad, 1.0)


def test_every_rule_has_a_case() -> None:
    """Every registered rule is in this table or in test_resize_pool_gradients' (same checks)."""
    from tests.test_resize_pool_gradients import TABLE_CASES

    covered = {lookup_rule("", c.op, c.opset).key for c in [*CASES, *TABLE_CASES]}
    covered.add(lookup_rule("", "Dropout", 18).key)
    missing = sorted(r.key for r in registered_rules() if r.key not in covered)
    assert not missing, f"gradient rules without a test case: {missing}"


def test_broadcast_shapes_enumerated_for_binary_ops() -> None:
    for op in ("Add", "Sub", "Mul", "Div", "Pow"):
        shapes = {tuple(tuple(v.shape) for v in c.inputs) for c in CASES if c.op == op and all(isinstance(v, Var) for v in c.inputs)}
        assert len(shapes) >= 8, op


def _gelu_softmax_model(fill: float, read_cdf: bool) -> onnx.ModelProto:
    """``h = gelu(x)`` as torch exports it below opset 20 (Div, Erf, Add, Mul, Mul), then
    ``p = Softmax(Where(mask, fill, h * 0.5))``; the loss also reads ``h`` and, with
    ``read_cdf``, the GELU's interior value ``cdf``, whose own gradient then flows through
    the interior rules next to the compact backward."""
    rng = np.random.default_rng(7)
    mask = np.tril(np.ones((5, 5), dtype=bool))[None].repeat(2, 0)  # every row keeps its diagonal
    consts = {"sqrt2": np.sqrt(2.0), "one": 1.0, "half": 0.5, "fill": fill}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(~mask, "masked")]
    inits += [numpy_helper.from_array(rng.standard_normal((2, 5, 5)).astype(np.float32), f"c{k}") for k in range(3)]
    n = helper.make_node
    nodes = [n("Div", ["x", "sqrt2"], ["s"]), n("Erf", ["s"], ["r"]), n("Add", ["r", "one"], ["a"]),
             n("Mul", ["half", "a"], ["cdf"]), n("Mul", ["x", "cdf"], ["h"], name="gelu"),
             n("Mul", ["h", "half"], ["z"]), n("Where", ["masked", "fill", "z"], ["m"], name="mask"),
             n("Softmax", ["m"], ["p"])]
    read = ("p", "h", "cdf") if read_cdf else ("p", "h")
    for k, v in enumerate(read):
        nodes += [n("Mul", [v, f"c{k}"], [f"t{k}"]), n("ReduceSum", [f"t{k}"], [f"l{k}"], keepdims=0)]
    nodes.append(n("Sum", [f"l{k}" for k in range(len(read))], ["loss"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 5])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("read_cdf", [False, True])
@pytest.mark.parametrize("fill", [-np.inf, -1e4])
def test_erf_gelu_and_masked_softmax_patterns(fill: float, read_cdf: bool) -> None:
    """The erf GELU becomes one ``Gelu`` before differentiating (its rule writes the backward),
    unless the loss reads an interior value (then the rewrite would lose it: each op keeps its
    own rule); Where(-inf) before Softmax passes dy through. Both match torch. A finite fill
    keeps the Where's select (a fully masked row would not give exact zeros)."""
    from mpgraph._ir.meta import NODE_GRAD_OF

    model = _gelu_softmax_model(fill, read_cdf)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"])
    grad_of = {n.metadata_props.get(NODE_GRAD_OF) for n in step.graph if n.name.startswith("grad/")}
    forward_ops = {n.name: n.op_type for n in step.graph if not n.name.startswith("grad/")}
    assert ("Gelu" in forward_ops.values()) == (not read_cdf)
    assert bool({forward_ops.get(g) for g in grad_of} & {"Div", "Erf", "Add"}) == read_cdf
    assert ("mask" in grad_of) == (fill != -np.inf)
    x = np.random.default_rng(3).standard_normal((2, 5, 5)).astype(np.float32) * 2
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["grad/x"], {"x": x})[0]
    consts = {i.name: torch.from_numpy(numpy_helper.to_array(i).astype(np.float64)) for i in model.graph.initializer}
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    cdf = 0.5 * (1 + torch.erf(xt / np.sqrt(2.0)))
    h = xt * cdf
    p = torch.softmax((h * 0.5).masked_fill(consts["masked"].bool(), fill), -1)
    loss = (p * consts["c0"]).sum() + (h * consts["c1"]).sum() + (cdf * consts["c2"]).sum() * read_cdf
    (want,) = torch.autograd.grad(loss, xt)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=2e-5)


def _torchscript_gelu_model(read_interior: bool) -> onnx.ModelProto:
    """``h = (x * (erf(x / sqrt(2)) + 1)) * 0.5``, the torchscript exporter's GELU (its node
    order and operand order), read by the loss; with ``read_interior`` the loss also reads
    ``a = erf + 1``, whose own gradient then flows through the interior rules."""
    rng = np.random.default_rng(11)
    consts = {"sqrt2": np.sqrt(2.0), "one": 1.0, "half": 0.5}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(rng.standard_normal((3, 8)).astype(np.float32), f"c{k}") for k in range(2)]
    n = helper.make_node
    nodes = [n("Div", ["x", "sqrt2"], ["s"]), n("Erf", ["s"], ["r"]), n("Add", ["r", "one"], ["a"]),
             n("Mul", ["x", "a"], ["t"], name="gelu_inner"), n("Mul", ["t", "half"], ["h"], name="gelu")]
    read = ("h", "a") if read_interior else ("h",)
    for k, v in enumerate(read):
        nodes += [n("Mul", [v, f"c{k}"], [f"t{k}"]), n("ReduceSum", [f"t{k}"], [f"l{k}"], keepdims=0)]
    nodes.append(n("Sum", [f"l{k}" for k in range(len(read))], ["loss"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("canonicalize", [None, False])
@pytest.mark.parametrize("read_interior", [False, True])
def test_torchscript_erf_gelu_gets_the_gelu_rule(read_interior: bool, canonicalize: bool | None) -> None:
    """The torchscript exporter's GELU becomes ``Gelu`` by default and gets its rule's
    backward; read inside by the loss, or with ``canonicalize=False``, each of its ops keeps
    its own rule (no rule recognises a GELU written out). The gradient matches torch's."""
    from mpgraph._ir.meta import NODE_GRAD_OF

    model = _torchscript_gelu_model(read_interior)
    step = build_training_graph(model, optimizer=None, loss="loss", trainable_inputs=["x"], canonicalize=canonicalize)
    grad_of = {n.metadata_props.get(NODE_GRAD_OF) for n in step.graph if n.name.startswith("grad/")}
    forward_ops = {n.name: n.op_type for n in step.graph if not n.name.startswith("grad/")}
    canonical = canonicalize is None and not read_interior
    assert ("Gelu" in forward_ops.values()) == canonical
    assert bool({forward_ops.get(g) for g in grad_of} & {"Div", "Erf", "Add"}) == (not canonical)
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32) * 3
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["grad/x"], {"x": x})[0]
    consts = {i.name: torch.from_numpy(numpy_helper.to_array(i).astype(np.float64)) for i in model.graph.initializer}
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    a = torch.erf(xt / np.sqrt(2.0)) + 1
    loss = ((xt * a) * 0.5 * consts["c0"]).sum() + (a * consts["c1"]).sum() * read_interior
    (want,) = torch.autograd.grad(loss, xt)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=2e-5)
