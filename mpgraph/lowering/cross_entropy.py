"""Fuse a language-model loss head into ``SoftmaxCrossEntropyRows`` and its backward (a session lowering).

A causal or masked LM's loss is ``SoftmaxCrossEntropyLoss`` over every token's logits. The
policy keeps the loss float32 and the vocabulary GEMM low, and ``PadGemmColumnsPass`` pads the
GEMM's columns, so HF GPT-2's bf16 step on CUDA (batch 8, T 1024, 50257 columns padded to
50304) carries this chain::

    forward   L = MatMul(h, W) [8,1024,50304] bf16 -> Slice (a copy) -> Reshape [8192,50257]
              -> Cast float32 (1.65 GB) -> SoftmaxCrossEntropyLoss -> loss, log_prob float32 (kept)
    backward  (Exp(log_prob) - OneHot) * scale [8192,50257] float32 -> Reshape -> Pad to 50304
              (float32, 1.65 GB) -> Cast bf16 -> the two lm_head gradient GEMMs

about 17 GB of memory traffic a step (~5.5 ms of 34.5 on an H200) and the float32 log_prob held
from the forward to the backward. The rule makes it::

    SoftmaxCrossEntropyRows(L, labels) -> (loss, stats [rows, 2], count)
    SoftmaxCrossEntropyRowsGrad(L, labels, stats, count, dloss) -> dL  (L's dtype and padded shape)

which read the low-precision logits once each (one block a row, float32 max and sum of exp)
and write dL once, zero in the padding columns: the Slice, the float32 Cast, log_prob, the
float32 gradient, its Reshape and Pad and the Cast back all go.

The match is by value, never by the nodes a rule emitted:

1. a canonical ``SoftmaxCrossEntropyLoss`` (float32 logits ``X`` [rows, C], labels [rows], no
   class weights, reduction mean/sum/none) whose gradient block records ``dloss`` into the loss
   and ``dX`` (and no gradient into log_prob); where loss scaling rewired every reader of the
   seed to ``seed * loss_scale`` after autodiff recorded it, the kernel reads that product;
2. walking back from ``X`` through at most one each of: a ``Cast`` to float32 (the policy's),
   a ``Reshape`` merging the leading axes of ``[..., C]``, and a ``Slice`` of the first ``C``
   columns of the last axis (the padded GEMM's); each step's own gradient block must carry the
   previous step's gradient (``dys[0]``), so the chain's backward is these nodes' gradients
   only, and its last ``dxs[0]`` is ``L``'s gradient from the loss;
3. nothing else reads the chain's values (or log_prob) than the chain and the backward that
   goes (``match.interior``);
4. that gradient, read through one ``Cast`` to ``L``'s dtype where the policy wrote it float32,
   is what the fused backward replaces (``match.swap_backward``).

Numerics (``same math``): the kernels compute the unfused ops' terms in float32,
``log_prob = (x - max) - log(sum exp(x - max))``, ``loss = -log_prob[label]`` summed and divided
by the kept rows' count, ``d = (exp(log_prob) - onehot) * scale`` with ``scale`` as the gradient
rule computes it (``dloss / count`` times the kept mask), and round d to ``L``'s dtype once, as
the unfused Cast does; only the order of the sums over columns and rows differs.

Left as they are: class weights (a third input), logits of rank > 2 (``[N, C, d...]``), a
float16/bfloat16 loss (the kernels compute float32), an emulated low-precision chain
(``match.emulated``), a loss whose log_prob is read or differentiated, any other node between
the GEMM and the loss (a user's scale or softcap), and on CPU logits other than float32 (the
CPU kernels are float32 reference loops, scope ``all``). BERT's masked-LM head adds its
decoder's bias after the padded GEMM (30522 columns padded to 30528): ``PadGemmColumnsPass``
pads the bias and slices after the ``Add``, so the chain is the float32 sum [..., 30528], the
Slice and a Reshape, and the kernels read that sum in place (L float32). Llama's dynamo export
writes ``Reshape`` then the policy's ``Cast``, without a Slice.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from mpgraph._ir.links import GradientBlock, gradient_blocks
from mpgraph._ir.meta import NODE_GRAD_INPUTS, NODE_GRAD_OUTPUTS
from mpgraph.lowering.match import (
    DOMAIN,
    constant,
    consts,
    emulated,
    hand_over,
    interior,
    is_op,
    is_scalar,
    remove_dead,
    swap_backward,
)

__all__ = ["fuse_cross_entropy"]

logger = logging.getLogger(__name__)

_LOW = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: The kernels' ``reduction`` attribute.
_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


def _columns_slice(node: ir.Node, columns: int) -> int | None:
    """The input's column count when ``node`` slices the first ``columns`` of its last axis."""
    x = node.inputs[0]
    if x is None or x.shape is None or not isinstance(x.shape[-1], int) or len(node.inputs) < 3:
        return None
    rank = len(x.shape)
    starts, ends = consts(node.inputs[1]), consts(node.inputs[2])
    axes = consts(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else list(range(rank))
    steps = consts(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if starts != [0] or ends != [columns] or axes is None or len(axes) != 1 or axes[0] % rank != rank - 1 or steps != [1]:
        return None
    return x.shape[-1] if x.shape[-1] >= columns else None


def _merges_rows(node: ir.Node, columns: int) -> bool:
    """``node`` reshapes ``[..., C]`` to ``[rows, C]`` (the leading axes merged in order)."""
    x, y = node.inputs[0], node.outputs[0]
    return (x is not None and x.shape is not None and y.shape is not None and len(y.shape) == 2
            and x.shape[-1] == columns == y.shape[-1])


def _walk(x: ir.Value, dx: ir.Value, columns: int, blocks: dict[ir.Node, GradientBlock]) -> tuple | None:
    """``(L, its gradient from the loss, padded columns, chain nodes)`` back from the loss's
    logits ``x`` (gradient ``dx``): Cast, Reshape and Slice, at most one each."""
    value, grad, cols, chain = x, dx, columns, []
    while True:
        node = value.producer()
        if is_op(node, "Cast") and "Cast" not in [n.op_type for n in chain]:
            source = node.inputs[0]
            if source is None or source.dtype not in _LOW:
                return None
        elif is_op(node, "Reshape") and "Reshape" not in [n.op_type for n in chain] and _merges_rows(node, columns):
            pass
        elif is_op(node, "Slice") and "Slice" not in [n.op_type for n in chain]:
            wide = _columns_slice(node, columns)
            if wide is None:
                return None
            cols = wide
        else:
            break
        block = blocks.get(node)
        if block is not None:  # a recorded gradient: it must be the one flowing from the loss
            if not block.dys or block.dys[0] is not grad or not block.dxs or block.dxs[0] is None:
                return None
            grad = block.dxs[0]
        elif node.op_type != "Cast":  # a Cast the policy inserted after differentiating has none
            return None
        chain.append(node)
        value = node.inputs[0]
    return value, grad, cols, chain


def _old_gradient(grad: ir.Value, dtype: ir.DataType, outputs: set[ir.Value]) -> ir.Value:
    """The value the fused backward takes over: ``grad``, or its one ``Cast`` to ``dtype``
    (the policy's, where it wrote the gradient in float32) so that no Cast pair is left."""
    if grad.dtype == dtype or grad in outputs:
        return grad
    readers = {id(u.node): u.node for u in grad.uses()}
    casts = [n for n in readers.values() if is_op(n, "Cast") and n.attributes.get_int("to", 0) == dtype.value]
    return casts[0].outputs[0] if len(readers) == 1 and len(casts) == 1 else grad


def _incoming(dloss: ir.Value) -> ir.Value:
    """The loss's incoming gradient as the backward reads it: the recorded ``dloss``, or the
    product that took its place for all its readers, ``Mul(dloss, s)`` by a constant or graph
    input scalar ``s`` (``ScaleLossPass``'s ``seed * loss_scale``, which autodiff's record
    predates)."""
    readers = {id(u.node): u.node for u in dloss.uses()}
    if len(readers) != 1 or dloss.is_graph_output():
        return dloss
    (node,) = readers.values()
    if not is_op(node, "Mul") or len(node.inputs) != 2 or node.inputs[0] is node.inputs[1]:
        return dloss
    other = node.inputs[1] if node.inputs[0] is dloss else node.inputs[0]
    out = node.outputs[0]
    fixed = other is not None and (other.producer() is None or constant(other) is not None)
    if not fixed or not is_scalar(other) or dloss.shape is None or len(other.shape) > len(dloss.shape):  # type: ignore[union-attr, arg-type]
        return dloss  # a scalar of no higher rank: the product has dloss's shape
    if out.dtype not in (None, dloss.dtype) or (out.shape is not None and list(out.shape) != list(dloss.shape)):
        return dloss
    return out


def _match(sce: ir.Node, blocks: dict[ir.Node, GradientBlock], provider: str, outputs: set[ir.Value]) -> tuple | None:
    block = blocks.get(sce)
    reduction = sce.attributes.get_string("reduction", "mean")
    if block is None or reduction not in _REDUCTIONS or (len(sce.inputs) > 2 and sce.inputs[2] is not None):
        return None
    x, labels = sce.inputs[0], sce.inputs[1]
    if x is None or labels is None or x.dtype != ir.DataType.FLOAT or x.shape is None or len(x.shape) != 2 \
            or not isinstance(x.shape[1], int) or labels.dtype != ir.DataType.INT64:
        return None
    dloss = block.dys[0] if block.dys else None
    dx = block.dxs[0] if block.dxs else None
    if dloss is None or dx is None or (len(block.dys) > 1 and block.dys[1] is not None):
        return None
    dloss = _incoming(dloss)
    walked = _walk(x, dx, x.shape[1], blocks)
    if walked is None:
        return None
    logits, grad, cols, chain = walked
    if logits.dtype not in _LOW or (provider == "cpu" and logits.dtype != ir.DataType.FLOAT) or logits.shape is None \
            or logits.shape[-1] != cols or emulated(logits, grad):
        return None
    old = _old_gradient(grad, logits.dtype, outputs)  # type: ignore[arg-type]
    dying = interior([old], [dloss, labels, logits, *sce.outputs, *(v for n in chain for v in n.outputs)])
    dying |= {sce, *chain}
    held = [v for n in chain for v in n.outputs] + [sce.outputs[1]]
    if any(v in outputs or any(u.node not in dying for u in v.uses()) for v in held):
        return None
    return logits, labels, dloss, dx, old, x.shape[1], chain, reduction


def _fuse(graph: ir.Graph, sce: ir.Node, found: tuple) -> bool:
    logits, labels, dloss, dx, old, columns, chain, reduction = found
    attrs = {"valid_cols": columns, "reduction": _REDUCTIONS[reduction]}
    ignore = sce.attributes.get("ignore_index")
    if ignore is not None:
        attrs["ignore_index"] = ignore.as_int()
    meta = {k: v for k, v in sce.metadata_props.items() if k not in (NODE_GRAD_INPUTS, NODE_GRAD_OUTPUTS)}
    forward = ir.node("SoftmaxCrossEntropyRows", [logits, labels], attrs, domain=DOMAIN, num_outputs=3,
                      name=f"{sce.name}/SoftmaxCrossEntropyRows", metadata_props=meta)
    loss, stats, count = forward.outputs
    rows = sce.inputs[0].shape[0]  # type: ignore[union-attr]
    loss.dtype, loss.shape = ir.DataType.FLOAT, sce.outputs[0].shape
    stats.name, stats.dtype, stats.shape = f"{forward.name}/stats", ir.DataType.FLOAT, ir.Shape([rows, 2])
    count.name, count.dtype, count.shape = f"{forward.name}/count", ir.DataType.FLOAT, ir.Shape([])
    loss.name = f"{forward.name}/loss"
    graph.insert_before(sce, forward)
    # The gradient rule's node that made dx stands for the backward (role, link to the loss).
    back_meta = dict(dx.producer().metadata_props) if dx.producer() is not None else {}
    backward = ir.node("SoftmaxCrossEntropyRowsGrad", [logits, labels, stats, count, dloss], attrs, domain=DOMAIN,
                       name=f"{sce.name}/SoftmaxCrossEntropyRowsGrad", metadata_props=back_meta)
    backward.outputs[0].dtype, backward.outputs[0].shape = logits.dtype, logits.shape
    if not swap_backward(graph, backward, [old]):
        graph.remove(forward, safe=True)
        return False
    backward.outputs[0].shape = logits.shape  # known where the old gradient's was not
    hand_over([sce.outputs[0]], [loss])
    remove_dead(graph, {sce, *chain})
    return True


def fuse_cross_entropy(model: ir.Model, provider: str) -> int:
    """Fuse every matching ``SoftmaxCrossEntropyLoss`` head of ``model``'s main graph and its
    backward, in place; how many ``SoftmaxCrossEntropyRows`` pairs were made."""
    graph = model.graph
    outputs = set(graph.outputs)
    blocks = gradient_blocks(graph)
    fused = 0
    for sce in [n for n in graph if is_op(n, "SoftmaxCrossEntropyLoss")]:
        found = _match(sce, blocks, provider, outputs)
        if found is None:
            logger.debug("%s: loss head left as it is", sce.name)
            continue
        if _fuse(graph, sce, found):
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused
