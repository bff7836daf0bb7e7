"""The backward recomputes a SwiGLU's or a GELU's outputs instead of keeping them (``recompute``).

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

A BERT MLP's ``Gelu(x)`` is the same case: the backward keeps x for the GELU's gradient and
the output for the next linear layer's weight gradient, which reads it through a ``Flatten``
(BERT-base, batch 8, T 512: 12 x 24 MiB bfloat16). ``Gelu`` is an ONNX op, and ORT's
common-subexpression elimination would merge a second ``Gelu(x)`` back into the forward's, so
the copy reads the view instead: ``Flatten(Gelu(x))`` becomes ``Gelu(Flatten(x))``, the same
elements (the op is elementwise, the view moves no element), an input no other node has::

    forward:  g = Gelu(x);  z = up(g)
    backward: g2 = Gelu(Flatten(x));  dW = g2^T dz;  dx = ErfGeluGrad(dg, x)

The GELU case is opt-in (``MPGRAPH_RECOMPUTE_GELU=1``, ``recompute_gelu_on``) until an H200 run
has timed it: on GPT-2 (tanh GELU, which ORT runs as ``FastGelu``) the forward's 12 GELU passes
take 1.11 ms of a 25.96 ms step that is 1.01x torch.compile's, while its peak memory is already
0.87x; a second pass would cost about as much again where nothing needs the bytes. BERT's
modelled peak is 2.45 GiB without it, 2.17 with it (``plan_memory_bert_dynamo_2026-12-03T08``).

Left as they are: a node whose inputs the backward does not read (recomputing would keep them
alive instead), one whose outputs no backward node reads, one that is a graph output, and a
Gelu read by a backward node other than a ``Flatten`` or ``Reshape`` (or whose view of x some
node already computes: the two would merge).
"""

from __future__ import annotations

import os

import onnx_ir as ir

from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.lowering.match import DOMAIN, hand_over, is_op

__all__ = ["recompute_gelu", "recompute_gelu_on", "recompute_swiglu"]


def _backward(node: ir.Node) -> bool:
    return node.metadata_props.get(NODE_ROLE) == Role.BACKWARD


def _read_by_backward(value: ir.Value) -> bool:
    return any(_backward(u.node) for u in value.uses())


def _qualifies(node: ir.Node, domain: str, op_type: str) -> bool:
    if node.domain != domain or node.op_type != op_type or _backward(node):
        return False
    if any(v is None or not _read_by_backward(v) for v in node.inputs):
        return False
    if any(v.is_graph_output() for v in node.outputs):
        return False
    return any(_read_by_backward(v) for v in node.outputs)


def _backward_meta(node: ir.Node) -> dict[str, str]:
    """``node``'s metadata, its role made the backward's (a copy the backward runs)."""
    return {**node.metadata_props, NODE_ROLE: str(Role.BACKWARD)}


def _recompute(graph: ir.Graph, node: ir.Node) -> None:
    copy = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                   num_outputs=len(node.outputs), name=f"{node.name}/recompute", metadata_props=_backward_meta(node))
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
    for node in [n for n in graph if _qualifies(n, DOMAIN, "SwiGlu")]:
        _recompute(graph, node)
        done += 1
    return done


_VIEWS = ("Flatten", "Reshape")


def _gelu_views(node: ir.Node) -> list[ir.Node] | None:
    """The backward views of a qualifying Gelu's output, or ``None``."""
    uses = [u for u in node.outputs[0].uses() if _backward(u.node)]
    if any(not any(is_op(u.node, view) for view in _VIEWS) or u.idx != 0 for u in uses):
        return None
    views = [u.node for u in uses]
    x = node.inputs[0]
    for view in views:  # an equal view of x already made would be merged with the copy's
        if any(u.node.op_type == view.op_type and u.idx == 0 and list(u.node.inputs[1:]) == list(view.inputs[1:])
               and dict(u.node.attributes) == dict(view.attributes) for u in x.uses()):
            return None
    return views


def _recompute_through(graph: ir.Graph, gelu: ir.Node, view: ir.Node) -> None:
    x = gelu.inputs[0]
    moved = ir.Node(view.domain, view.op_type, [x, *view.inputs[1:]], attributes=list(view.attributes.values()),
                    name=f"{view.name}/of_input", metadata_props=dict(view.metadata_props))
    moved.outputs[0].name = f"{view.outputs[0].name}/of_input"
    moved.outputs[0].dtype, moved.outputs[0].shape = x.dtype, view.outputs[0].shape
    copy = ir.Node(gelu.domain, gelu.op_type, [moved.outputs[0]], attributes=list(gelu.attributes.values()),
                   name=f"{gelu.name}/recompute", metadata_props=_backward_meta(gelu))
    copy.outputs[0].name = f"{gelu.outputs[0].name}/recompute"
    copy.outputs[0].dtype, copy.outputs[0].shape = view.outputs[0].dtype, view.outputs[0].shape
    graph.insert_before(view, [moved, copy])
    hand_over((view.outputs[0],), (copy.outputs[0],))
    graph.remove(view, safe=True)


def recompute_gelu_on() -> bool:
    """Whether the ``recompute`` rule takes GELUs too: ``MPGRAPH_RECOMPUTE_GELU=1``."""
    return os.environ.get("MPGRAPH_RECOMPUTE_GELU", "") == "1"


def recompute_gelu(model: ir.Model) -> int:
    """Recompute every qualifying forward ``Gelu`` of ``model``'s main graph for its backward
    views (see the module), in place; how many."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if _qualifies(n, "", "Gelu")]:
        views = _gelu_views(node)
        if not views:
            continue
        for view in views:
            _recompute_through(graph, node, view)
        done += 1
    return done
