"""Run a step graph's convolutions on ORT CPU's blocked (NCHWc) kernels (a session lowering).

ONNX Runtime's CPU provider has two convolution paths. Its NCHWc transformer rewrites a
``Conv`` whose weight is a constant initializer into ``com.microsoft.nchwc.Conv``: channels in
blocks of 8 (AVX2) or 16 (AVX-512), direct kernels, the weight reordered once at load time.
Every other ``Conv`` runs MLAS's im2col and one small GEMM per image. In a step graph no weight
is a constant (the weights are state), so every convolution, forward and weight gradient,
took the slow path: on the Nature DQN's three layers (batch 32, 2 threads) the forward convs
ran 1.4-6x slower than with the same weights as an initializer
(``benchmarks/results/conv_nchwc_ab.txt``).

``to_nchwc`` does what the transformer does, with the weight reorder as graph ops so that it
follows the weight every step::

    W [co, ci, kh, kw] -> Reshape [co/B, B, ci/B, B, kh, kw] -> Transpose -> Reshape [co, ci, kh, kw]
    X -> ReorderInput -> nchwc.Conv(X', W') -> ReorderOutput(channels=co) -> Y

(a first layer with fewer than 8 input channels reads X as it is and its weight in the
``OIHWBo`` order). The block size B is the machine's: the runtime's ``probe.nchwc_block`` runs a one-layer probe
once per process and returns 0 where ORT has no NCHWc kernels (no AVX2, or not x86), and then
nothing is rewritten. Results equal the plain ``Conv`` up to summation order (the probe and
``tests/test_kernels_nchwc.py`` check them against it).

Only float32, 2-D, ungrouped convolutions are rewritten, with output channels a multiple of B
(the transformer's own condition). Input channels under 8 are read as NCHW (a first layer);
other counts that are not a multiple of B, and the symbolic batch that a weight gradient's
``Conv`` reduces over (batch and channels swapped, the forward's stride as its dilation), are
padded with zero channels at run time. A ``Conv`` whose weight is a constant initializer is
left to ORT's transformer. The weight gradient's kernel is as large as the forward's output
map; above ``max_kernel`` taps (the DQN's first layer: 20x20) the blocked kernel measured
slower than MLAS's GEMM, so it keeps the plain op. A unit-stride ``ConvTranspose`` (the data
gradient of a unit-stride Conv) becomes the Conv it equals, flipped filter, and moves too; with
``phases`` (what ``lower`` asks for when the library's ``Permute`` runs the transposes)
a strided one becomes one Conv over its output phases (``_phase_conv``). The per-tap slices
weight gradient of a small unit-stride layer is rebuilt as one Conv first
(``slices_dw.slices_to_conv``), which then moves like the others.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import constant, hand_over
from mpgraph.lowering.slices_dw import slices_to_conv

__all__ = ["NCHWC_DOMAIN", "to_nchwc"]

#: ORT's domain of the blocked-layout CPU ops.
NCHWC_DOMAIN = "com.microsoft.nchwc"

#: Weight-gradient-sized kernels (taps) above which a Conv keeps MLAS's im2col path.
MAX_KERNEL_TAPS = 144

#: Output elements an image below which a strided ConvTranspose keeps ORT's kernel: the phase
#: Conv's extra nodes cost more than they save on small maps (2-16 channels of 10-20 pixels a
#: side, batch 2: 0.05-0.11 ms against ConvTranspose's 0.02-0.05). The DQN's 4x4/2 data
#: gradient (32 channels of 20x20) gained.
MIN_PHASE_OUTPUTS = 8192


def _filter_order(co: int, ci: int | None, kh: int, kw: int, block: int) -> tuple[list[int], list[int]]:
    """The Reshape and Transpose that put a ``[co, ci, kh, kw]`` filter in MLAS's order
    (``ci`` ``None``: a multiple of ``block`` known only at run time)."""
    if ci is not None and ci < 8:  # OIHWBo: the NCHW-input kernel of a first layer
        return [co // block, block, ci, kh, kw], [0, 2, 3, 4, 1]
    return [co // block, block, ci // block if ci is not None else -1, block, kh, kw], [0, 2, 4, 5, 3, 1]  # OIHWBiBo



def _dims(value: ir.Value | None, rank: int) -> list[int | None] | None:
    """``value``'s dims (``None`` where symbolic) when its rank is ``rank``."""
    if value is None or value.shape is None or len(value.shape) != rank:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _plain(node: ir.Node) -> bool:
    """Ungrouped, with explicit pads (no ``auto_pad``): the only convolutions rewritten."""
    group = node.attributes.get("group")
    return (group is None or group.as_int() == 1) and node.attributes.get("auto_pad") in (
        None, ir.AttrString("auto_pad", "NOTSET"))


def _eligible(node: ir.Node, block: int, max_kernel: int) -> tuple[int, int | None, int, int] | None:
    """``(co, ci, kh, kw)`` of a Conv ``to_nchwc`` may rewrite (``ci`` ``None`` where the input
    channels must be padded to a multiple of the block: symbolic, as the batch a weight
    gradient's Conv reduces over), else ``None``."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    dims = _dims(w, 4)
    if x is None or w is None or dims is None or x.dtype != ir.DataType.FLOAT or _dims(x, 4) is None:
        return None
    if constant(w) is not None and not w.is_graph_input():
        return None  # ORT's own NCHWc transformer takes constant weights
    co, ci, kh, kw = dims
    if co is None or kh is None or kw is None or not _plain(node) or co % block or kh * kw > max_kernel:
        return None
    if ci is not None and ci >= 8 and ci % block:
        ci = None  # padded like a symbolic count
    return co, ci, kh, kw


def _const(rw: Rewrite, name: str, values: list[int]) -> ir.Value:
    return rw.constant(name, np.array(values, np.int64))


def _pad_channels(rw: Rewrite, x: ir.Value, w: ir.Value, block: int) -> tuple[ir.Value, ir.Value]:
    """Nodes that pad ``x``'s and ``w``'s axis 1 (the input channels) with zeros to a multiple
    of ``block``: zero channels add nothing to the convolution's sums."""
    c = rw.node("Shape", x, start=1, end=2, name="nchwc/channels").outputs[0]
    blk = _const(rw, "nchwc/block", [block])
    rem = rw.node("Mod", c, blk, name="nchwc/rem").outputs[0]
    short = rw.node("Sub", blk, rem, name="nchwc/short").outputs[0]
    pad = rw.node("Mod", short, blk, name="nchwc/pad").outputs[0]
    pads = rw.node("Concat", _const(rw, "nchwc/pads_head", [0, 0, 0, 0, 0]), pad, _const(rw, "nchwc/pads_tail", [0, 0]),
                   axis=0, name="nchwc/pads").outputs[0]
    return rw.node("Pad", x, pads, name="nchwc/PadX").outputs[0], rw.node("Pad", w, pads, name="nchwc/PadW").outputs[0]


def _rewrite(graph: ir.Graph, conv: ir.Node, dims: tuple[int, int | None, int, int], block: int, names: NameScope) -> None:
    co, ci, kh, kw = dims
    x, w = conv.inputs[0], conv.inputs[1]
    assert x is not None and w is not None
    rw = Rewrite(graph, conv.name or "conv", names=names)
    if ci is None:
        x, w = _pad_channels(rw, x, w, block)
    shape, perm = _filter_order(co, ci, kh, kw, block)
    filt = rw.node("Reshape", w, _const(rw, "nchwc/blocks", shape), name="nchwc/Reshape").outputs[0]
    filt.dtype = ir.DataType.FLOAT  # typed, so that later lowerings (``permute``) see float32 values
    filt = rw.node("Transpose", filt, perm=perm, name="nchwc/Transpose").outputs[0]
    filt.dtype = ir.DataType.FLOAT
    filt = rw.node("Reshape", filt, _const(rw, "nchwc/dims", [co, -1, kh, kw]), name="nchwc/Filter").outputs[0]
    filt.dtype = ir.DataType.FLOAT
    if ci is None or ci >= 8:
        x = rw.node("ReorderInput", x, name="nchwc/ReorderInput", domain=NCHWC_DOMAIN).outputs[0]
    attrs = dict(conv.attributes.items())
    attrs.setdefault("kernel_shape", ir.AttrInt64s("kernel_shape", [kh, kw]))
    y = rw.node("Conv", x, filt, *conv.inputs[2:3], name="nchwc/Conv", domain=NCHWC_DOMAIN, like=conv, **attrs).outputs[0]
    rw.node("ReorderOutput", y, channels=co, name="nchwc/ReorderOutput", domain=NCHWC_DOMAIN, like=conv)
    graph.insert_before(conv, rw.nodes)
    hand_over(conv.outputs, rw.nodes[-1].outputs)
    graph.remove(conv, safe=True)


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.as_ints()) if attr is not None else default


def _conv_transpose(node: ir.Node) -> tuple | None:
    """``(x dims, filter dims, strides, dilations, pads)`` of a plain float32 2-D
    ``ConvTranspose`` with a static filter and no ``output_shape``/``output_padding`` (what both
    rewrites below start from); else ``None``."""
    if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    dims, xdims = _dims(w, 4), _dims(x, 4)
    if x is None or dims is None or None in dims or x.dtype != ir.DataType.FLOAT or xdims is None:
        return None
    if not _plain(node) or any(node.attributes.get(a) is not None for a in ("output_shape", "output_padding")):
        return None
    return xdims, dims, _ints(node, "strides", [1, 1]), _ints(node, "dilations", [1, 1]), _ints(node, "pads", [0, 0, 0, 0])


def _transpose_plan(node: ir.Node, block: int, max_kernel: int) -> tuple | None:
    """``(ci, co, kh, kw, pads, dilations)`` of the Conv a unit-stride 2-D ``ConvTranspose``
    equals (its pads ``d*(k-1) - p`` a side), when ``to_nchwc`` then takes it; else ``None``
    (strided ones: ``_phase_plan``)."""
    geometry = _conv_transpose(node)
    if geometry is None:
        return None
    _, (ci, co, kh, kw), strides, dil, pads = geometry  # ConvTranspose's filter is [in, out, kh, kw]
    conv_pads = [d * (k - 1) - p for d, k, p in zip(dil * 2, [kh, kw] * 2, pads)]
    if strides != [1, 1] or co % block or kh * kw > max_kernel or min(conv_pads) < 0:
        return None
    return ci, co, kh, kw, conv_pads, dil


def _flip(rw: Rewrite, value: ir.Value, axes: list[int]) -> ir.Value:
    """``Slice`` reversing ``value``'s ``axes`` whole (what ``permute`` folds into a copy)."""
    return rw.node("Slice", value, _const(rw, "as_conv/starts", [-1] * len(axes)), _const(rw, "as_conv/ends", [-(2**62)] * len(axes)),
                   _const(rw, "as_conv/axes", axes), _const(rw, "as_conv/steps", [-1] * len(axes)), name="as_conv/Flip").outputs[0]


def _unit_conv(rw: Rewrite, node: ir.Node, plan: tuple) -> ir.Node:
    """A unit-stride ConvTranspose as ``Conv(x, W')``: ``W'`` the filter flipped in space with
    its channel axes swapped, padded ``d*(k-1) - p`` a side (``plan``'s pads)."""
    ci, co, kh, kw, pads, dil = plan
    flip = _flip(rw, node.inputs[1], [2, 3])  # type: ignore[arg-type]
    swap = rw.node("Transpose", flip, perm=[1, 0, 2, 3], name="as_conv/Swap").outputs[0]
    flip.shape, flip.dtype = ir.Shape([ci, co, kh, kw]), ir.DataType.FLOAT
    swap.shape, swap.dtype = ir.Shape([co, ci, kh, kw]), ir.DataType.FLOAT
    return rw.node("Conv", node.inputs[0], swap, *node.inputs[2:3], name="as_conv", like=node,
                   pads=pads, dilations=dil, kernel_shape=[kh, kw])


def _phase_plan(node: ir.Node, block: int, max_kernel: int) -> tuple | None:
    """``(ci, co, kernel, strides, taps, pads, in_hw, out_hw)`` of a strided 2-D
    ``ConvTranspose`` that ``_phase_conv`` rewrites (no bias, static spatial dims, and a phase
    Conv that ``to_nchwc`` takes); else ``None``."""
    geometry = _conv_transpose(node) if len(node.inputs) == 2 else None
    if geometry is None or None in geometry[0][2:]:
        return None
    (_, _, h, w), (ci, co, kh, kw), strides, dil, pads = geometry
    taps = [-(-kh // strides[0]), -(-kw // strides[1])]  # each output phase's kernel: ceil(k / s)
    if strides == [1, 1] or dil != [1, 1] or (co * strides[0] * strides[1]) % block or taps[0] * taps[1] > max_kernel:
        return None
    out = [strides[0] * (h - 1) + kh - pads[0] - pads[2], strides[1] * (w - 1) + kw - pads[1] - pads[3]]
    if co * out[0] * out[1] < MIN_PHASE_OUTPUTS:
        return None
    return ci, co, [kh, kw], strides, taps, pads, [h, w], out


def _phase_conv(rw: Rewrite, node: ir.Node, plan: tuple) -> ir.Node:
    """A strided ConvTranspose as one ``Conv`` over its ``s*s`` output phases, interleaved after.

    Output row ``s*p + a`` of the transposed convolution sums ``x[p - m] * W[a + s*m]`` over
    ``m``: for each phase ``a`` an ordinary convolution of ``x`` (padded ``taps - 1`` a side)
    with every ``s``-th tap of the filter, flipped. The phases' filters stack as output channels
    ``(o, a, b)`` of one Conv (the filter rearranged every step: it is a weight), and
    ``Reshape``/``Transpose``/``Reshape`` interleave them (DepthToSpace's CRD order) before the
    transposed convolution's pads crop the border."""
    ci, co, (kh, kw), (sh, sw), (mh, mw), pads, (h, w), (out_h, out_w) = plan
    filt = node.inputs[1]
    if mh * sh != kh or mw * sw != kw:  # zero taps up to a whole number of phases
        filt = rw.node("Pad", filt, _const(rw, "as_conv/filter_pads", [0, 0, 0, 0, 0, 0, mh * sh - kh, mw * sw - kw]),
                       name="as_conv/PadFilter").outputs[0]
    filt = rw.node("Reshape", filt, _const(rw, "as_conv/phases", [ci, co, mh, sh, mw, sw]), name="as_conv/Phases").outputs[0]
    filt = rw.node("Transpose", _flip(rw, filt, [2, 4]), perm=[1, 3, 5, 0, 2, 4], name="as_conv/Stack").outputs[0]
    filt = rw.node("Reshape", filt, _const(rw, "as_conv/filter", [co * sh * sw, ci, mh, mw]), name="as_conv/Filter").outputs[0]
    filt.shape = ir.Shape([co * sh * sw, ci, mh, mw])
    conv = rw.node("Conv", node.inputs[0], filt, name="as_conv", like=node,
                   pads=[mh - 1, mw - 1, mh - 1, mw - 1], kernel_shape=[mh, mw])
    p, q = h + mh - 1, w + mw - 1
    conv.outputs[0].shape = ir.Shape([node.inputs[0].shape[0], co * sh * sw, p, q])  # type: ignore[index]
    y = rw.node("Reshape", conv.outputs[0], _const(rw, "as_conv/split", [-1, co, sh, sw, p, q]), name="as_conv/Split").outputs[0]
    y = rw.node("Transpose", y, perm=[0, 1, 4, 2, 5, 3], name="as_conv/Interleave").outputs[0]
    rw.node("Reshape", y, _const(rw, "as_conv/rows", [-1, co, sh * p, sw * q]), name="as_conv/Rows")
    for made in rw.nodes:  # typed, so that later lowerings (``permute``) see float32 values
        made.outputs[0].dtype = ir.DataType.FLOAT
    if (pads[0], pads[1], out_h, out_w) != (0, 0, sh * p, sw * q):
        rw.node("Slice", rw.nodes[-1].outputs[0], _const(rw, "as_conv/crop_starts", pads[:2]),
                _const(rw, "as_conv/crop_ends", [pads[0] + out_h, pads[1] + out_w]), _const(rw, "as_conv/crop_axes", [2, 3]),
                name="as_conv/Crop")
    return conv


def _as_conv(graph: ir.Graph, node: ir.Node, block: int, max_kernel: int, phases: bool, names: NameScope) -> ir.Node | None:
    """A 2-D ``ConvTranspose`` (a Conv's data gradient) rewritten as the ``Conv`` it equals
    (``_unit_conv``; strided ones with ``phases``, ``_phase_conv``) when that Conv is one
    ``to_nchwc`` takes: that Conv, to be moved next; else ``None`` (nothing changed)."""
    plan = _transpose_plan(node, block, max_kernel)
    strided = _phase_plan(node, block, max_kernel) if phases and plan is None else None
    if plan is None and strided is None:
        return None
    rw = Rewrite(graph, node.name or "convt", names=names)
    conv = _unit_conv(rw, node, plan) if plan is not None else _phase_conv(rw, node, strided)
    graph.insert_before(node, rw.nodes)
    hand_over(node.outputs, rw.nodes[-1].outputs)
    graph.remove(node, safe=True)
    return conv


def to_nchwc(model: ir.Model, *, block: int, max_kernel: int = MAX_KERNEL_TAPS, phases: bool = False) -> int:
    """Rewrite ``model``'s trainable-weight convolutions onto ORT CPU's NCHWc ops, in place.

    Args:
        model: A step or inference graph for a CPU session (its main graph is rewritten).
        block: ORT CPU's channel block on this machine (``mpgraph.runtime.probe.nchwc_block``,
            which the runtime passes in ``PlanOptions.nchwc_block``); 0 rewrites nothing.
        max_kernel: Convolutions with more kernel taps than this keep the plain op.
        phases: Also rewrite strided ``ConvTranspose`` nodes as one Conv over their output
            phases (``_phase_conv``). It pays only when its transposes then run on the
            library's ``Permute`` (``lower`` runs ``permute.fast_transposes`` after):
            on ORT's own ``Transpose`` the interleave alone took 2.2-2.5 ms on the DQN's
            ``[32, 32, 2, 2, 10, 10]``.

    Returns:
        How many ``Conv`` nodes were rewritten.
    """
    if not block:
        return 0
    graph = model.graph
    done = 0
    slices_to_conv(model, block, max_kernel)  # its Convs are counted as they move, below
    names = NameScope(graph)
    for node in list(graph):
        node = _as_conv(graph, node, block, max_kernel, phases, names) or node
        dims = _eligible(node, block, max_kernel)
        if dims is not None:
            _rewrite(graph, node, dims, block, names)
            done += 1
    if done:
        model.opset_imports.setdefault(NCHWC_DOMAIN, 1)
    return done
