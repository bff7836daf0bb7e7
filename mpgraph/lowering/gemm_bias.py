"""A float16/bfloat16 ``Gemm`` with a bias row as one cuBLASLt matmul with a bias epilogue (a
session lowering).

Symptom: ORT's CUDA ``Gemm`` with an input C first broadcasts C into Y
(``BroadcastBiasKernel``) and then runs the GEMM with beta = 1 (the nvjet ``..._badd_...``
kernels): on the H200 GPT-2 small's bf16 step (25.8 ms) spends 2.37 ms in those 48 broadcasts,
one per linear layer (``benchmarks/results/real_models_gpt2_llama_bf16_no_prep_workers_
2026-12-03T00.log``). torch.compile's addmm uses cuBLASLt's bias epilogue instead.

Rewrite (both GPT-2 exports, torchscript and dynamo, write their linear layers so once
lowered: a 2-D ``Gemm`` of the flattened activations, the bias a ``CastToBFloat16`` output)::

    Gemm(A, B, C; alpha, beta=1, transA, transB) -> Y      A, B, C, Y all float16 or all bfloat16,
                                                           C [N] or [1, N] (N = Y's columns)
    ==>  ai.mpgraph.GemmBias(A, B, C; alpha, transA, transB) -> Y

Same math: both accumulate A'B' in float32, add the bias in float32 and round once to the
element type; cuBLASLt's kernel sums in another order (and the CPU reference loop in k order).

``fuse_matmul_bias`` (rule ``matmul_bias``) takes the other form, BERT's and ViT's linear
layers (in a 2-layer ViT dynamo bf16 plan 8: q, k, v and fc1 of each layer; the attention
output and fc2 products reach their bias through the residual's sum, left to ``pointwise``)::

    Add(MatMul(A [..., K], B [K, N]) or FusedMatMul(A, B; alpha, transB), bias [N])
    ==>  ai.mpgraph.GemmBias(A, B, bias; alpha, transB) -> [..., N]

where the product is read by the Add alone. Approximate, not the same math: the graph rounds
the product to the element type and then the sum, GemmBias only the sum (one rounding less,
so it differs from the graph by at most about one ulp of the output).
The CUDA op exists only in a library built with cuBLASLt (``build.cublaslt_flags``;
``Target.gemm_bias``); the CPU one is a reference for the tests.

``fuse_gemm_bias_gelu`` (rule ``gemm_bias_gelu``; opt-in: ``MPGRAPH_GEMM_GELU=1``) then folds
the tanh GELU after GPT-2's fc layer into the same matmul (cuBLASLt's GELU_AUX_BIAS)::

    GemmBias(A, B, C) -> P;  X = Reshape(P, s);  G = Gelu(X, approximate="tanh")
    ==>  GemmBiasGelu(A, B, C) -> (G2, P);  X = Reshape(P, s);  G = Reshape(G2, s)

P, the GELU's input, is still made (as the epilogue's aux output) because the GELU's backward
(``TanhGeluGrad`` or the rule's ops) reads X: the backward is unchanged, the gradient at the same
stored pre-activation. The forward is approximate: GELU of the float32 sum before its one
rounding, where ORT's Gelu takes the rounded P; they differ by about GELU' x half an ulp of P.
It saves ORT's ``FastGeluKernel`` (1.10 ms of GPT-2 small's bf16 step, 12 launches) and one
read of P. Opt-in until an H200 run has measured it and checked the loss.

``MPGRAPH_GEMM_BIAS=ort`` in the environment turns both rules off (every Gemm, MatMul and Add
stays ORT's): the switch for an A/B of a whole training step, as ``MPGRAPH_FP8_GEMM=ort`` is
for ``fp8_gemm``. On CUDA both rules run by default (given a library with cuBLASLt) and take
only linears whose leading dimensions are multiples of 8 (``aligned_only``), where cuBLASLt has
the bias epilogue; real models' linears all are. Measured on the H200 at 0cc756a
(``benchmarks/results/*_gemm_bias_cublaslt_2026-12-03T10.log`` against the same tree without
it): GPT-2 small's bf16 step 25.57 -> 23.27 ms (TorchScript export) and 25.70 -> 23.35
(dynamo), BERT-base's 17.17 -> 16.72 (dynamo), BERT's loss after 50 steps within 0.1% of torch
eager AMP's (GPT-2's 50-step loss is chaotic, ``docs/performance.md``);
``tests/test_gpu_gemm_bias.py`` passed every aligned shape in both types and transpositions. ``MPGRAPH_GEMM_BIAS=cublaslt`` is still accepted (it is the default).

Unaligned shapes stay ORT's: there the CUDA op falls back to ORT's own arithmetic (bias
broadcast into Y, then beta = 1), which on the H200 landed up to 7 ulps from the once-rounded
sum at [37, 21] x [21, 50] in bfloat16 (1dd2f08), and ``GemmBiasGelu``'s unaligned path (GemmBias
into the aux, then the GELU kernel) 60 bounds off in both types (0cc756a): so the CUDA rules,
``gemm_bias_gelu``'s too, never make either.

Left alone: float32 Gemms (their TF32 or strict choice is ORT's), beta other than 1, a C that
is a full [M, N] matrix or a column. The tanh GELU after GPT-2's fc GEMM (ORT's
``FastGeluKernel``, 1.10 ms of the same step) is folded into ``CUBLASLT_EPILOGUE_GELU_AUX_BIAS``
only when asked for (``gemm_bias_gelu`` above): that epilogue applies GELU to the float32 sum
before rounding, while the backward (``TanhGeluGrad``) reads the rounded pre-activation it stores
as aux, another rounding than the graph's, not yet timed nor loss-checked on a GPU.
"""

from __future__ import annotations

import logging
import os

import onnx_ir as ir

from mpgraph.lowering.match import DOMAIN, hand_over, is_op, readers, replace, single_reader

__all__ = ["fuse_gemm_bias", "fuse_gemm_bias_gelu", "fuse_matmul_bias", "gemm_bias_on_cuda"]

_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

logger = logging.getLogger(__name__)


def gemm_bias_on_cuda() -> bool:
    """Whether ``gemm_bias`` and ``matmul_bias`` run on CUDA (given a library with cuBLASLt):
    yes unless ``MPGRAPH_GEMM_BIAS=ort`` turns them off."""
    return os.environ.get("MPGRAPH_GEMM_BIAS", "") != "ort"


def _switched_off() -> bool:
    if os.environ.get("MPGRAPH_GEMM_BIAS", "") != "ort":
        return False
    logger.info("gemm_bias/matmul_bias off: MPGRAPH_GEMM_BIAS=ort")
    return True


def _dim(value: ir.Value, axis: int) -> int | str | None:
    if value.shape is None or len(value.shape) != 2:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else (dim.value if dim.value is not None else None)


def _is_row(bias: ir.Value, n: int | str | None, rank: int = 2) -> bool:
    """``bias`` is [N] or [1, ..., 1, N] of at most ``rank`` dims, with N known to equal ``n``
    (the product's columns)."""
    if bias.shape is None or not 1 <= len(bias.shape) <= rank or n is None:
        return False
    dims = list(bias.shape)
    last = dims[-1] if isinstance(dims[-1], int) else dims[-1].value
    return last == n and all(d == 1 for d in dims[:-1])


def _matches(gemm: ir.Node) -> bool:
    if not is_op(gemm, "Gemm") or len(gemm.inputs) != 3 or any(v is None for v in gemm.inputs):
        return False
    a, b, c = gemm.inputs
    if a.dtype not in _LOW or {b.dtype, c.dtype, gemm.outputs[0].dtype} != {a.dtype}:  # type: ignore[union-attr]
        return False
    if gemm.attributes.get_float("beta", 1.0) != 1.0:
        return False
    n = _dim(b, 0 if gemm.attributes.get_int("transB", 0) else 1)  # type: ignore[arg-type]
    return _is_row(c, n)  # type: ignore[arg-type]


def _aligned(*values: ir.Value) -> bool:
    """Each value's last dimension (a stored matrix's leading dimension) is known and a multiple
    of 8 elements, 16 bytes: where cuBLASLt has bias-epilogue algorithms."""
    for value in values:
        dim = value.shape[-1] if value.shape is not None and len(value.shape) else None
        if not isinstance(dim, int) or dim % 8:
            return False
    return True


def fuse_gemm_bias(model: ir.Model, *, aligned_only: bool = False) -> int:
    """Rewrite every matching ``Gemm`` of ``model``'s main graph as ``GemmBias``, in place; how
    many were rewritten. ``aligned_only`` (the CUDA rule): only where A's, B's and Y's leading
    dimensions are multiples of 8, since elsewhere the CUDA op falls back to ORT's own arithmetic
    (the bias broadcast into Y, then beta = 1), which gains nothing and rounds as ORT's Gemm does,
    not once (the odd shape of ``tests/test_gpu_gemm_bias.py`` failed there on the H200)."""
    if _switched_off():
        return 0
    graph = model.graph
    fused = 0
    for gemm in [n for n in graph if _matches(n)]:
        if aligned_only and not _aligned(gemm.inputs[0], gemm.inputs[1], gemm.outputs[0]):
            continue
        attrs = [ir.AttrInt64("transA", gemm.attributes.get_int("transA", 0)), ir.AttrInt64("transB", gemm.attributes.get_int("transB", 0)),
                 ir.AttrFloat32("alpha", gemm.attributes.get_float("alpha", 1.0))]
        node = ir.Node(DOMAIN, "GemmBias", list(gemm.inputs), attrs, name=f"{gemm.name}/GemmBias",
                       metadata_props=dict(gemm.metadata_props))
        replace(graph, [gemm], node, (gemm.outputs[0],), before=gemm)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused


def _product(add: ir.Node, outputs: set[ir.Value]) -> tuple[ir.Node, ir.Value] | None:
    """The ``MatMul``/``FusedMatMul`` whose product ``add`` alone reads and whose columns
    ``add``'s other input is a bias row of, with that bias."""
    for slot in (0, 1):
        y, bias = add.inputs[slot], add.inputs[1 - slot]
        node = y.producer() if y is not None else None
        fused = node is not None and node.op_type == "FusedMatMul" and node.domain == "com.microsoft"
        if node is None or bias is None or not (is_op(node, "MatMul") or fused) or single_reader(y, outputs) is not add:
            continue
        a, b = node.inputs[0], node.inputs[1]
        if a is None or b is None or a.shape is None or len(a.shape) < 2 or b.shape is None or len(b.shape) != 2:
            continue
        if fused and any(node.attributes.get_int(key, 0) for key in ("transA", "transBatchA", "transBatchB")):
            continue
        if a.dtype not in _LOW or {b.dtype, y.dtype, bias.dtype, add.outputs[0].dtype} != {a.dtype}:
            continue
        if _is_row(bias, _dim(b, 0 if node.attributes.get_int("transB", 0) else 1), len(a.shape)):
            return node, bias
    return None


def fuse_matmul_bias(model: ir.Model, *, aligned_only: bool = False) -> int:
    """Rewrite every float16/bfloat16 ``Add`` of a bias row to a matmul's product, in
    ``model``'s main graph, as one ``GemmBias``, in place; how many were rewritten
    (``aligned_only``: as ``fuse_gemm_bias``'s)."""
    if _switched_off():
        return 0
    graph = model.graph
    outputs = set(graph.outputs)
    fused = 0
    for add in [n for n in graph if is_op(n, "Add")]:
        found = _product(add, outputs) if add.graph is not None else None
        if found is None:
            continue
        matmul, bias = found
        if aligned_only and not _aligned(matmul.inputs[0], matmul.inputs[1], add.outputs[0]):
            continue
        attrs = [ir.AttrInt64("transA", 0), ir.AttrInt64("transB", matmul.attributes.get_int("transB", 0)),
                 ir.AttrFloat32("alpha", matmul.attributes.get_float("alpha", 1.0))]
        node = ir.Node(DOMAIN, "GemmBias", [matmul.inputs[0], matmul.inputs[1], bias], attrs,
                       name=f"{matmul.name}/GemmBias", metadata_props=dict(matmul.metadata_props))
        replace(graph, [add, matmul], node, (add.outputs[0],), before=add)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused


def _tanh_gelu_after(gemm: ir.Node, outputs: set[ir.Value]) -> tuple[ir.Node | None, ir.Node] | None:
    """(the Reshape between, or None; the tanh ``Gelu``) reading ``gemm``'s output: through a
    Reshape that is its one reader (GPT-2's plans), or directly (other readers, such as the
    GELU's backward, then read the aux output)."""
    y = gemm.outputs[0]
    found = readers(y, outputs)
    if found is None:
        return None
    reshape = found[0] if len(found) == 1 and is_op(found[0], "Reshape") else None
    x = reshape.outputs[0] if reshape is not None else y
    gelus = list({id(u.node): u.node for u in x.uses() if is_op(u.node, "Gelu")}.values())
    if len(gelus) != 1:
        return None
    attr = gelus[0].attributes.get("approximate")
    return (reshape, gelus[0]) if attr is not None and attr.value == "tanh" else None


def _copied(node: ir.Node) -> list[ir.Attr]:
    return [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]


def fuse_gemm_bias_gelu(model: ir.Model, *, aligned_only: bool = False) -> int:
    """With ``MPGRAPH_GEMM_GELU=1``: rewrite every ``GemmBias`` whose output (through one
    Reshape) a tanh ``Gelu`` reads as ``GemmBiasGelu``, in place; how many were rewritten.
    ``aligned_only`` (the CUDA rule): only where A's, B's and the output's leading dimensions are
    multiples of 8, where cuBLASLt has the GELU_AUX_BIAS epilogue."""
    if os.environ.get("MPGRAPH_GEMM_GELU", "") != "1" or _switched_off():
        return 0
    graph = model.graph
    outputs = set(graph.outputs)
    fused = 0
    for gemm in [n for n in graph if n.op_type == "GemmBias" and n.domain == DOMAIN]:
        found = _tanh_gelu_after(gemm, outputs) if gemm.graph is not None else None
        if found is None or (aligned_only and not _aligned(gemm.inputs[0], gemm.inputs[1], gemm.outputs[0])):
            continue
        reshape, gelu = found
        node = ir.Node(DOMAIN, "GemmBiasGelu", list(gemm.inputs), _copied(gemm), num_outputs=2,
                       name=f"{gemm.name}/Gelu", metadata_props=dict(gemm.metadata_props))
        graph.insert_before(gemm, node)
        act, pre = node.outputs
        act.name, act.dtype, act.shape = f"{node.name}/output_0", gemm.outputs[0].dtype, gemm.outputs[0].shape
        hand_over([gemm.outputs[0]], [pre])
        if reshape is not None:
            view = ir.Node("", "Reshape", [act, reshape.inputs[1]], _copied(reshape),
                           name=f"{node.name}/Reshape", metadata_props=dict(reshape.metadata_props))
            graph.insert_before(gelu, view)
            act = view.outputs[0]
        hand_over([gelu.outputs[0]], [act])
        graph.remove([gelu, gemm], safe=True)
        fused += 1
    return fused
