"""The one node builder: every node and constant mpgraph adds to a graph is made here.

A ``Builder`` appends to one graph through an ``onnx_ir.tape.Tape`` and gives what it makes

1. **a deterministic name** from the one allocator (``names.NameScope``): a node and its
   single output are ``<scope>/<site>/<op>`` (``site`` is ``step`` unless a subclass says
   otherwise: ``GradContext`` puts the forward node whose rule is emitting there), or
   ``<scope>/<name>`` when the caller names it; the outputs of a multi-output node are
   ``<node>:<i>``; constants are ``<scope>/const``. A taken name gets ``_1``, ``_2``...
2. **its role** (``mpgraph.role`` metadata), and whatever else ``metadata()`` adds;
3. **a dtype** guessed from the op and its inputs, so later builders can read it;
4. **deduplicated constants**: one initializer per (dtype, shape, bytes).

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> g = ir.Graph([x], [], nodes=[])
    >>> b = Builder(g, role="optimizer", scope="optim")
    >>> y = b.op("Mul", x, b.scalar(2.0, x))
    >>> z = b.op("Add", y, b.scalar(2.0, x), name="x/plus_two")
    >>> [n.name for n in g], sorted(g.initializers), y.dtype
    (['optim/step/Mul', 'optim/x/plus_two'], ['optim/const'], FLOAT)
    >>> b.cast(z, ir.DataType.FLOAT16).name, dict(g.node(0).metadata_props)
    ('optim/step/Cast', {'mpgraph.role': 'optimizer'})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.tape

from mpgraph._ir import meta as md
from mpgraph._ir.names import NameScope

__all__ = ["Builder", "make_cast", "guess_dtype"]

_INT64_OUT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OUT = frozenset(
    {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "IsNaN", "IsInf"}
)


def guess_dtype(op_type: str, inputs: Sequence[ir.Value | None], attrs: dict[str, Any]) -> ir.DataType | None:
    """The output dtype of a default-domain op from its inputs and attributes, if it shows."""
    if op_type in _INT64_OUT:
        return ir.DataType.INT64
    if op_type in _BOOL_OUT:
        return ir.DataType.BOOL
    if op_type == "Cast":
        return ir.DataType(attrs["to"])
    if op_type in ("ConstantOfShape", "Constant"):
        v = attrs.get("value")
        return v.dtype if v is not None else ir.DataType.FLOAT
    if op_type == "Where":
        inputs = inputs[1:]
    if op_type == "OneHot":
        inputs = inputs[2:]
    for v in inputs:
        if v is not None and v.dtype is not None:
            return v.dtype
    return None


class Builder:
    """Appends nodes and constants to ``graph`` with deterministic names and a role.

    Built over ``onnx_ir.tape.Tape``: the tape makes each node, appends it to ``graph`` and
    registers each constant (``tape.nodes`` lists what was made, in order); the Builder adds
    the names, metadata, dtypes and deduplication.

    Args:
        graph: The graph that receives the nodes (appended at the end) and constants.
        role: ``mpgraph.role`` of every node made (a ``meta.Role``).
        scope: First part of every generated name.
        names: The allocator to share with other builders of the same graph; a new one
            over ``graph`` by default.
    """

    def __init__(self, graph: ir.Graph, *, role: str, scope: str, names: NameScope | None = None) -> None:
        self.graph = graph
        self.role = str(role)
        self.scope = scope
        self.names = names if names is not None else NameScope(graph)
        self.tape = onnx_ir.tape.Tape(graph)
        self._consts: dict[tuple[Any, ...], ir.Value] = {}

    # -- naming and metadata -------------------------------------------------------------
    @property
    def site(self) -> str:
        """The part of a generated node name between the scope and the op type."""
        return "step"

    def metadata(self) -> dict[str, str]:
        """The metadata every node made now carries."""
        return {md.NODE_ROLE: self.role}

    def unique(self, name: str) -> str:
        """``name`` or ``name_<k>``, unused so far in the graph; now taken."""
        return self.names.fresh(name)

    # -- nodes ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, name: str | None = None, **attrs: Any) -> ir.Value:
        """Append a single-output node; ``attrs`` are Python values (``None`` ones are left out).

        Args:
            name: Name the node ``<scope>/<name>`` instead of ``<scope>/<site>/<op>``.
        """
        return self.op_multi(op_type, *inputs, num_outputs=1, name=name, **attrs)[0]

    def op_multi(
        self, op_type: str, *inputs: ir.Value | None, num_outputs: int, name: str | None = None, **attrs: Any
    ) -> list[ir.Value]:
        """Append a node with ``num_outputs`` outputs and return them."""
        node_name = self.unique(f"{self.scope}/{name}" if name is not None else f"{self.scope}/{self.site}/{op_type}")
        outputs = self.tape.op_multi_out(
            op_type, list(inputs), {k: v for k, v in attrs.items() if v is not None},
            num_outputs=num_outputs, name=node_name, metadata_props=self.metadata(),
        )
        guessed = guess_dtype(op_type, inputs, attrs)
        for i, out in enumerate(outputs):
            out.name = node_name if num_outputs == 1 else self.unique(f"{node_name}:{i}")
            if guessed is not None:
                out.dtype = guessed
        return list(outputs)

    def cast(self, value: ir.Value, to: ir.DataType) -> ir.Value:
        """``Cast(value, to)``."""
        return self.op("Cast", value, to=to)

    def shape(self, value: ir.Value | None, start: int | None = None, end: int | None = None) -> ir.Value:
        """Runtime ``Shape`` of a value (optionally sliced)."""
        return self.op("Shape", value, start=start, end=end)

    def zeros_like(self, value: ir.Value | None) -> ir.Value:
        """Runtime zeros with the shape and dtype of ``value``."""
        assert value is not None
        zero = ir.tensor(np.zeros((1,), dtype=(value.dtype or ir.DataType.FLOAT).numpy()))
        return self.op("ConstantOfShape", self.shape(value), value=zero)

    # -- constants -----------------------------------------------------------------------
    def const(self, array: Any, dtype: ir.DataType | None = None) -> ir.Value:
        """A constant initializer (deduplicated by dtype, shape and bytes)."""
        arr = np.asarray(array, dtype=dtype.numpy() if dtype is not None else None)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.unique(f"{self.scope}/const")
            self._consts[key] = self.tape.initializer(ir.tensor(arr, name=name))
        return self._consts[key]

    def scalar(self, number: float, like: ir.Value | None) -> ir.Value:
        """A rank-0 constant with the dtype of ``like``."""
        assert like is not None
        return self.const(number, like.dtype or ir.DataType.FLOAT)

    def ints(self, values: Sequence[int]) -> ir.Value:
        """A 1-D int64 constant."""
        return self.const(np.asarray(list(values), dtype=np.int64))


def make_cast(name: str, value: ir.Value, to: ir.DataType, inserted: str, reason: str) -> ir.Node:
    """A detached ``Cast(value, to)`` node and output both named ``name``, marked as mpgraph's.

    The precision passes place it themselves (next to the value it casts), so it is not
    appended by a ``Builder``.

    Args:
        inserted: ``cast`` (policy boundary) or ``round`` (emulation rounding).
        reason: Shown by the audit.
    """
    return ir.Node(
        "",
        "Cast",
        [value],
        [ir.AttrInt64("to", to)],
        name=name,
        outputs=[ir.Value(name=name, type=ir.TensorType(to), shape=value.shape)],
        metadata_props={md.NODE_INSERTED: inserted, md.NODE_PRECISION: "none", md.NODE_REASON: reason},
    )
