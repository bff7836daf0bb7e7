"""The one matcher of the lowering rules: how a rule walks a graph and swaps nodes in.

Every rule under ``mpgraph/lowering/`` finds its pattern with these helpers and puts its fused
node in with ``replace`` (or ``hand_over``), so the questions "is this value read only by the
chain?" and "which op made this value?" have one answer. They speak onnx-ir only.

A rule that fuses a canonical op's backward does not match the nodes its gradient rule emitted:
it reads the op's gradient block (``mpgraph._ir.links.gradient_blocks``: the gradient flowing
into each output, the node's contribution to each input's gradient) and calls
``swap_backward`` with a fused node computing those contributions; the rule's nodes, read by
nothing then, go.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))
    >>> relu = ir.Node("", "Relu", [x])
    >>> producer(relu.outputs[0], "Relu") is relu, producer(relu.outputs[0], "Sigmoid")
    (True, None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import onnx_ir as ir

from mpgraph._ir.links import GradientBlock, ancestors, gradient_blocks
from mpgraph._ir.meta import NODE_PRECISION, PRECISION_OF_DTYPE, Precision
from mpgraph._ir.names import NameScope

__all__ = [
    "DOMAIN", "cast_to", "constant", "consts", "emulated", "fuse_muls", "hand_over", "initializer", "interior", "is_scalar",
    "link",
    "one_reader", "only_reader", "perm", "producer", "readers", "remove_dead", "replace", "same_dim", "same_shape",
    "scalar_constant", "single_reader", "swap_backward", "uses",
]

#: The custom-op domain of mpgraph's kernel library.
DOMAIN = "ai.mpgraph"


def is_op(node: ir.Node | None, op_type: str) -> bool:
    """``node`` is an ONNX-domain ``op_type`` node."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if is_op(node, op_type) else None


def op_blocks(graph: ir.Graph, op_type: str) -> Iterator[tuple[ir.Node, GradientBlock]]:
    """Each ONNX ``op_type`` node of ``graph`` itself (not a subgraph's) that records a gradient
    block, with the block, in graph order (read once: a rewrite of one does not move the rest)."""
    for node, block in gradient_blocks(graph).items():
        if is_op(node, op_type) and node.graph is graph:
            yield node, block


def only_reader(value: ir.Value, graph_outputs: set[ir.Value]) -> bool:
    return len(value.uses()) == 1 and value not in graph_outputs


def one_reader(value: ir.Value, outputs: set[ir.Value]) -> bool:
    """``value`` is read by one node (perhaps in several inputs) and is no graph output."""
    return value not in outputs and len({id(u.node) for u in value.uses()}) == 1


def link(value: ir.Value | None, op_type: str, outputs: set[ir.Value]) -> ir.Node | None:
    """``value``'s ``op_type`` producer when the chain is its one reader (``None`` otherwise)."""
    node = producer(value, op_type)
    return node if node is not None and only_reader(value, outputs) else None  # type: ignore[arg-type]


def is_scalar(value: ir.Value | None) -> bool:
    if value is None or value.dtype != ir.DataType.FLOAT or value.shape is None:
        return False
    return all(isinstance(d, int) and d == 1 for d in value.shape)


def same_shape(*values: ir.Value) -> bool:
    """Float32 values of one static shape, as far as shape inference knows: the first must be
    static, and the others agree with it wherever a dim is known (a gradient's dims are often
    symbolic). The kernel checks the sizes again at run time, so a wrong guess fails loudly."""
    if any(v.dtype != ir.DataType.FLOAT or v.shape is None for v in values):
        return False
    first = list(values[0].shape)  # type: ignore[arg-type]
    if not all(isinstance(d, int) for d in first):
        return False
    return all(
        len(v.shape) == len(first) and all(not isinstance(d, int) or d == f for d, f in zip(v.shape, first))  # type: ignore[arg-type]
        for v in values[1:]
    )


def same_dim(a: object, b: object) -> bool:
    """Two dims known to be equal: the same size, or the same named symbolic dim."""
    if isinstance(a, int):
        return a == b
    return isinstance(a, ir.SymbolicDim) and a.value is not None and a == b


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register ``array`` as an initializer of ``graph`` named ``name``; return its value."""
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     shape=ir.Shape(list(array.shape)), const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value


def hand_over(olds: list[ir.Value] | tuple[ir.Value, ...], news: list[ir.Value] | tuple[ir.Value, ...]) -> None:
    """Give each of ``olds`` (name, type, shape, readers, graph-output slot) to its twin in ``news``."""
    for old, new in zip(olds, news):
        new.shape, new.type = old.shape, old.type
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        name = old.name
        old.name = None
        new.name = name


def replace(graph: ir.Graph, chain: list[ir.Node], node: ir.Node, olds: tuple[ir.Value, ...], before: ir.Node) -> None:
    """Put ``node`` before ``before``, hand each of ``olds`` (name, readers, graph-output slot)
    to ``node``'s output of the same position, and remove ``chain``."""
    graph.insert_before(before, node)
    hand_over(olds, node.outputs)
    graph.remove(chain, safe=True)


def fuse_muls(model: ir.Model, match: Callable[[ir.Node, set[ir.Value]], tuple | None], op: str) -> int:
    """Replace every chain ``match`` finds ending at a ``Mul`` (``(inputs, nodes)``, the Mul
    first) with one ``op`` node that takes over the Mul's output; how many were made."""
    graph = model.graph
    outputs = set(graph.outputs)
    fused = 0
    for mul in [n for n in graph if n.op_type == "Mul" and n.domain in ("", "ai.onnx")]:
        found = match(mul, outputs) if mul.graph is not None else None
        if found is not None:
            inputs, nodes = found
            node = ir.Node(DOMAIN, op, inputs, name=f"{mul.name}/{op}", metadata_props=dict(mul.metadata_props))
            replace(graph, nodes, node, (mul.outputs[0],), before=mul)
            fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
    return fused


#: ``Constant``'s list and scalar attributes (shape specialisation writes ``value_ints``).
_CONSTANT_LISTS = {"value_ints": np.int64, "value_floats": np.float32, "value_int": np.int64, "value_float": np.float32}


def constant(value: ir.Value | None) -> np.ndarray | None:
    """``value``'s array when it is an initializer or a ``Constant``'s output (its ``value``
    tensor or one of its int/float list and scalar forms)."""
    if value is None:
        return None
    if value.const_value is not None:
        return np.asarray(value.const_value.numpy())
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
        return None
    if "value" in producer.attributes:
        return np.asarray(producer.attributes["value"].as_tensor().numpy())
    for name, dtype in _CONSTANT_LISTS.items():
        if name in producer.attributes:
            return np.asarray(producer.attributes[name].value, dtype=dtype)
    return None


def perm(node: ir.Node | None) -> list[int] | None:
    """A ``Transpose``'s permutation: its ``perm``, or the axes reversed (ONNX's default) when
    the input's rank is known; else ``None``."""
    if node is None:
        return None
    attr = node.attributes.get("perm")
    if attr is not None:
        return list(attr.as_ints())
    x = node.inputs[0] if node.inputs else None
    return None if x is None or x.shape is None else list(range(len(x.shape)))[::-1]


def consts(value: ir.Value | None) -> list[int] | None:
    array = constant(value)
    return None if array is None else [int(a) for a in array.reshape(-1)]


def uses(value: ir.Value, outputs: set[ir.Value]) -> list[ir.Node] | None:
    """The nodes reading ``value`` (``None`` when it is also a graph output)."""
    return None if value in outputs else [use.node for use in value.uses()]


def readers(value: ir.Value, outputs: set[ir.Value]) -> list[ir.Node] | None:
    """The distinct nodes reading ``value`` (``None`` when it is a graph output)."""
    if value in outputs:
        return None
    return list({id(u.node): u.node for u in value.uses()}.values())


def single_reader(value: ir.Value, outputs: set[ir.Value], op_type: str | None = None) -> ir.Node | None:
    """The one node reading ``value`` (perhaps in several inputs), when ``value`` is no graph
    output; with ``op_type``, only an ONNX-domain node of that type."""
    found = readers(value, outputs)
    if found is None or len(found) != 1:
        return None
    if op_type is not None and not is_op(found[0], op_type):
        return None
    return found[0]


def scalar_constant(graph: ir.Graph, name: str, value: float, dtype: ir.DataType) -> ir.Value:
    """The 0-d initializer ``name`` holding ``value`` as ``dtype`` (made once, then reused)."""
    found = graph.initializers.get(name)
    if found is not None:
        return found
    return initializer(graph, name, np.array(value, dtype=dtype.numpy()))


def emulated(*values: ir.Value | None) -> bool:
    """Whether a node making one of ``values`` emulates another precision than the value's
    dtype (``convert --emulate``: float32 ops whose recorded ``NODE_PRECISION`` is bfloat16 or
    float16, with rounding Casts between them). A fused kernel in the values' dtype would drop
    those roundings, so a backward fusion leaves such a block alone."""
    for value in values:
        node = value.producer() if value is not None else None
        recorded = node.metadata_props.get(NODE_PRECISION) if node is not None else None
        if recorded not in (None, Precision.NONE) and value.dtype in PRECISION_OF_DTYPE \
                and recorded != PRECISION_OF_DTYPE[value.dtype]:  # type: ignore[union-attr]
            return True
    return False


def interior(olds: Sequence[ir.Value | None], sources: Sequence[ir.Value | None]) -> set[ir.Node]:
    """The nodes that compute ``olds`` (a block's contributions) from ``sources`` (its ``dys``
    and the forward node's values): what a fused backward replaces. A rule reads their recorded
    decisions (precision), never their op types."""
    return ancestors(v for v in olds if v is not None) - ancestors(v for v in sources if v is not None)


def cast_to(value: ir.Value, dtype: ir.DataType, name: str, meta: dict[str, str], *,
            reuse_in: ir.Graph | None = None) -> tuple[ir.Value, ir.Node | None]:
    """``value`` as ``dtype``: itself, or the output of a new ``Cast`` (returned, not placed);
    with ``reuse_in``, a ``Cast`` of ``value`` to ``dtype`` already in that graph first."""
    if value.dtype == dtype:
        return value, None
    for use in value.uses() if reuse_in is not None else ():
        node = use.node
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.graph is reuse_in \
                and node.attributes["to"].as_int() == dtype.value:
            return node.outputs[0], None
    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", dtype.value)], name=name, metadata_props=dict(meta))
    cast.outputs[0].name, cast.outputs[0].dtype, cast.outputs[0].shape = name, dtype, value.shape
    return cast.outputs[0], cast


def swap_backward(graph: ir.Graph, fused: ir.Node, olds: Sequence[ir.Value | None],
                  before: Sequence[ir.Node] = ()) -> bool:
    """Put ``fused`` (not yet in ``graph``; ``before``: nodes it reads that are not placed yet,
    such as a ``cast_to``) after the last node making one of its inputs, give each of ``olds``
    (a gradient block's ``dxs``, ``None`` where there is none) to ``fused``'s output of the same
    position (name, readers, graph-output slot; through a ``Cast`` where their dtypes differ),
    and remove the nodes that made the olds, now read by nothing.

    ``fused``'s outputs must carry their dtypes; those not taking an old value's place get
    fresh names. Returns ``False``, with ``graph`` unchanged, where an old value is read before
    every input of ``fused`` exists (the graph order allows no single place for it), or is made
    by a node of ``fused``'s op already (the names moved to it: a graph lowered twice).
    """
    if any(_made_by(old, fused) for old in olds if old is not None):
        return False
    order = {node: i for i, node in enumerate(graph)}
    pending = set(before)
    sources = [v.producer() for n in (*before, fused) for v in n.inputs if v is not None]
    made = [p for p in sources if p is not None and p not in pending and p is not fused]
    if any(p not in order for p in made):
        return False  # an input made in a subgraph or outside this graph
    anchor = max(made, key=order.__getitem__, default=None)  # None: graph inputs and constants only
    last = order[anchor] if anchor is not None else -1
    present = [(j, old) for j, old in enumerate(olds) if old is not None]
    if any(order.get(use.node, -1) <= last for _, old in present for use in old.uses()):
        return False
    names = NameScope(graph)
    meta = dict(fused.metadata_props)
    added = [*before, fused]
    news: list[ir.Value] = []
    for j, old in present:
        out = fused.outputs[j]
        new, cast = cast_to(out, old.dtype, names.fresh(f"{fused.name}/output_{j}_cast"), meta) \
            if old.dtype is not None else (out, None)
        added += [cast] if cast is not None else []
        news.append(new)
    for j, out in enumerate(fused.outputs):
        if not out.name:
            out.name = names.fresh(f"{fused.name}/output_{j}")
    if anchor is not None:
        graph.insert_after(anchor, added)
    else:
        graph.insert_before(graph.node(0), added)
    olds_present = [old for _, old in present]
    dead = ancestors(olds_present)
    for old, new in zip(olds_present, news):
        shape = old.shape if old.shape is not None else new.shape
        hand_over([old], [new])
        new.shape = shape
    remove_dead(graph, dead)
    return True


def _made_by(value: ir.Value, fused: ir.Node) -> bool:
    """``value`` is an output of a node of ``fused``'s op (or a ``Cast`` of one)."""
    node = value.producer()
    if node is not None and node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    return node is not None and node.op_type == fused.op_type and node.domain == fused.domain


def remove_dead(graph: ir.Graph, candidates: set[ir.Node]) -> int:
    """Remove those of ``candidates`` nothing reads any more (readers first), and the
    initializers only they read; how many nodes."""
    removed = 0
    for node in reversed(list(graph)):
        if node in candidates and not any(v.uses() or v.is_graph_output() for v in node.outputs):
            inputs = [v for v in node.inputs if v is not None]
            graph.remove(node, safe=True)
            removed += 1
            for value in inputs:
                if value.is_initializer() and not value.is_graph_input() and not value.uses() \
                        and value.name in graph.initializers:
                    del graph.initializers[value.name]
    return removed
