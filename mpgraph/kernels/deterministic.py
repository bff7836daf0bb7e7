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
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph.kernels.fuse import _hand_over, _initializer

__all__ = ["one_hot_scatter"]


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


def _rewrite(graph: ir.Graph, node: ir.Node) -> None:
    data, indices, updates = node.inputs
    name = node.name or "scatter"
    batch_dims = len(indices.shape) - 1
    nodes = [
        ir.Node("", "Reshape", [indices, _initializer(graph, f"{name}/flat_shape", np.array([-1], np.int64))], name=f"{name}/indices"),
        ir.Node("", "Flatten", [updates], attributes=[ir.AttrInt64("axis", batch_dims)], name=f"{name}/updates"),
    ]
    flat, rows = (n.outputs[0] for n in nodes)
    dims = list(data.shape) if data.shape is not None else None
    if dims is not None and all(isinstance(d, int) for d in dims):  # a parameter's gradient: static
        depth = _initializer(graph, f"{name}/depth", np.array(dims[:1], np.int64))
        shape = _initializer(graph, f"{name}/shape", np.array(dims, np.int64))
    else:
        sizes = [ir.Node("", "Shape", [data], attributes=[ir.AttrInt64("start", 0), ir.AttrInt64("end", 1)], name=f"{name}/depth"),
                 ir.Node("", "Shape", [data], name=f"{name}/shape")]
        nodes += sizes
        depth, shape = (n.outputs[0] for n in sizes)
    one_hot = ir.Node("", "OneHot", [flat, depth, _initializer(graph, f"{name}/off_on", np.array([0, 1], np.float32))],
                      attributes=[ir.AttrInt64("axis", -1)], name=f"{name}/one_hot")
    gemm = ir.Node("", "Gemm", [one_hot.outputs[0], rows], attributes=[ir.AttrInt64("transA", 1)], name=f"{name}/gemm")
    out = ir.Node("", "Reshape", [gemm.outputs[0], shape], name=f"{name}/reshape")
    nodes += [one_hot, gemm, out]
    if not _zeros(data):
        nodes.append(ir.Node("", "Add", [data, out.outputs[0]], name=f"{name}/add"))
    for new in nodes:
        graph.insert_before(node, new)
    _hand_over(node.outputs, nodes[-1].outputs)
    graph.remove(node, safe=True)


def one_hot_scatter(model: ir.Model) -> int:
    """Rewrite every eligible scatter-add of ``model``'s graph as a one-hot ``Gemm`` (see the
    module docstring); return how many were rewritten."""
    found = [node for node in model.graph if _eligible(node)]
    for node in found:
        _rewrite(model.graph, node)
    return len(found)
