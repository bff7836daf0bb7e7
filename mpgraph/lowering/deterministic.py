"""A deterministic form of the scatter-add that an embedding's gradient is (a session lowering).

Two CUDA runs of the same step from the same state and batch should give the same bits. On the
H200 they did not (``benchmarks/repeat_probe.py --state-diff``,
``benchmarks/results/repeat_probe_state_diff.txt``):

- every bias gradient (a ``ReduceSum`` over the batch) differed after one step: ORT's CUDA
  reductions add with atomics unless the session sets ``use_deterministic_compute``;
- with it set, the bench GPT's token embedding still differed: its gradient is ``ScatterND``
  with ``reduction="add"`` (``mpgraph.autodiff``'s rule for ``Gather`` on axis 0), whose CUDA
  kernel adds the rows of repeated tokens with atomics;
- the DQN's convolution weights differed as well: cuDNN's exhaustive search times the
  algorithms in each session and can pick another one.

``one_hot_scatter`` rewrites each float32 ``ScatterND(data, indices [..., 1], updates,
reduction="add")`` into one matrix product, which cuBLAS sums in a fixed order::

    indices -> Reshape [N] -> OneHot(depth = data's dim 0) [N, V]
    updates -> Flatten [N, R]
    Gemm(one_hot, updates, transA=1) [V, R] -> Reshape to data's shape (-> Add data)

Each product is an update times 0 or 1, so the sums are of the same terms as the scatter's;
only their order differs. The price is an N x V float32 one-hot matrix (the bench GPT: 128 MiB;
a 50k vocabulary at 16k tokens a step would take 3.2 GB) and N*V*R multiply-adds in float32 (the bench GPT: 4,096
tokens, 8,192 rows of 1,024: 34 G; with the rest of ``Trainer(deterministic=True)`` its bf16
step went from 13.4 to 18.7 ms, and two runs gave the same bits after every step,
``benchmarks/results/repeat_probe_state_diff_deterministic.txt``). ``Trainer(deterministic=True)``
applies it to its session's graph and refuses TF32, which would round the updates to 10 bits.

Left alone: ``ScatterElements`` with ``reduction="add"`` (a MaxPool's gradient, a ``Gather``
on another axis), ``ScatterND`` over more than the first axis, and other dtypes.

``ones_matmul_sums`` does the same for the sums over leading axes that every bias gradient is.
With ``use_deterministic_compute`` ORT's CUDA ``ReduceSum`` leaves its own (atomic) kernels for
cuDNN's ``cudnnReduceTensor``, which is deterministic but slow: the bench GPT's 37 reduce
kernels (0.72 ms a bf16 step) became 107 cuDNN kernels (4.3 ms;
``benchmarks/results/gpu_step_2026-12-01T23_deterministic_gpt.log``). A sum over the leading ``k``
axes of ``x`` is a vector-matrix product, which cuBLAS computes in a fixed order::

    x -> Flatten(axis=k) [R, C];  ones = ConstantOfShape(Shape(flat)[:1], 1) [R] (-> Cast)
    MatMul(ones, flat) [C] -> Reshape to x's trailing dims (-> Unsqueeze if keepdims)

for float32 and bfloat16 (cuBLAS accumulates both in float32; float16 and other reductions
stay on cuDNN). The terms are the same, times 1, in another order. The bench GPT's
deterministic bf16 step: 14.57 ms and 658 kernels, against 18.84 ms and 774 with cuDNN's sums
and 13.67 ms for the default (nondeterministic) step
(``benchmarks/results/gpu_step_2026-12-01T23_deterministic_gpt_sums.log``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import hand_over

__all__ = ["one_hot_scatter", "ones_matmul_sums"]


def _zeros(value: ir.Value) -> bool:
    """``value`` is a ``ConstantOfShape`` of zero (what ``mpgraph.autodiff`` scatters into)."""
    producer = value.producer()
    if producer is None or producer.op_type != "ConstantOfShape":
        return False
    attr = producer.attributes.get("value")
    return attr is None or not np.asarray(attr.as_tensor().numpy()).any()


def _eligible(node: ir.Node) -> bool:
    if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx"):
        return False
    reduction = node.attributes.get("reduction")
    if reduction is None or reduction.as_string() != "add":
        return False
    data, indices, updates = node.inputs
    shape = indices.shape if indices is not None else None
    dtype = (data.dtype if data is not None else None) or (updates.dtype if updates is not None else None)
    return data is not None and dtype == ir.DataType.FLOAT and shape is not None and len(shape) >= 1 and shape[-1] == 1


def _rewrite(graph: ir.Graph, node: ir.Node, names: NameScope) -> None:
    data, indices, updates = node.inputs
    rw = Rewrite(graph, node.name or "scatter", names=names)
    flat = rw.node("Reshape", indices, rw.constant("flat_shape", np.array([-1], np.int64)), name="indices").outputs[0]
    rows = rw.node("Flatten", updates, axis=len(indices.shape) - 1, name="updates").outputs[0]
    dims = list(data.shape) if data.shape is not None else None
    if dims is not None and all(isinstance(d, int) for d in dims):  # a parameter's gradient: static
        depth = rw.constant("depth", np.array(dims[:1], np.int64))
        shape = rw.constant("shape", np.array(dims, np.int64))
    else:
        depth = rw.node("Shape", data, start=0, end=1, name="depth").outputs[0]
        shape = rw.node("Shape", data, name="shape").outputs[0]
    one_hot = rw.node("OneHot", flat, depth, rw.constant("off_on", np.array([0, 1], np.float32)), axis=-1, name="one_hot")
    gemm = rw.node("Gemm", one_hot.outputs[0], rows, transA=1, name="gemm")
    out = rw.node("Reshape", gemm.outputs[0], shape, name="reshape")
    if not _zeros(data):
        rw.node("Add", data, out.outputs[0], name="add")
    for new in rw.nodes:
        graph.insert_before(node, new)
    hand_over(node.outputs, rw.nodes[-1].outputs)
    graph.remove(node, safe=True)


def one_hot_scatter(model: ir.Model) -> int:
    """Rewrite every eligible scatter-add of ``model``'s graph as a one-hot ``Gemm`` (see the
    module docstring); return how many were rewritten."""
    found = [node for node in model.graph if _eligible(node)]
    names = NameScope(model.graph)
    for node in found:
        _rewrite(model.graph, node, names)
    return len(found)


_SUM_DTYPES = (ir.DataType.FLOAT, ir.DataType.BFLOAT16)


def _leading_axes(node: ir.Node) -> int | None:
    """How many leading axes a plain ``ReduceSum`` sums (``None``: another reduction)."""
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    x = node.inputs[0]
    if x is None or x.dtype not in _SUM_DTYPES or x.shape is None or len(x.shape) == 0:
        return None
    rank = len(x.shape)
    axes_in = node.inputs[1] if len(node.inputs) > 1 else None
    if axes_in is None:
        noop = node.attributes.get("noop_with_empty_axes")
        return None if noop is not None and noop.as_int() else rank
    if axes_in.const_value is None:
        return None
    axes = sorted(int(a) % rank for a in np.asarray(axes_in.const_value.numpy()).reshape(-1))
    if not axes:
        return None  # an empty axes input: all axes or none, by noop_with_empty_axes; left alone
    return len(axes) if axes == list(range(len(axes))) else None


def _sum_rewrite(graph: ir.Graph, node: ir.Node, k: int, names: NameScope) -> None:
    x = node.inputs[0]
    rw = Rewrite(graph, node.name or "reduce_sum", names=names)
    keep = node.attributes.get("keepdims")
    keepdims = keep is None or bool(keep.as_int())
    trailing = list(x.shape)[k:]
    flat = rw.node("Flatten", x, axis=k, name="flat").outputs[0]
    rows = rw.node("Shape", flat, start=0, end=1, name="rows").outputs[0]
    # float32 ones, cast for bfloat16: ConstantOfShape takes bfloat16 only from opset 20.
    ones = rw.node("ConstantOfShape", rows, value=ir.tensor([1.0], dtype=ir.DataType.FLOAT), name="ones").outputs[0]
    if x.dtype != ir.DataType.FLOAT:
        ones = rw.node("Cast", ones, to=x.dtype.value, name="ones_cast").outputs[0]
    summed = rw.node("MatMul", ones, flat, name="matmul").outputs[0]
    if all(isinstance(d, int) for d in trailing):
        shape = rw.constant("trailing", np.array(trailing, np.int64))
    else:
        shape = rw.node("Shape", x, start=k, name="trailing").outputs[0]
    out = rw.node("Reshape", summed, shape, name="reshape").outputs[0]
    if keepdims:
        rw.node("Unsqueeze", out, rw.constant("kept", np.arange(k, dtype=np.int64)), name="keepdims")
    for new in rw.nodes:
        graph.insert_before(node, new)
    hand_over(node.outputs, rw.nodes[-1].outputs)
    graph.remove(node, safe=True)


def ones_matmul_sums(model: ir.Model) -> int:
    """Rewrite every float32/bfloat16 ``ReduceSum`` over leading axes of ``model``'s graph as a
    ``MatMul`` with a vector of ones (see the module docstring); return how many were rewritten."""
    found = [(node, k) for node in model.graph if (k := _leading_axes(node)) is not None]
    names = NameScope(model.graph)
    for node, k in found:
        _sum_rewrite(model.graph, node, k, names)
    return len(found)
