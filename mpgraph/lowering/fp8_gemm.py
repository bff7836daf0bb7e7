"""Native fp8 GEMMs: a quantised product becomes ``com.microsoft.GemmFloat8`` (CUDA), or the
kernel library's capturable ``ai.mpgraph.GemmFp8`` where it has cuBLASLt (rule 6).

``QuantizeFp8Pass`` writes each operand of an fp8 product as ``q = Cast(x * s, fp8,
saturate=1)``, dequantised ``Cast(q, float) * (1 / s)`` (then cast to the low dtype) before a
plain MatMul/Gemm. On ONNX Runtime's CUDA provider the product can read ``q`` itself:
``GemmFloat8(A=q_a, B=q_b, scaleA=1/s_a, scaleB=1/s_b)`` is cuBLASLt's fp8 GEMM, computing
``alpha * (scaleA * A) @ (scaleB * B)^T`` into bf16, fp16 or float32. The dequantise nodes die.
A product of two E4M3 operands writes its own output dtype; a mixed E4M3/E5M2 product (the
gradient GEMMs) writes float32, cast after to a bf16/fp16 product's dtype (rule 5).

What ``GemmFloat8`` takes, read from ONNX Runtime's sources (1.31.1 ships the CUDA kernel of
``onnxruntime/contrib_ops/cuda/math/gemm_float8.cu``; its strings are in the wheel's
``libonnxruntime_providers_cuda.so``) and from its op schema (``GemmFloat8`` in
``onnxruntime/core/graph/contrib_ops/contrib_defs.cc``, as ``onnxruntime.capi`` lists it):

- inputs ``A, B, C (optional), scaleA, scaleB, scaleY`` (``scale*`` float32, optional):
  with more than three inputs the kernel reads ``scaleA``/``scaleB`` from inputs 3 and 4
  and ``scaleY`` from input 5 only when there are six; they are cuBLASLt's
  ``A_SCALE_POINTER``/``B_SCALE_POINTER``, i.e. dequantisation multipliers. So: ``[A, B, "",
  scaleA, scaleB]``, no ``scaleY`` (a D scale is for fp8 outputs);
- attributes ``transA``, ``transB``, ``alpha``, ``beta``, ``dtype`` (the output's, as
  ``Cast``'s ``to``), ``activation``; the schema documents "Float 8 only supported transA=0"
  and "transB=1" (cuBLASLt's fp8 GEMMs on Hopper take only the "TN" layout; the kernel swaps
  A and B for its column-major call). ``rowMajor``, ``computeType`` and
  ``fastAccumulationMode`` of older versions are gone: the compute type follows the output
  (bf16: ``CUBLAS_COMPUTE_32F_FAST_16BF``; float32: ``..._FAST_TF32``) and fp8 runs with
  ``CUBLASLT_MATMUL_DESC_FAST_ACCUM = 1``;
- 2-D ``A`` and ``B`` only (``GetTypeAndShape`` enforces rank 2);
- cuBLASLt fp8: E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3 (the mixed ones not into bf16 as ORT
  calls them, rule 5), never E5M2 x E5M2; every leading dimension a multiple of 16 bytes:
  with ``A'`` ``[M, K]``, ``B'`` ``[N, K]`` and ``Y`` ``[M, N]`` row-major, K and N multiples
  of 16 (``torch._scaled_mm`` checks the same on the same cuBLASLt call);
- each call synchronises the stream, creates a cuBLASLt handle and ``cudaMalloc``s a 32 MiB
  workspace (freed after): it cannot be captured in a CUDA graph, and it costs host time.

Rules (each product with ``mpgraph.fp8`` metadata, ``_ir/meta.NODE_FP8``):
    1. Both operands must be the pass's dequantise chains, found by structure from the
       product's inputs and checked against the metadata's ``fp8``/``scale_inv`` values
       (slot numbers are not trusted: a lowering may have swapped a Gemm's inputs).
    2. GemmFloat8 computes ``A' @ B'^T`` with ``A'`` ``[M, K]`` and ``B'`` ``[N, K]``. An
       operand already in that layout is read as it is (``Gemm(dY, W, transB=1)``, the input
       gradient); otherwise (a 3-D activation, ``Transpose``d operands) the fp8 value is cut
       again from the scaled float value: ``Cast(Transpose/Reshape(x * s), fp8)``, the same
       bits, since ``Cast`` is element-wise (ORT's CUDA ``Transpose``/``Reshape`` kernels
       are not known here to take float8). Example: the forward ``MatMul(x[b, T, K],
       W[K, N])`` reads ``Cast(Reshape(x*s, [-1, K]))`` and ``Cast(Transpose(W*s))``;
       the weight gradient ``Gemm(x2, dY, transA=1)`` reads both transposed.
    3. A MatMul batched over leading axes of its first operand is reshaped to 2-D and its
       output back; one whose second operand is batched too (attention) is left alone.
    4. Skipped, and counted by reason in the log: E5M2 x E5M2; a dim not a known multiple
       of 16 among N and K (a symbolic token count as K counts when a static factor of it is,
       e.g. ``batch * 2048``; M is free, as in ``torch._scaled_mm``'s checks); a Gemm with a bias
       ``C`` (GemmFloat8 adds a bias only of the output dtype, untested here); an output dtype
       GemmFloat8 lacks.
    5. The output dtype (``gemm_dtype``): the product's own for E4M3 x E4M3 into bf16 or
       fp16; float32 for a mixed pair (E5M2 x E4M3, E4M3 x E5M2) and for a float32 product,
       followed by ``Cast(to=<the product's dtype>)`` where that is bf16/fp16, so every value
       keeps its type. Measured on the H200 with onnxruntime-gpu 1.31.1
       (``benchmarks/results/gemm_float8_probe_2026-12-02.txt``): E4M3 x E4M3 into bf16 runs;
       both mixed pairs into bf16 fail with ``CUBLAS_STATUS_NOT_SUPPORTED`` (gemm_float8.cu; ORT
       asks cuBLASLt for ``CUBLAS_COMPUTE_32F_FAST_16BF``, which has no mixed-format fp8 GEMM)
       and run into float32 and float16. float32 rather than float16: cuBLASLt accumulates in
       float32, so a float32 output and the Cast round once, as a direct bf16 output would;
       float16 would round twice (fp16, then bf16) and clip at fp16's range. E4M3 x E4M3
       into fp16 (an fp8 section on a float16 policy) was not measured.
    6. With the kernel library's cuBLASLt build (``Target.gemm_bias``: ``GemmBias`` and
       ``GemmFp8`` come with the same ``MPG_WITH_CUBLASLT``), a product whose output is bf16
       becomes ``ai.mpgraph.GemmFp8(A', B', scaleA, scaleB; alpha)`` instead, and every
       transposed cut of rule 2 is ``ai.mpgraph.Fp8Transpose(q)`` of the pass's fp8 value ``q``
       (leading dims flattened, one byte an element: the same bits as ``Cast(Transpose(x * s))``,
       without the float32 transpose and the second Cast: 2 bytes an element moved, not 13;
       the bench GPT: 45 Transposes, 6.8 GB a step), and each amax the pass wrote,
       ``ReduceMax(Abs(x))``, is ``ai.mpgraph.AbsMax(x)``: one read of ``x`` instead of a float32
       ``|x|`` written and read again (the bench GPT: 27 Abs and 28 ReduceMax, 8.9 GB a step);
       each quantisation ``Cast(x * s, fp8)`` whose product nothing else reads is
       ``ai.mpgraph.CastToFloat8E4M3FN/E5M2(x, s)`` (one read of ``x``, or of the bf16 value
       ``x`` widens, and a byte written, not a float32 ``x * s`` written and read again); and
       GemmFp8 reads a 3-D activation's fp8 value as it is (its leading dims are M), no cut.
       GemmFp8 has the same layout
       and scales, written into bf16 for every format pair (cuBLASLt's float32 compute type has
       the mixed pairs into bf16; ``csrc/gemm_fp8.cu`` goes through a float32 buffer where a
       shape has no such algorithm), so rule 5's Cast is not needed. The reason is the step, not
       the GEMM: ``GemmFloat8`` (ORT 1.31) ``cudaMalloc``s and ``cudaFree``s its 32 MiB
       workspace on every call (``cudaFree`` waits for the device) and cannot be captured, so
       an fp8 step on it runs without CUDA graphs, one host-synchronised launch after another
       (GPT-2 small: ~3500 nodes, 147 GEMMs). ``GemmFp8`` keeps its handle, workspace and plans,
       as ``GemmBias`` does.
    7. With rule 6, an ``AbsMax(x)`` beside a ``CastToFloat8*(x, s)`` whose ``s`` does not come
       from that amax (the delayed recipe) is one ``CastToFloat8*Amax(x, s) -> (q, amax)``: one
       read of ``x`` for both (``_fuse_cast_amaxes``).
    8. With rule 6, a bf16 bias ``Add`` after a GemmFp8 (through its ``Reshape``) is the GemmFp8's
       optional fifth input, cuBLASLt's bias epilogue (``_fuse_biases``).
    9. The backward's quantisation of a saved activation reads the forward's ``q`` instead
       (``_share_saved_casts``), and with rule 7 an ``Fp8Transpose`` of a ``CastToFloat8*Amax``'s
       ``q`` is made by the cast, one ``CastTransposeToFloat8*(x, s) -> (q, qT, amax)``
       (``_fuse_cast_transposes``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.lowering.fp8_layout import (
    CAST_OPS,
    absorb_output_transposes,
    cancel_fp8_transposes,
    quantise_before_transposes,
)
from mpgraph.lowering.match import DOMAIN, hand_over, is_op

__all__ = ["gemm_dtype", "lower_fp8_gemms"]

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
#: cuBLASLt's fp8 alignment: every dim of the problem a multiple of this.
ALIGN = 16
_FP8 = (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2)
_OUT = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT)
#: The output dtype GemmFloat8 is written with for a mixed E4M3/E5M2 pair: cuBLASLt (H200, onnxruntime-gpu
#: 1.31.1) refuses such a pair into bf16 (rule 5).
_MIXED_OUT = ir.DataType.FLOAT
#: Ops whose output has its input's shape (the other input, if any, a scalar or broadcast).
_SAME_SHAPE = frozenset({"Cast", "Identity", "Mul", "Div"})


@dataclass(frozen=True)
class _Operand:
    """One dequantised operand: ``value`` (what the product reads) <- ``chain`` <- ``bits``
    (``Cast(scaled, fp8)``), with ``1 / s`` in ``scale_inv``."""

    value: ir.Value
    bits: ir.Value
    scaled: ir.Value
    scale_inv: ir.Value
    chain: tuple[ir.Node, ...]

    @property
    def fmt(self) -> ir.DataType:
        assert self.bits.dtype is not None
        return self.bits.dtype


def gemm_dtype(fmt_a: ir.DataType, fmt_b: ir.DataType, out: ir.DataType) -> ir.DataType:
    """The ``dtype`` GemmFloat8 is written with for fp8 operands ``fmt_a x fmt_b`` of a
    product whose output is ``out`` (rule 5): ``out`` for a same-format pair, float32 for a
    mixed one (then cast to ``out``)."""
    return out if fmt_a == fmt_b else _MIXED_OUT


def _cast_to(node: ir.Node | None) -> ir.DataType | None:
    if not is_op(node, "Cast"):
        return None
    attr = node.attributes.get("to")  # type: ignore[union-attr]
    return ir.DataType(attr.as_int()) if attr is not None else None


def _operand(value: ir.Value | None, entries: list[dict[str, str]]) -> _Operand | None:
    """Rule 1: ``value``'s dequantise chain, when it is one the metadata names."""
    if value is None:
        return None
    chain: list[ir.Node] = []
    node = value.producer()
    if _cast_to(node) in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16):
        chain.append(node)  # type: ignore[arg-type]
        node = node.inputs[0].producer() if node.inputs[0] is not None else None  # type: ignore[union-attr]
    if not is_op(node, "Mul"):
        return None
    mul = node
    chain.append(mul)  # type: ignore[arg-type]
    for back, inv in (mul.inputs, mul.inputs[::-1]):  # type: ignore[union-attr]
        widen = back.producer() if back is not None else None
        if inv is None or _cast_to(widen) != ir.DataType.FLOAT:
            continue
        bits = widen.inputs[0]  # type: ignore[union-attr]
        quantise = bits.producer() if bits is not None else None
        if bits is None or bits.dtype not in _FP8 or _cast_to(quantise) != bits.dtype:
            continue
        if not any(e.get("fp8") == bits.name and e.get("scale_inv") == inv.name for e in entries):
            continue
        return _Operand(value, bits, quantise.inputs[0], inv, (*chain, widen))  # type: ignore[union-attr,arg-type]
    return None


def _dim(value: ir.Value, axis: int) -> int | None:
    """``value``'s size along ``axis`` (negative: from the end) where it can be known: its
    shape, or through same-shape ops and a last-axis ``Concat`` of known parts."""
    for _ in range(64):
        shape = value.shape
        if shape is None:
            return None
        rank = len(shape)
        ax = axis % rank if rank else 0
        if rank and isinstance(shape[ax], int):
            return int(shape[ax])
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in _SAME_SHAPE and node.inputs and node.inputs[0] is not None:
            value = node.inputs[0]
            continue
        if node.op_type == "Concat" and ax == rank - 1 and node.attributes["axis"].as_int() % rank == ax:
            parts = [_dim(v, -1) if v is not None else None for v in node.inputs]
            return sum(parts) if parts and all(p is not None for p in parts) else None  # type: ignore[misc]
        return None
    return None


def _rows_factor(value: ir.Value) -> int:
    """A static factor of the product of ``value``'s leading dims (its rows as a matrix),
    looking through same-shape ops and ``Flatten``/``Reshape`` that keep the last axis."""
    best = 1
    for _ in range(64):
        shape = value.shape
        if shape is not None and len(shape) >= 1:
            static = [d for d in shape[:-1] if isinstance(d, int)]
            best = max(best, math.prod(static))
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
            return best
        if node.op_type in _SAME_SHAPE or (node.op_type in ("Flatten", "Reshape") and _dim(node.inputs[0], -1)
                                           is not None and _dim(node.inputs[0], -1) == _dim(value, -1)):
            value = node.inputs[0]
            continue
        return best
    return best


class _Lowerer:
    """Rewrites one graph's fp8 products; ``skipped`` counts what it left, by reason."""

    def __init__(self, graph: ir.Graph, library: bool = False) -> None:
        self.graph = graph
        self.library = library  # rule 6: bf16 products on the library's GemmFp8
        self.library_count = 0
        self.outputs = set(graph.outputs)
        self.skipped: Counter[str] = Counter()
        self.cut: dict[tuple[int, bool, bool], ir.Value] = {}  # (id(scaled), flatten, transpose) -> fp8 value
        self.dead: list[ir.Node] = []
        self.count = 0
        self.made = 0  # nodes made, for unique names

    def _name(self, node: ir.Node, what: str) -> str:
        self.made += 1
        return f"{node.name}/fp8_gemm/{what}_{self.made}"

    def lower(self, node: ir.Node) -> None:
        reason = self._try(node)
        if reason:
            self.skipped[reason] += 1
            logger.debug("fp8_gemm: %s left emulated: %s", node.name, reason)

    def _try(self, node: ir.Node) -> str | None:
        entries = list(json.loads(node.metadata_props[md.NODE_FP8]).values())
        a, b = (_operand(node.inputs[i] if i < len(node.inputs) else None, entries) for i in (0, 1))
        if a is None or b is None:
            return "operand not quantised"
        if a.fmt == b.fmt == ir.DataType.FLOAT8E5M2:
            return "e5m2 x e5m2"
        out = node.outputs[0]
        if out.dtype not in _OUT:
            return "output dtype"
        gemm = node.op_type == "Gemm"
        ta, tb = (node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)) if gemm else (0, 0)
        if a.value.shape is None or b.value.shape is None:
            return "unknown rank"
        rank_a, rank_b = len(a.value.shape), len(b.value.shape)
        if rank_b != 2 or rank_a < 2 or (gemm and rank_a != 2):
            return "batched B" if rank_b > 2 else "rank"
        if gemm and len(node.inputs) > 2 and node.inputs[2] is not None:
            return "Gemm with a bias"
        dims = self._dims(a, b, ta, tb)
        if dims is None:
            return "N or K not a multiple of 16"
        self._rewrite(node, a, b, ta, tb, dims)
        return None

    def _dims(self, a: _Operand, b: _Operand, ta: int, tb: int) -> tuple[int, int | None] | None:
        """The problem's (N, K), both known multiples of 16 (rule 4), else ``None``. M is
        free: it is no leading dimension of ``A'`` ``[M, K]``, ``B'`` or ``Y`` ``[M, N]``.
        K is ``None`` when only a static factor of it is known (a symbolic token count):
        aligned, but no size to declare."""
        k = _dim(a.value, 0 if ta else -1) or _dim(b.value, -1 if tb else 0)
        n = _dim(b.value, 0 if tb else -1)
        if n is None or n % ALIGN:
            return None
        if k is None and ta:  # the reduction runs over a token count: a static factor will do
            factor = _rows_factor(a.value)
            return (n, None) if factor % ALIGN == 0 else None
        if k is None or k % ALIGN:
            return None
        return n, k

    def _rewrite(self, node: ir.Node, a: _Operand, b: _Operand, ta: int, tb: int,
                 dims: tuple[int, int | None]) -> None:
        n, k = dims
        out = node.outputs[0]
        props = {key: v for key, v in node.metadata_props.items() if key == md.NODE_ROLE}
        flatten = len(a.value.shape) > 2  # type: ignore[arg-type]
        rows = _dim(a.value, -1) if ta else _leading(a.value)
        library = self.library and out.dtype == ir.DataType.BFLOAT16  # rule 6
        if library and flatten and not ta:  # GemmFp8 reads a [..., K] A as [M, K] itself
            a2 = a.bits
        else:
            a2 = self._layout(node, a, flatten=flatten, transpose=bool(ta), k=k, rows=rows, props=props)
        b2 = self._layout(node, b, flatten=False, transpose=not tb, k=k, rows=n, props=props)
        alpha = node.attributes.get_float("alpha", 1.0)
        if library:
            dtype = out.dtype
            gemm = ir.Node(DOMAIN, "GemmFp8", [a2, b2, a.scale_inv, b.scale_inv], name=f"{node.name}/GemmFp8",
                           attributes=[ir.AttrFloat32("alpha", alpha)], metadata_props=dict(node.metadata_props))
            self.library_count += 1
        else:
            dtype = gemm_dtype(a.fmt, b.fmt, out.dtype)  # type: ignore[arg-type]
            gemm = ir.Node(MS_DOMAIN, "GemmFloat8", [a2, b2, None, a.scale_inv, b.scale_inv], name=f"{node.name}/GemmFloat8",
                           attributes=[ir.AttrInt64("transA", 0), ir.AttrInt64("transB", 1), ir.AttrFloat32("alpha", alpha),
                                       ir.AttrInt64("dtype", dtype.value)],
                           metadata_props=dict(node.metadata_props))
        self.graph.insert_before(node, gemm)
        y = gemm.outputs[0]
        y.dtype = dtype
        y.shape = ir.Shape([_leading(out), n]) if flatten else out.shape
        if dtype != out.dtype:  # rule 5: back to the product's dtype
            shape = y.shape
            y = self._add(node, "Cast", [y], props, to=out.dtype)
            y.dtype, y.shape = out.dtype, shape
        if flatten:
            y = self._add(node, "Reshape", [y, self._out_shape(node, a, n, props)], props)
        hand_over((out,), (y,))
        self.dead.extend([node, *a.chain, *b.chain, a.bits.producer(), b.bits.producer()])  # type: ignore[list-item]
        self.count += 1

    def _layout(self, node: ir.Node, op: _Operand, *, flatten: bool, transpose: bool, k: int | None,
                rows: int | None, props: dict[str, str]) -> ir.Value:
        """Rule 2: ``op``'s fp8 value as ``[rows, K]`` (``flatten``) and/or transposed. ``k``
        ``None``: only a static factor of K is known, and the cut declares the K axis its
        input has (a symbolic token count), never the factor."""
        if not flatten and not transpose:
            return op.bits
        key = (id(op.scaled), flatten, transpose)
        if key not in self.cut and transpose and self.library:  # rule 6: the pass's fp8 bits, transposed
            shape = [_leading(op.scaled), k] if flatten else list(op.scaled.shape)  # type: ignore[arg-type]
            shape = shape[::-1]
            cut = ir.node("Fp8Transpose", [op.bits], domain=DOMAIN, name=self._name(node, "Fp8Transpose"),
                          metadata_props=dict(props))
            self.graph.insert_before(node, cut)
            bits = cut.outputs[0]
            bits.name, bits.dtype = cut.name, op.fmt
            bits.shape = ir.Shape([rows if rows is not None else shape[0], k if k is not None else shape[1]])
            self.cut[key] = bits
        if key not in self.cut:
            x = op.scaled
            shape = list(x.shape)  # type: ignore[arg-type]
            if flatten:  # a MatMul's 3-D activation: K is its last axis, known
                assert k is not None
                x = self._add(node, "Reshape", [x, self._const(node, np.array([-1, k], np.int64))], props)
                shape = [_leading(op.scaled), k]
                x.dtype, x.shape = op.scaled.dtype, ir.Shape(shape)
            if transpose:
                x = self._add(node, "Transpose", [x], props, perm=[1, 0])
                shape = shape[::-1]
                x.dtype, x.shape = op.scaled.dtype, ir.Shape(shape)
            bits = self._add(node, "Cast", [x], props, to=op.fmt, saturate=1)
            bits.dtype, bits.shape = op.fmt, ir.Shape([rows if rows is not None else shape[0],
                                                       k if k is not None else shape[1]])
            self.cut[key] = bits
        return self.cut[key]

    def _out_shape(self, node: ir.Node, a: _Operand, n: int, props: dict[str, str]) -> ir.Value:
        """The product's output shape: a constant where at most one dim is unknown, else
        ``Concat(Shape(A)[:-1], [N])``."""
        shape = node.outputs[0].shape
        if shape is not None and sum(not isinstance(d, int) for d in shape) <= 1:
            return self._const(node, np.array([d if isinstance(d, int) else -1 for d in shape], np.int64))
        lead = self._add(node, "Shape", [a.scaled], props, end=-1)
        return self._add(node, "Concat", [lead, self._const(node, np.array([n], np.int64))], props, axis=0)

    def _const(self, node: ir.Node, array: np.ndarray) -> ir.Value:
        c = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(array))], name=self._name(node, "const"))
        self.graph.insert_before(node, c)
        c.outputs[0].dtype, c.outputs[0].shape = ir.DataType.INT64, ir.Shape(list(array.shape))
        c.outputs[0].name = c.name
        return c.outputs[0]

    def _add(self, node: ir.Node, op: str, inputs: list[ir.Value], props: dict[str, str], **attrs: object) -> ir.Value:
        new = ir.node(op, inputs, attributes=attrs, name=self._name(node, op), metadata_props=dict(props))
        self.graph.insert_before(node, new)
        new.outputs[0].name = new.name
        return new.outputs[0]

    def sweep(self) -> None:
        """Remove the replaced products and every dequantise node no one reads any more."""
        pending = list(dict.fromkeys(n for n in self.dead if n is not None))
        changed = True
        while changed:
            changed = False
            for n in list(pending):
                if n.graph is None:
                    pending.remove(n)
                elif all(not v.uses() and v not in self.outputs for v in n.outputs):
                    self.graph.remove(n, safe=True)
                    pending.remove(n)
                    changed = True


def _leading(value: ir.Value) -> int | ir.SymbolicDim | None:
    """The product of ``value``'s leading dims when static, else unknown."""
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape[:-1]):
        return None
    return math.prod(shape[:-1])  # type: ignore[arg-type]


def _fuse_amaxes(graph: ir.Graph) -> int:
    """Rule 6: each amax the pass wrote, ``ReduceMax(Abs(x), keepdims=0)`` over every axis with
    the ``Abs`` read by nothing else, as the library's ``AbsMax(x)`` (one read of ``x``, no
    float32 copy of ``|x|``; the same value: a maximum is exact), of ``v`` itself where ``x``
    is ``Cast(v, float)`` of a bf16/fp16 ``v`` (the float32 copy then feeds only the scaling,
    which the pointwise rule fuses with the Cast); how many."""
    count = 0
    for node in list(graph):
        if not is_op(node, "ReduceMax") or node.metadata_props.get(md.NODE_INSERTED) != "fp8" or len(node.inputs) != 1:
            continue
        if node.attributes.get_int("keepdims", 1) != 0 or node.inputs[0] is None:
            continue
        absolute = node.inputs[0].producer()
        if not is_op(absolute, "Abs") or len(node.inputs[0].uses()) != 1 or node.inputs[0] in graph.outputs:
            continue
        x = absolute.inputs[0]  # type: ignore[union-attr]
        if x is None or x.dtype not in _OUT:
            continue
        widen = x.producer()  # |float32(v)| of a bf16/fp16 v is |v|: read v, half the bytes
        if _cast_to(widen) == ir.DataType.FLOAT and widen.inputs[0] is not None \
                and widen.inputs[0].dtype in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16):  # type: ignore[union-attr]
            x = widen.inputs[0]  # type: ignore[union-attr]
        fused = ir.node("AbsMax", [x], domain=DOMAIN, name=f"{node.name}/AbsMax", metadata_props=dict(node.metadata_props))
        graph.insert_before(node, fused)
        hand_over(node.outputs, fused.outputs)
        graph.remove([node, absolute], safe=True)  # type: ignore[list-item]
        count += 1
    return count


def _fuse_scale_casts(graph: ir.Graph) -> int:
    """Rule 6: each quantisation ``Cast(Mul(x, s), fp8, saturate=1)`` whose product nothing
    else reads, as the library's ``CastToFloat8E4M3FN/E5M2(x, s)`` (one read of ``x``, a byte
    written an element; the product rounds to float32 as before), of ``v`` itself where ``x``
    is ``Cast(v, float)`` of a bf16/fp16 ``v``; how many."""
    count = 0
    for node in list(graph):
        to = _cast_to(node)
        if to not in CAST_OPS or node.attributes.get_int("saturate", 1) != 1 or node.inputs[0] is None:
            continue
        scaled = node.inputs[0]
        mul = scaled.producer()
        if not is_op(mul, "Mul") or len(scaled.uses()) != 1 or scaled in graph.outputs:
            continue
        x, scale = mul.inputs  # type: ignore[union-attr]
        if x is None or scale is None or x.dtype != ir.DataType.FLOAT or scale.dtype != ir.DataType.FLOAT \
                or scale.shape is None or scale.shape.rank() != 0:
            continue
        widen = x.producer()
        if _cast_to(widen) == ir.DataType.FLOAT and widen.inputs[0] is not None \
                and widen.inputs[0].dtype in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16):  # type: ignore[union-attr]
            x = widen.inputs[0]  # type: ignore[union-attr]
        fused = ir.node(CAST_OPS[to], [x, scale], domain=DOMAIN, name=f"{node.name}/{CAST_OPS[to]}",
                        metadata_props=dict(node.metadata_props))
        graph.insert_before(node, fused)
        hand_over(node.outputs, fused.outputs)
        graph.remove(node, safe=True)
        for dead in (mul, widen):
            if dead is not None and dead.graph is not None and all(not v.uses() and v not in graph.outputs for v in dead.outputs):
                graph.remove(dead, safe=True)
        count += 1
    return count


def _depends_on(value: ir.Value, node: ir.Node, limit: int = 256) -> bool:
    """Whether ``value`` is computed from ``node``'s outputs (looked for through at most
    ``limit`` producers; more counts as yes)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        producer = todo.pop().producer()
        if producer is None or id(producer) in seen:
            continue
        if producer is node or len(seen) >= limit:
            return True
        seen.add(id(producer))
        todo.extend(v for v in producer.inputs if v is not None)
    return False


def _fuse_cast_amaxes(graph: ir.Graph) -> int:
    """Rule 7: an ``AbsMax(x)`` and a ``CastToFloat8*(x, s)`` of the same ``x`` whose scale ``s``
    does not come from that amax (the delayed recipe: ``s`` is from earlier steps' amaxes; the
    current recipe's ``s`` is from this one, and stays two passes) become one
    ``CastToFloat8*Amax(x, s) -> (q, amax)``: ``x`` read once, where the two read it twice (the
    fp8 ``gemm`` step's census: ``AbsMax`` 1.64 GB of its 24.80 GB a step). The same bits: the
    amax is a maximum of the same values, the cast element-wise. Placed before the first of the
    two where ``s`` is computed before it, else before the cast where nothing reads the amax
    earlier; otherwise left. How many."""
    fused_ops = {name: f"{name}Amax" for name in CAST_OPS.values()}
    order = {id(n): i for i, n in enumerate(graph)}
    count = 0
    for amax in list(graph):
        if not (amax.domain == DOMAIN and amax.op_type == "AbsMax") or amax.inputs[0] is None:
            continue
        x = amax.inputs[0]
        casts = [u.node for u in x.uses() if u.idx == 0 and u.node.domain == DOMAIN and u.node.op_type in fused_ops
                 and u.node.inputs[1] is not None and not _depends_on(u.node.inputs[1], amax)]
        if not casts:
            continue
        cast = min(casts, key=lambda n: order[id(n)])
        scale = cast.inputs[1]
        first = min((amax, cast), key=lambda n: order[id(n)])
        made = scale.producer()  # type: ignore[union-attr]
        if made is None or order.get(id(made), -1) < order[id(first)]:
            where = first
        elif all(order[id(u.node)] > order[id(cast)] for u in amax.outputs[0].uses()):
            where = cast
        else:
            continue
        fused = ir.node(fused_ops[cast.op_type], [x, scale], domain=DOMAIN, num_outputs=2,
                        name=f"{cast.name}/Amax", metadata_props=dict(cast.metadata_props))
        graph.insert_before(where, fused)
        order[id(fused)] = order[id(where)]
        hand_over(cast.outputs, fused.outputs[:1])
        hand_over(amax.outputs, fused.outputs[1:])
        graph.remove([cast, amax], safe=True)
        count += 1
    return count


def _same_dim(a: object, b: object) -> bool:
    return a == b if isinstance(a, int) or isinstance(b, int) else a is not None and str(a) == str(b)


def _share_saved_casts(graph: ir.Graph) -> int:
    """Rule 9, first half: the backward's quantisation of a saved activation,
    ``CastToFloat8*(Flatten/Reshape(x), s)`` with the forward's scale ``s``, is the forward's own
    ``q`` of ``x`` where its readers flatten leading dims themselves (``Fp8Transpose``, GemmFp8's
    ``A``) and the last dim is kept: the same bytes in the same order. They read the forward's
    ``q``; the backward's cast (a second read of ``x``, kept alive for it) goes, and the forward's
    cast then makes the transpose too (``_fuse_cast_transposes``). How many."""
    count = 0
    for cast in list(graph):
        if not (cast.domain == DOMAIN and cast.op_type in CAST_OPS.values()) or cast.graph is None:
            continue
        v, scale = cast.inputs
        view = v.producer() if v is not None else None
        if view is None or view.op_type not in ("Flatten", "Reshape") or view.domain not in ("", "ai.onnx"):
            continue
        x = view.inputs[0]
        if x is None or x.shape is None or v.shape is None or not _same_dim(x.shape[-1], v.shape[-1]):
            continue
        q = cast.outputs[0]
        readers = list(q.uses())
        if not readers or q in graph.outputs or not all(
                u.idx == 0 and u.node.domain == DOMAIN and (u.node.op_type == "Fp8Transpose" or (
                    u.node.op_type == "GemmFp8" and md.NODE_FP8_SWAPPED not in u.node.metadata_props)) for u in readers):
            continue
        forward = next((u.node for u in x.uses() if u.idx == 0 and u.node is not cast and u.node.domain == DOMAIN
                        and u.node.op_type in (cast.op_type, f"{cast.op_type}Amax") and u.node.inputs[1] is scale), None)
        if forward is None:
            continue
        for use in readers:
            use.node.replace_input_with(0, forward.outputs[0])
        graph.remove(cast, safe=True)
        if not v.uses() and v not in graph.outputs:
            graph.remove(view, safe=True)
        count += 1
    return count


def _fuse_cast_transposes(graph: ir.Graph) -> int:
    """Rule 9: a ``CastToFloat8*Amax(x, s)`` whose ``q`` an ``Fp8Transpose`` reads is one
    ``CastTransposeToFloat8*(x, s) -> (q, qT, amax)``: ``qT`` from the tile of ``x`` the cast
    already holds, as Transformer Engine's cast-transpose, where the transpose read ``q`` again in
    its own launch (every GEMM operand of a step has one: the weight gradient reads the
    activation and the output gradient transposed, the input gradient the weight; d4096's
    profile: 51 transposes, 2.8 ms a step). The same bits. How many."""
    fused_ops = {f"{name}Amax": name.replace("CastTo", "CastTransposeTo") for name in CAST_OPS.values()}
    count = 0
    for cast in list(graph):
        if not (cast.domain == DOMAIN and cast.op_type in fused_ops) or cast.graph is None:
            continue
        q = cast.outputs[0]
        flips = [u.node for u in q.uses() if u.idx == 0 and u.node.domain == DOMAIN and u.node.op_type == "Fp8Transpose"]
        if not flips or flips[0].outputs[0] in graph.outputs or q.shape is None or q.shape.rank() < 2:
            continue
        flip = flips[0]
        fused = ir.node(fused_ops[cast.op_type], list(cast.inputs), domain=DOMAIN, num_outputs=3,
                        name=f"{cast.name}/Transpose", metadata_props=dict(cast.metadata_props))
        graph.insert_before(cast, fused)
        hand_over([cast.outputs[0], flip.outputs[0], cast.outputs[1]], fused.outputs)
        graph.remove([flip, cast], safe=True)
        count += 1
    return count


def _fuse_biases(graph: ir.Graph) -> int:
    """Rule 8: ``Add(GemmFp8(A', B', sa, sb), bias)``, through the ``Reshape`` back to a 3-D
    activation's shape where there is one, with ``bias`` a bf16 ``[N]`` and the product read by
    nothing else, is ``GemmFp8(A', B', sa, sb, bias)``: cuBLASLt's bias epilogue, as ``GemmBias``
    does in bf16, where the Add read and wrote the whole product again (the fp8 ``gemm`` step's
    census: 4 Adds, 1.09 GB a step; d4096's profile: 8 of them, 2.1 ms). The sum is rounded to
    bf16 once, where the Add rounded the product and then the sum. How many."""
    order = {id(n): i for i, n in enumerate(graph)}
    count = 0
    for gemm in list(graph):
        if not (gemm.domain == DOMAIN and gemm.op_type == "GemmFp8") or len(gemm.inputs) != 4:
            continue
        y = gemm.outputs[0]
        if y.shape is None or y.shape.rank() != 2 or not isinstance(y.shape[1], int) or y in graph.outputs:
            continue
        uses = list(y.uses())
        view = uses[0].node if len(uses) == 1 and is_op(uses[0].node, "Reshape") and uses[0].idx == 0 else None
        out = view.outputs[0] if view is not None else y
        if view is not None and (out in graph.outputs or out.shape is None or out.shape.rank() < 1
                                 or out.shape[-1] != y.shape[1]):
            continue
        reads = list(out.uses())
        add = reads[0].node if len(reads) == 1 and is_op(reads[0].node, "Add") else None
        if add is None or (view is None and len(uses) != 1):
            continue
        bias = add.inputs[1 - reads[0].idx]
        if bias is None or bias.dtype != ir.DataType.BFLOAT16 or y.dtype != ir.DataType.BFLOAT16 \
                or bias.shape is None or list(bias.shape) != [y.shape[1]]:
            continue
        made = bias.producer()
        if made is not None and order.get(id(made), len(order)) > order[id(gemm)]:
            continue
        fused = ir.Node(DOMAIN, "GemmFp8", [*gemm.inputs, bias],
                        attributes=[ir.AttrFloat32("alpha", gemm.attributes.get_float("alpha", 1.0))],
                        metadata_props=dict(gemm.metadata_props))
        graph.insert_before(gemm, fused)
        hand_over(gemm.outputs, fused.outputs)
        hand_over(add.outputs, [out if view is not None else fused.outputs[0]])
        name = gemm.name
        graph.remove([gemm, add], safe=True)
        fused.name = name  # the product's name, as every other GemmFp8 (byte pins, plan caches)
        count += 1
    return count


def lower_fp8_gemms(model: ir.Model, library: bool = False) -> int:
    """Rewrite ``model``'s fp8 products onto ``GemmFloat8`` (with ``library``: bf16 products on
    the kernel library's ``GemmFp8``, rule 6), in place; how many were made.

    Only products carrying ``mpgraph.fp8`` (``QuantizeFp8Pass``) are looked at; what is left
    emulated is logged per reason. ``MPGRAPH_FP8_GEMM=ort`` in the environment keeps every
    product on ``GemmFloat8`` even with ``library`` (to measure one against the other).
    """
    graph = model.graph
    products = [n for n in graph if md.NODE_FP8 in n.metadata_props and n.op_type in ("MatMul", "Gemm")
                and n.domain in ("", "ai.onnx")]
    if not products:
        return 0
    lowerer = _Lowerer(graph, library and os.environ.get("MPGRAPH_FP8_GEMM", "") != "ort")
    for node in products:
        lowerer.lower(node)
    lowerer.sweep()
    amaxes = _fuse_amaxes(graph) if lowerer.library else 0
    casts = _fuse_scale_casts(graph) if lowerer.library else 0
    moved = quantise_before_transposes(graph) if lowerer.library else 0
    cancelled = cancel_fp8_transposes(graph) if lowerer.library else 0
    absorbed = absorb_output_transposes(graph) if lowerer.library else 0
    one_pass = _fuse_cast_amaxes(graph) if lowerer.library else 0
    biases = _fuse_biases(graph) if lowerer.library else 0
    shared = _share_saved_casts(graph) if lowerer.library else 0
    cut_with_cast = _fuse_cast_transposes(graph) if lowerer.library else 0
    if lowerer.count > lowerer.library_count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    if lowerer.library_count or amaxes:
        model.opset_imports.setdefault(DOMAIN, 1)
    logger.info("fp8_gemm: %d of %d fp8 products native (%d on the library's GemmFp8, the others on GemmFloat8); "
                "left emulated: %s; %d amaxes as AbsMax, %d quantisations as CastToFloat8*; %d float transposes "
                "quantised before (%d fp8 transpose pairs cancelled); %d output transposes absorbed; %d amaxes read with "
                "their cast; %d biases in GemmFp8's epilogue; %d saved activations' casts shared with the forward's, "
                "%d fp8 transposes made with their cast", lowerer.count, len(products), lowerer.library_count,
                dict(sorted(lowerer.skipped.items())) or "none", amaxes, casts, moved, cancelled, absorbed, one_pass,
                biases, shared, cut_with_cast)
    return lowerer.count
