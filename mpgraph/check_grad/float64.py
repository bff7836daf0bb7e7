"""A float64 copy of a float32 graph, for finite differences that rounding does not swamp.

``to_float64`` retypes every float32 tensor, Cast and constant to float64. An op type ORT's CPU
provider has no float64 kernel for (``keep32``) runs in float32 between Casts, except the ones
rewritten into float64 ops here, whose float32 rounding would dominate every CNN's finite
differences (built with ``_ir.builder.Builder``, placed where the node was):

1. A 2-D ``Conv`` with static channels and spatial dims becomes Pad, one strided Slice per
   kernel tap, Concat and a grouped MatMul (``_conv_taps``).
2. A 2-D ``ConvTranspose`` (explicit pads, no ``output_shape``) becomes zeros inserted between
   the input's pixels, then the Conv above with the kernel's channels swapped and its taps
   flipped.
3. ``GlobalAveragePool`` / ``GlobalMaxPool`` become ``ReduceMean`` / ``ReduceMax``.
4. ``AveragePool`` (1-D/2-D) and ``Resize`` (linear/nearest) become one MatMul by a constant
   float64 matrix per spatial axis (``resample``); ``Erf`` a positive series in ``x**2``,
   ``Gelu`` its formula over that series (or over ``Tanh``).

Example:
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 1, 2, 2]))
    >>> node = ir.Node("", "GlobalAveragePool", [x], name="pool")
    >>> node.outputs[0].name = "y"
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=8)
    >>> proto, islands = to_float64(model, frozenset({"GlobalAveragePool"}))
    >>> [n.op_type for n in proto.graph.node], islands, proto.graph.output[0].type.tensor_type.elem_type
    (['ReduceMean'], set(), 11)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role
from mpgraph._ir.names import NameScope
from mpgraph.check_grad.resample import ERF_CLIP, ERF_SCALE, erf_series, pool_matrix, resize_matrix

__all__ = ["SHAPED_OPS", "to_float64"]

logger = logging.getLogger(__name__)

#: Op types rewritten into float64 ops when ORT has no float64 kernel for them that need
#: static input (and Resize output) shapes (``check_grad`` measures them with one float32 run).
SHAPED_OPS = frozenset({"Conv", "ConvTranspose", "AveragePool", "Resize"})
_F32, _F64 = ir.DataType.FLOAT, ir.DataType.DOUBLE
_INT64_MIN = int(np.iinfo(np.int64).min)
Shapes = Mapping[str, Sequence[int | None]]


def to_float64(model: ir.Model, keep32: frozenset[str] = frozenset(),
               input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> tuple[onnx.ModelProto, set[str]]:
    """A copy of ``model`` computing in float64 instead of float32, and the op types left in float32.

    Args:
        model: The float32 model (left unchanged).
        keep32: Op types without a float64 kernel in ORT: rewritten (see the module docstring)
            or run in float32 between Casts.
        input_shapes: Runtime shapes of graph inputs (made static) and of Conv inputs.

    Returns:
        The float64 model as protobuf, its types re-inferred (strict), ready for a session;
        and the op types that run in float32 inside it.

    Raises:
        ValueError: The float64 graph's output types cannot be inferred.
    """
    copy = _static_copy(model, keep32, input_shapes or {})
    graph = copy.graph
    was_f32 = {v for v in _values(graph) if v.dtype == _F32}
    shapes = _shapes(graph, input_shapes or {})
    _retype_graph(graph)
    islands: set[str] = set()
    names = NameScope(graph)
    for node in list(graph):
        emulated = _emulate(graph, node, shapes, names) if node.op_type in keep32 else None
        if emulated is not None:
            if node.outputs[0] in was_f32:  # a float32 island downstream casts it
                was_f32.add(emulated)
            continue
        if node.op_type in keep32:
            islands.add(node.op_type)
            _float32_island(graph, node, was_f32)
        else:
            _retype_node(graph, node, was_f32)
    proto = onnx.shape_inference.infer_shapes(ir.to_proto(copy), strict_mode=True)
    if any(v.type.tensor_type.elem_type == 0 for v in proto.graph.output):
        raise ValueError("the float64 graph's output types cannot be inferred")
    return proto, islands


def _static_copy(model: ir.Model, keep32: frozenset[str], input_shapes: Mapping[str, tuple[int, ...]]) -> ir.Model:
    """A copy whose fed inputs have the fed shapes; with shapes inferred when Convs will be
    rewritten (their weight gradients' shapes are only known after that)."""
    proto = ir.to_proto(model)
    copy = ir.from_proto(proto)
    for v in copy.graph.inputs:  # the check feeds one shape: make it static
        if v.name in input_shapes:
            v.shape = ir.Shape(input_shapes[v.name])
    if not keep32 & SHAPED_OPS:
        return copy
    cleared = ir.from_proto(ir.to_proto(copy))
    for v in _values(cleared.graph):
        if v.producer() is not None and not v.is_graph_output():
            v.type, v.shape = None, None
    try:
        return ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(cleared), data_prop=True))
    except Exception as e:  # noqa: BLE001 - inference is best effort here
        logger.debug("shape inference before float64 conversion failed: %s", e)
        return copy


def _values(graph: ir.Graph) -> list[ir.Value]:
    """Graph inputs, initializers and every node output."""
    values = [*graph.inputs, *(v for v in graph.initializers.values() if not v.is_graph_input())]
    return values + [o for node in graph for o in node.outputs]


def _shapes(graph: ir.Graph, input_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[int | None]]:
    """Static dims (``None`` where symbolic) of every value with a shape, runtime shapes first."""
    shapes = {v.name or "": [d if isinstance(d, int) else None for d in v.shape] for v in _values(graph) if v.shape is not None}
    shapes.update({k: list(v) for k, v in input_shapes.items()})
    return shapes


def _retype_graph(graph: ir.Graph) -> None:
    """float32 initializers and inputs become float64; every node output is re-inferred (some
    stay float32: LayerNormalization's mean)."""
    for value in graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype == _F32:
            value.const_value = ir.tensor(np.asarray(value.const_value.numpy(), np.float64), name=value.const_value.name)
            value.dtype = _F64
    for value in graph.inputs:
        if value.dtype == _F32:
            value.dtype = _F64
    for node in graph:
        for value in node.outputs:
            value.type, value.shape = None, None


def _retype_node(graph: ir.Graph, node: ir.Node, was_f32: set[ir.Value]) -> None:
    """float32 attributes (``Cast.to``, constant tensors) become float64."""
    for name, attr in list(node.attributes.items()):
        if name in ("to", "dtype") and attr.type == ir.AttributeType.INT and attr.value == _F32:
            node.attributes[name] = ir.AttrInt64(name, _F64)
        elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _F32:
            node.attributes[name] = ir.AttrTensor(name, ir.tensor(np.asarray(attr.value.numpy(), np.float64), name=attr.value.name))
        elif node.op_type == "Constant" and name in ("value_float", "value_floats"):
            del node.attributes[name]
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array(attr.value, np.float64)))
    if node.op_type == "Resize" and len(node.inputs) > 2 and node.inputs[2] in was_f32:
        _cast_input(graph, node, 2, {})  # scales are float32 by schema for any input
    if node.op_type == "LayerNormalization":
        # Its mean and inverse deviation are float32 by schema (stash_type) for any input.
        for value in node.outputs[1:]:
            if value.name:
                _cast_output(graph, node, value, was_f32)


def _float32_island(graph: ir.Graph, node: ir.Node, was_f32: set[ir.Value]) -> None:
    """Run ``node`` in float32: Casts to float32 before it and back to float64 after it."""
    casts: dict[ir.Value, ir.Value] = {}
    for k, value in enumerate(node.inputs):
        if value is not None and value in was_f32:
            _cast_input(graph, node, k, casts)
    for value in node.outputs:
        if value in was_f32:
            _cast_output(graph, node, value, was_f32)


def _cast_input(graph: ir.Graph, node: ir.Node, slot: int, casts: dict[ir.Value, ir.Value]) -> None:
    """Feed ``node``'s input ``slot`` through ``Cast(value, float32)``: one Cast per input value
    (in ``casts``), even when it fills two slots."""
    value = node.inputs[slot]
    assert value is not None
    if value not in casts:
        cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", _F32)], name=f"{value.name}/f32/{node.name}")
        cast.outputs[0].name = f"{value.name}/f32/{node.name}"
        graph.insert_before(node, cast)
        casts[value] = cast.outputs[0]
    node.replace_input_with(slot, casts[value])


def _cast_output(graph: ir.Graph, node: ir.Node, value: ir.Value, was_f32: set[ir.Value]) -> None:
    """Insert ``Cast(value, float64)`` after ``node``; it takes over ``value``'s name and uses
    (and its float32 origin: a float32 island that reads it casts it back)."""
    name = value.name or ""
    users = list(value.uses())
    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", _F64)], name=f"{name}/f64")
    graph.insert_after(node, cast)
    for user, slot in users:
        user.replace_input_with(slot, cast.outputs[0])
    for i, output in enumerate(graph.outputs):
        if output is value:
            graph.outputs[i] = cast.outputs[0]
    value.name = f"{name}/f32"
    cast.outputs[0].name = name
    if value in was_f32:
        was_f32.add(cast.outputs[0])


def _emulate(graph: ir.Graph, node: ir.Node, shapes: Shapes, names: NameScope) -> ir.Value | None:
    """Replace ``node`` by float64 ops (see the module docstring) and return their output;
    ``None`` when it cannot be."""
    rewrite = _REWRITES.get(node.op_type)
    builder = Builder(graph, role=Role.FORWARD, scope=f"{node.name or node.op_type}/f64", names=names)
    out = rewrite(builder, node, shapes) if rewrite is not None else None
    if out is None:
        return None
    made = list(builder.tape.nodes)
    graph.remove(made)  # the builder appends; the rewrite goes where the node was
    graph.insert_before(node, made)
    for value in (o for n in made for o in n.outputs):
        value.type = None  # the builder guesses from inputs whose types are cleared: re-inferred
    old = node.outputs[0]
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    name, old.name = old.name, None
    out.name = name
    return out


def _static_dims(shapes: Shapes, value: ir.Value | None, whole: bool) -> list[int] | None:
    """The 4-D shape of ``value`` when its dims are static (the batch may be symbolic unless
    ``whole``), else ``None``."""
    shape = shapes.get(value.name or "") if value is not None else None
    if shape is None or len(shape) != 4 or None in (shape if whole else shape[1:]):
        return None
    return [d if d is not None else -1 for d in shape]


def _ints(node: ir.Node, name: str, default: Sequence[int]) -> list[int]:
    return list(node.attributes.get_ints(name, default))


def _conv(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape = _static_dims(shapes, x, whole=False), _static_dims(shapes, w, whole=True)
    if x is None or w is None or x_shape is None or w_shape is None:
        return None
    strides, dilations = _ints(node, "strides", [1, 1]), _ints(node, "dilations", [1, 1])
    pads = _explicit_pads(node, x_shape[2:], w_shape[2:], strides, dilations)
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    group = node.attributes.get_int("group", 1)
    return _conv_taps(b, x, w, bias, x_shape[1:], w_shape, group, strides, dilations, pads)


def _explicit_pads(node: ir.Node, spatial: Sequence[int], kernel: Sequence[int],
                   strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """A Conv's ``[top, left, bottom, right]`` pads, ``auto_pad`` resolved."""
    auto = node.attributes.get_string("auto_pad", "NOTSET")
    if auto == "VALID":
        return [0, 0, 0, 0]
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        return _ints(node, "pads", [0, 0, 0, 0])
    pads = [0, 0, 0, 0]
    for axis, (size, k, st, dl) in enumerate(zip(spatial, kernel, strides, dilations, strict=True)):
        total = max((-(-size // st) - 1) * st + (k - 1) * dl + 1 - size, 0)
        small, big = total // 2, total - total // 2
        pads[axis], pads[axis + 2] = (small, big) if auto == "SAME_UPPER" else (big, small)
    return pads


def _conv_taps(b: Builder, x: ir.Value, w: ir.Value, bias: ir.Value | None, chw: Sequence[int], w_shape: Sequence[int],
               group: int, strides: Sequence[int], dilations: Sequence[int], pads: Sequence[int]) -> ir.Value:
    """A 2-D Conv as Pad, one strided Slice per kernel tap, Concat and a grouped MatMul (all
    with float64 kernels in ORT CPU). Negative pads crop."""
    c, h, w_ = chw
    m, cg, kh, kw = w_shape
    (sh, sw), (dh, dw) = strides, dilations
    hp, wp = h + pads[0] + pads[2], w_ + pads[1] + pads[3]
    oh, ow = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    padded = b.op("Pad", x, b.ints([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]))
    taps = []
    for i in range(kh):
        for j in range(kw):
            start = [i * dh, j * dw]
            end = [start[0] + sh * (oh - 1) + 1, start[1] + sw * (ow - 1) + 1]
            tap = b.op("Slice", padded, b.ints(start), b.ints(end), b.ints([2, 3]), b.ints([sh, sw]))
            taps.append(b.op("Unsqueeze", tap, b.ints([2])))
    # [N, C, taps, OH, OW] -> [N, G, C/G * taps, OH * OW]: channel-major, tap-minor like W.
    cols = b.op("Reshape", b.op("Concat", *taps, axis=2), b.ints([-1, group, (c // group) * kh * kw, oh * ow]))
    y4 = b.op("MatMul", b.op("Reshape", w, b.ints([group, m // group, cg * kh * kw])), cols)
    y = b.op("Reshape", y4, b.ints([-1, m, oh, ow]))
    if bias is None:
        return y
    return b.op("Add", y, b.op("Reshape", bias, b.ints([m, 1, 1])))


def _conv_transpose(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    """ConvTranspose = zeros inserted between the input's pixels (stride), padded by
    ``dilation * (k - 1) - pad`` (plus ``output_padding`` at the end), convolved with the
    kernel's in/out channels swapped per group and its taps flipped."""
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape = _static_dims(shapes, x, whole=False), _static_dims(shapes, w, whole=True)
    if (x is None or w is None or x_shape is None or w_shape is None or "output_shape" in node.attributes
            or node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET"):
        return None
    _, c, h, w_ = x_shape
    _, mg, kh, kw = w_shape
    group = node.attributes.get_int("group", 1)
    sh, sw = _ints(node, "strides", [1, 1])
    dh, dw = _ints(node, "dilations", [1, 1])
    pt, pl, pb, pr = _ints(node, "pads", [0, 0, 0, 0])
    oph, opw = _ints(node, "output_padding", [0, 0])
    # [N, C, H, W] -> [N, C, H, 1, W, 1] -> zeros after each pixel -> [N, C, H*sh, W*sw]
    spread = b.op("Reshape", x, b.ints([-1, c, h, 1, w_, 1]))
    spread = b.op("Pad", spread, b.ints([0] * 9 + [sh - 1, 0, sw - 1]))
    spread = b.op("Reshape", spread, b.ints([-1, c, h * sh, w_ * sw]))
    # The trailing stride - 1 zeros of the last pixel are not part of the zero-inserted input.
    pads = [dh * (kh - 1) - pt, dw * (kw - 1) - pl, dh * (kh - 1) - pb + oph - (sh - 1), dw * (kw - 1) - pr + opw - (sw - 1)]
    kernel = b.op("Reshape", w, b.ints([group, c // group, mg, kh, kw]))
    kernel = b.op("Reshape", b.op("Transpose", kernel, perm=[0, 2, 1, 3, 4]), b.ints([group * mg, c // group, kh, kw]))
    kernel = b.op("Slice", kernel, b.ints([-1, -1]), b.ints([_INT64_MIN, _INT64_MIN]), b.ints([2, 3]), b.ints([-1, -1]))
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return _conv_taps(b, spread, kernel, bias, (c, h * sh, w_ * sw), (group * mg, c // group, kh, kw), group,
                      (1, 1), (dh, dw), pads)


def _global_pool(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    x = node.inputs[0]
    assert x is not None
    rank = len(shapes.get(x.name or "") or ())
    if rank <= 2:
        return None
    reduce = "ReduceMean" if node.op_type == "GlobalAveragePool" else "ReduceMax"
    return b.op(reduce, x, b.ints(list(range(2, rank))), keepdims=1)


def _per_axis(b: Builder, x: ir.Value, matrices: Sequence[np.ndarray]) -> ir.Value:
    """``x`` ([N, C, *spatial], 1 or 2 spatial axes) with each ``[out, size]`` matrix applied to
    its spatial axis: ``P_h @ x @ P_w^T`` (MatMul broadcasts over N and C)."""
    if len(matrices) == 2:
        x = b.op("MatMul", b.const(matrices[0]), x)
    return b.op("MatMul", x, b.const(np.ascontiguousarray(matrices[-1].T)))


def _average_pool(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    """AveragePool (1-D or 2-D, explicit pads, no dilation) as one matrix per spatial axis."""
    x = node.inputs[0]
    shape = shapes.get(x.name or "") if x is not None else None
    if (x is None or shape is None or len(shape) not in (3, 4) or None in shape[2:]
            or node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID")
            or any(d != 1 for d in _ints(node, "dilations", []))):
        return None
    rank = len(shape) - 2
    kernel, strides = _ints(node, "kernel_shape", []), _ints(node, "strides", [1] * rank)
    pads = _ints(node, "pads", [0] * 2 * rank) if node.attributes.get_string("auto_pad", "NOTSET") == "NOTSET" else [0] * 2 * rank
    ceil_mode, include = bool(node.attributes.get_int("ceil_mode", 0)), bool(node.attributes.get_int("count_include_pad", 0))
    matrices = [pool_matrix(int(size), kernel[a], strides[a], (pads[a], pads[a + rank]), ceil_mode, include)
                for a, size in enumerate(shape[2:])]
    return _per_axis(b, x, matrices)


def _resize(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    """Resize (linear or nearest, of the last one or two axes only) as one matrix per axis; the
    scale is the ``scales`` input, else output / input length (ORT's rule)."""
    x, y = node.inputs[0], node.outputs[0]
    shape, out_shape = shapes.get(x.name or "") if x is not None else None, shapes.get(y.name or "")
    if (x is None or shape is None or out_shape is None or len(shape) not in (3, 4) or len(out_shape) != len(shape)
            or None in (*shape[2:], *out_shape[2:]) or node.attributes.get_int("antialias", 0)
            or "axes" in node.attributes or list(shape[:2]) != list(out_shape[:2])):
        return None
    scales = ir.convenience.get_const_tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    mode, transform = node.attributes.get_string("mode", "nearest"), node.attributes.get_string("coordinate_transformation_mode", "half_pixel")
    nearest = node.attributes.get_string("nearest_mode", "round_prefer_floor")
    matrices = []
    for a in range(2, len(shape)):
        scale = float(scales.numpy()[a]) if scales is not None and scales.numpy().size else out_shape[a] / shape[a]
        matrix = resize_matrix(int(shape[a]), int(out_shape[a]), scale, mode, transform, nearest)
        if matrix is None:
            return None
        matrices.append(matrix)
    return _per_axis(b, x, matrices)


def _erf(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    """Erf as a positive series in ``x**2`` (see ``resample.erf_series``), nested by Horner's
    rule (three elementwise nodes a term), ``x`` clipped to ``±ERF_CLIP`` where erf is ``±1``."""
    del shapes
    x = node.inputs[0]
    assert x is not None
    return _erf_series(b, x)


def _gelu(b: Builder, node: ir.Node, shapes: Shapes) -> ir.Value | None:
    """``Gelu`` as its formula: ``0.5 x (1 + erf(x / sqrt 2))`` (erf as in ``_erf``), or the
    tanh form (``Tanh`` has a float64 kernel)."""
    del shapes
    x = node.inputs[0]
    assert x is not None
    if node.attributes.get_string("approximate", "none") == "tanh":
        inner = b.op("Mul", b.op("Add", x, b.op("Mul", b.op("Mul", b.op("Mul", x, x), x), b.const(0.044715))),
                     b.const(float(np.sqrt(2.0 / np.pi))))
        cdf = b.op("Add", b.op("Tanh", inner), b.const(1.0))
    else:
        cdf = b.op("Add", _erf_series(b, b.op("Mul", x, b.const(float(np.sqrt(0.5))))), b.const(1.0))
    return b.op("Mul", b.op("Mul", x, b.const(0.5)), cdf)


def _erf_series(b: Builder, x: ir.Value) -> ir.Value:
    xc = b.op("Clip", x, b.const(-ERF_CLIP), b.const(ERF_CLIP))
    x2 = b.op("Mul", xc, xc)
    one = b.const(1.0)
    series = one  # nested: 1 + r_1 t (1 + r_2 t (1 + ...)), elementwise, no [..., terms] tensor
    for ratio in erf_series()[::-1]:
        series = b.op("Add", one, b.op("Mul", b.op("Mul", x2, b.const(ratio)), series))
    return b.op("Mul", b.op("Mul", xc, b.op("Exp", b.op("Neg", x2))), b.op("Mul", series, b.const(ERF_SCALE)))


_REWRITES: dict[str, Callable[[Builder, ir.Node, Shapes], ir.Value | None]] = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "GlobalAveragePool": _global_pool, "GlobalMaxPool": _global_pool,
    "AveragePool": _average_pool, "Resize": _resize, "Erf": _erf, "Gelu": _gelu,
}
