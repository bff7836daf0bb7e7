"""The backward recomputes a fused SwiGLU's outputs instead of keeping them (``recompute``).

A Llama MLP's forward ``SwiGlu(a, b) -> (y, s)`` (``fuse_swiglu``) writes two tensors the
backward reads much later: ``y = silu(a) * b`` for the down projection's weight gradient and
``s = Sigmoid(a)`` for ``SwiGluGrad(dy, a, b, s)``. Both live from the layer's forward to its
backward, next to ``a`` and ``b``, which the backward reads anyway. A Llama-style 125M, batch 8,
T 1024, bf16: 12 layers x 2 x 32 MiB = 768 MiB of the 2.96 GiB kept for the backward, all live
at the step's transient peak (``benchmarks/plan_memory.py``).

The rule gives the backward its own ``SwiGlu(a, b)``, one elementwise pass over what is live
then anyway, and moves every backward reader of y and s onto it::

    forward:  (y, s) = SwiGlu(a, b);  z = down(y)            s: read by nothing, freed at once
    backward: (y', s') = SwiGlu(a, b);  dW = y'^T dz;  (da, db) = SwiGluGrad(dy, a, b, s')

The kernel computes each element from a and b alone, so y' and s' have the bits of y and s:
``bit-identical``. ORT's common-subexpression elimination merges equal nodes of the ONNX
domain, not a custom domain's (``optimizer_utils::IsOperationDeterministic``): the library's
SwiGlu copy stays. Its price: one more pass over ``[B, T, I]`` per layer (read a and b, write
y' and s': 128 MiB at the size above, about 0.05 ms on an H200).

Left as they are: a SwiGlu whose inputs the backward does not read (recomputing would keep
them alive instead), one whose outputs no backward node reads, and one that is a graph output.
"""

from __future__ import annotations

import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.lowering.match import DOMAIN

__all__ = ["recompute_swiglu"]


def _backward(node: ir.Node) -> bool:
    return node.metadata_props.get(NODE_ROLE) == Role.BACKWARD


def _read_by_backward(value: ir.Value) -> bool:
    return any(_backward(u.node) for u in value.uses())


def _qualifies(node: ir.Node) -> bool:
    if node.domain != DOMAIN or node.op_type != "SwiGlu" or _backward(node):
        return False
    if any(v is None or not _read_by_backward(v) for v in node.inputs):
        return False
    if any(v.is_graph_output() for v in node.outputs):
        return False
    return any(_read_by_backward(v) for v in node.outputs)


def _recompute(graph: ir.Graph, node: ir.Node) -> None:
    meta = dict(node.metadata_props)
    meta[NODE_ROLE] = str(Role.BACKWARD)
    copy = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                   num_outputs=len(node.outputs), name=f"{node.name}/recompute", metadata_props=meta)
    readers = []
    for old, new in zip(node.outputs, copy.outputs, strict=True):
        new.name = f"{old.name}/recompute"
        new.dtype, new.shape = old.dtype, old.shape
        for use in list(old.uses()):
            if _backward(use.node):
                use.node.replace_input_with(use.idx, new)
                readers.append(use.node)
    # Before the first backward reader in the list (its inputs are made before ``node``'s
    # readers); ORT's order and ``free_early`` then run it where the backward needs it.
    position = {n: i for i, n in enumerate(graph)}
    graph.insert_before(min(readers, key=position.__getitem__), copy)


def recompute_swiglu(model: ir.Model) -> int:
    """Give every qualifying forward ``SwiGlu`` of ``model``'s main graph a backward copy (see
    the module), in place; how many."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if _qualifies(n)]:
        _recompute(graph, node)
        done += 1
    return done
