"""Fuse the backward of a ``Gelu`` into ``ErfGeluGrad`` or ``TanhGeluGrad`` (a session lowering).

Training graphs carry GELU as the standard op ``Gelu`` (``CanonicalizeOpsPass`` rewrites the
exporters' erf and tanh formulas into it before differentiating). Its gradient rule
(``autodiff.rules.elementwise.gelu``) recomputes the forward's intermediates and differentiates;
the erf form (``approximate="none"``)::

    s = Div(x, sqrt2); cdf = Mul(half, Add(one, Erf(s)))
    dx = Mul(dy, Add(cdf, Mul(Div(s, Exp(Mul(s, s))), k)))       k = 1/sqrt(pi)

ten kernels on ORT CUDA over the MLP's widest activation (the bench GPT: [8, 512, 4096] per
layer); the tanh form (``approximate="tanh"``, GPT-2's ``gelu_new``)::

    x2 = Mul(x, x); t = Tanh(Mul(x, Add(c, Mul(x2, ck)))); dinner = Add(c, Mul(x2, ck3))
    dx = Mul(dy, Add(Mul(half, Add(one, t)), Mul(Mul(half, x), Mul(Sub(one, Mul(t, t)), dinner))))

with ``c = sqrt(2/pi)``, ``ck = c * 0.044715``, ``ck3 = 3 * ck``: sixteen kernels (GPT-2 small:
[8, 1024, 3072] per layer, 12 layers). ``ErfGeluGrad(dy, x, sqrt2, one, half, k)`` and
``TanhGeluGrad(dy, x, c, ck, ck3, one, half)`` read dy and x once and write dx. The rule finds
that backward by value (``Gelu``'s gradient block: ``dy`` flowing into its output, ``dx`` its
contribution to x's gradient), never by the nodes the gradient rule emitted, and moves dx's
readers onto the fused output. The kernels round each step to x's type as the rule's ops do,
with the same constants (rounded to float32 as the rule's scalars are, then to x's type as the
policy's conversion does) and the same terms (only the order of commuting operands differs), so
they equal them up to how ORT's kernels round erf, exp and tanh (``benchmarks/kernels_check.py``):
``same math``.

The forward ``Gelu`` stays: it is one ORT kernel on either provider (``ErfGelu``, the fused
forward of the five-op formula, would replace it with other arithmetic and no fewer kernels).
Left as they are: a Gelu whose ``dy``, ``x`` and ``dx`` are not all of one float type (float32
on CPU; float32, float16 or bfloat16 on CUDA) or whose backward a policy computes partly in
another precision (the nodes between them, ``match.interior``, each record theirs), an emulated
low-precision one (``match.emulated``: its rounding Casts would go), a Gelu with an unknown
``approximate``, and a Gelu without a recorded backward.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from mpgraph._ir.links import GradientBlock
from mpgraph._ir.meta import NODE_PRECISION, PRECISION_OF_DTYPE, Precision
from mpgraph.lowering.match import (
    DOMAIN,
    emulated,
    interior,
    op_blocks,
    scalar_constant,
    swap_backward,
)

__all__ = ["fuse_gelu"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_C = math.sqrt(2.0 / math.pi)
#: Per ``approximate``: the fused op and its scalars, in its input order (the gradient rule's
#: values). Erf: ``s = x / sqrt2``, ``cdf = half * (erf(s) + one)``, ``k``. Tanh: ``c``,
#: ``ck = c * 0.044715``, ``ck3 = 3 * ck``, ``one``, ``half``.
_FORMS = {
    "none": ("ErfGeluGrad", (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5), ("k", 1.0 / math.sqrt(math.pi)))),
    "tanh": ("TanhGeluGrad", (("c", _C), ("ck", _C * 0.044715), ("ck3", 3 * _C * 0.044715), ("one", 1.0),
                              ("half", 0.5))),
}


def _operands(block: GradientBlock) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(dy, x, dx)`` of a Gelu's block, all of one kernel type; else ``None``."""
    node = block.node
    if node.attributes.get_string("approximate", "none") not in _FORMS or len(node.inputs) != 1:
        return None
    x = node.inputs[0]
    dy = block.dys[0] if block.dys else None
    dx = block.dxs[0] if block.dxs else None
    if x is None or dy is None or dx is None or x.dtype not in _TYPES or dy.dtype != x.dtype or dx.dtype != x.dtype:
        return None
    if emulated(node.outputs[0], dx) or not _computed_in(interior([dx], [dy, x, *node.outputs]), x.dtype):
        return None
    return dy, x, dx


def _computed_in(nodes: set[ir.Node], dtype: ir.DataType) -> bool:
    """Every float node of the backward computes in ``dtype`` (or records no precision), as
    the kernel does: a policy that kept one of them float32 rounds differently."""
    want = PRECISION_OF_DTYPE[dtype]
    return all(n.metadata_props.get(NODE_PRECISION, want) in (want, Precision.NONE) for n in nodes)


def fuse_gelu(model: ir.Model) -> int:
    """Fuse the backward of every ``Gelu`` in ``model``'s main graph that records one, in
    place; how many ``ErfGeluGrad`` and ``TanhGeluGrad`` nodes were made."""
    graph = model.graph
    fused = 0
    for node, block in op_blocks(graph, "Gelu"):
        found = _operands(block)
        if found is None:
            continue
        dy, x, dx = found
        dtype = x.dtype
        assert dtype is not None
        op, constants = _FORMS[node.attributes.get_string("approximate", "none")]
        # float32 first: the rule's scalars are float32 and the policy rounds them to dtype.
        consts = [scalar_constant(graph, f"ai.mpgraph/gelu/{key}_{dtype.name.lower()}", np.float32(value), dtype)
                  for key, value in constants]
        meta = dict(dx.producer().metadata_props) if dx.producer() is not None else {}  # type: ignore[union-attr]
        grad = ir.Node(DOMAIN, op, [dy, x, *consts], name=f"{node.name}/{op}", metadata_props=meta)
        grad.outputs[0].dtype, grad.outputs[0].shape = dtype, x.shape
        if swap_backward(graph, grad, [dx]):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
