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
       read of ``x`` for both (``fp8_fuse.fuse_cast_amaxes``).
    8. With rule 6, a bf16 bias ``Add`` after a GemmFp8 (through its ``Reshape``) is the GemmFp8's
       optional fifth input, cuBLASLt's bias epilogue (``fp8_fuse.fuse_biases``).
    9. The backward's quantisation of a saved activation reads the forward's ``q`` instead
       (``fp8_fuse.share_saved_casts``), and with rule 7 an ``Fp8Transpose`` of a ``CastToFloat8*Amax``'s
       ``q`` is made by the cast, one ``CastTransposeToFloat8*(x, s) -> (q, qT, amax)``
       (``fp8_fuse.fuse_cast_transposes``).
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
from mpgraph.lowering.fp8_fuse import (
    LOW_OR_FLOAT,
    cast_target,
    fuse_amaxes,
    fuse_biases,
    fuse_cast_amaxes,
    fuse_cast_transposes,
    fuse_scale_casts,
    share_saved_casts,
)
from mpgraph.lowering.fp8_layout import (
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


def _operand(value: ir.Value | None, entries: list[dict[str, str]]) -> _Operand | None:
    """Rule 1: ``value``'s dequantise chain, when it is one the metadata names."""
    if value is None:
        return None
    chain: list[ir.Node] = []
    node = value.producer()
    if cast_target(node) in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16):
        chain.append(node)  # type: ignore[arg-type]
        node = node.inputs[0].producer() if node.inputs[0] is not None else None  # type: ignore[union-attr]
    if not is_op(node, "Mul"):
        return None
    mul = node
    chain.append(mul)  # type: ignore[arg-type]
    for back, inv in (mul.inputs, mul.inputs[::-1]):  # type: ignore[union-attr]
        widen = back.producer() if back is not None else None
        if inv is None or cast_target(widen) != ir.DataType.FLOAT:
            continue
        bits = widen.inputs[0]  # type: ignore[union-attr]
        quantise = bits.producer() if bits is not None else None
        if bits is None or bits.dtype not in _FP8 or cast_target(quantise) != bits.dtype:
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
        if out.dtype not in LOW_OR_FLOAT:
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
    rules = (fuse_amaxes, fuse_scale_casts, quantise_before_transposes, cancel_fp8_transposes, absorb_output_transposes,
             fuse_cast_amaxes, fuse_biases, share_saved_casts, fuse_cast_transposes)  # rules 6-9, in this order
    counts = [rule(graph) for rule in rules] if lowerer.library else [0] * len(rules)
    if lowerer.count > lowerer.library_count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    if lowerer.library_count or counts[0]:  # the library's AbsMax, even where no product is on GemmFp8
        model.opset_imports.setdefault(DOMAIN, 1)
    logger.info("fp8_gemm: %d of %d fp8 products native (%d on the library's GemmFp8, the others on GemmFloat8); "
                "left emulated: %s; %d amaxes as AbsMax, %d quantisations as CastToFloat8*; %d float transposes "
                "quantised before (%d fp8 transpose pairs cancelled); %d output transposes absorbed; %d amaxes read with "
                "their cast; %d biases in GemmFp8's epilogue; %d saved activations' casts shared with the forward's, "
                "%d fp8 transposes made with their cast", lowerer.count, len(products), lowerer.library_count,
                dict(sorted(lowerer.skipped.items())) or "none", *counts)
    return lowerer.count
