"""Reverse-mode differentiation of an onnx-ir graph.

The driver walks the graph backwards from a scalar loss and asks each node's gradient rule
(``registry.py``) for its input gradients. Everything that is not math lives here:

1. **Pruning.** Only nodes on a path from a trainable value to the loss are differentiated;
   non-differentiable ops and non-float values stop the path.
2. **Fan-in.** A value used by several nodes gets the sum of its gradient contributions,
   computed once, named ``grad/<value>``.
3. **Un-broadcasting.** Gradients of broadcasting ops are summed back to the input's shape,
   statically where shapes allow, else with runtime ``Shape`` ops (the batch dim stays dynamic).
4. **Naming.** Every node and value the driver or a rule creates is named
   ``grad/<forward node>/<op>`` (deterministic, scoped) and carries the role ``backward``.
5. **Errors.** A node on the path without a rule raises ``GradientError`` naming op, opset and
   node, before the graph is modified.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import Builder
from mpgraph._ir.links import link_to
from mpgraph._ir.meta import Role
from mpgraph.autodiff import registry
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import GradientError

__all__ = ["GradContext", "differentiate", "input_gradients"]

logger = logging.getLogger(__name__)

# dtypes of optional outputs that the driver adds, where they differ from the first input's.
_EXTRA_OUTPUT_DTYPES = {
    ("Dropout", 1): ir.DataType.BOOL,
    ("MaxPool", 1): ir.DataType.INT64,
    ("LayerNormalization", 1): ir.DataType.FLOAT,
    ("LayerNormalization", 2): ir.DataType.FLOAT,
}


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in FLOAT_TYPES


class GradContext(Builder):
    """The builder handed to gradient rules: a ``Builder`` that knows the forward node.

    Node building (``op``, ``const``, ``scalar``, ``ints``, ``cast``, ``shape``,
    ``zeros_like``) is the ``Builder``'s; what is autodiff's is here: the current forward
    node (named in generated names, ``grad/<node>/<op>``, and recorded by its first output
    value, ``mpgraph.grad_of_value``, and its name, ``mpgraph.grad_of``: ``_ir.links``),
    its inputs and attributes, which inputs need a gradient, and un-broadcasting.

    Args:
        graph: The graph that receives the backward nodes (appended at the end).
        role: Value of the ``NODE_ROLE`` metadata on every created node.
        scope: Prefix of generated names.
        target: Where the step will run (``cpu``, ``cuda`` or ``None``): rules with forms
            that measure faster on one provider read it (the Conv weight gradient). Same math.
    """

    def __init__(self, graph: ir.Graph, role: str = Role.BACKWARD, scope: str = "grad",
                 target: str | None = None) -> None:
        super().__init__(graph, role=role, scope=scope)
        self.target = target
        self.node: ir.Node | None = None
        self.needed: Sequence[bool] = ()
        #: The total gradient of a value whose consumers are all differentiated already
        #: (``None`` otherwise, or outside ``differentiate``): a rule may read it for a
        #: forward value downstream of its node (see the Softmax rule).
        self.gradient_of: Callable[[ir.Value], ir.Value | None] = lambda value: None

    @property
    def site(self) -> str:
        """The forward node whose rule is emitting (``step`` outside a rule)."""
        return str(self.node.name) if self.node is not None else super().site

    def metadata(self) -> dict[str, str]:
        """The role, and which forward node's rule emitted the node: policies keep the
        backward of deny ops float32."""
        props = super().metadata()
        if self.node is not None:
            props.update(link_to(self.node))
        return props

    # -- node inspection -------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute of the current forward node as a Python value."""
        assert self.node is not None
        a = self.node.attributes.get(name)
        if a is None:
            return default
        v = a.value
        return list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v

    def input(self, index: int) -> ir.Value:
        """Input ``index`` of the current forward node, which must be present."""
        assert self.node is not None
        value = self.node.inputs[index] if index < len(self.node.inputs) else None
        if value is None:
            raise GradientError(f"node '{self.node.name}' ({self.node.op_type}) lacks its input {index}")
        return value

    def optional_input(self, index: int) -> ir.Value | None:
        """Input ``index`` of the current forward node, or ``None`` when omitted."""
        assert self.node is not None
        return self.node.inputs[index] if index < len(self.node.inputs) else None

    def np_dtype(self, value: ir.Value | None) -> np.dtype:
        """numpy dtype of a forward value (``GradientError`` when unknown)."""
        if value is None or value.dtype is None:
            raise GradientError(f"node '{self.node.name if self.node else '?'}': unknown dtype of '{value.name if value else '?'}'")
        return np.dtype(value.dtype.numpy())

    def static_dims(self, value: ir.Value | None, what: str) -> list[int]:
        """Dims of a forward value that must all be static (``GradientError`` otherwise)."""
        dims = self.dims(value)
        if any(d is None for d in dims):
            raise GradientError(f"node '{self.node.name if self.node else '?'}': {what} must be static, got {dims}")
        return [d for d in dims if d is not None]

    def required_ints(self, value: ir.Value | None, what: str) -> list[int]:
        """Integer values of an input that must be a constant (``GradientError`` otherwise)."""
        ints = self.const_ints(value)
        if ints is None:
            raise GradientError(f"node '{self.node.name if self.node else '?'}': {what} must be constant for its gradient")
        return ints

    def needs(self, index: int) -> bool:
        """Whether input ``index`` of the current node needs a gradient."""
        return index < len(self.needed) and self.needed[index]

    def const_ints(self, value: ir.Value | None) -> list[int] | None:
        """Integer values of a constant input, or ``None`` when not constant."""
        if value is None:
            return None
        tensor = ir.convenience.get_const_tensor(value)
        return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]

    def const_float(self, value: ir.Value | None) -> float | None:
        """Scalar value of a constant float input, or ``None``."""
        tensor = None if value is None else ir.convenience.get_const_tensor(value)
        return None if tensor is None else float(tensor.numpy().reshape(-1)[0])

    def rank(self, value: ir.Value | None) -> int:
        """Static rank of a forward value; ``GradientError`` when unknown."""
        assert value is not None
        if value.shape is None:
            raise GradientError(
                f"rank of '{value.name}' (input of node '{self.node.name if self.node else '?'}') "
                "is unknown; run shape inference or give the model static ranks"
            )
        return len(value.shape)

    def dims(self, value: ir.Value | None) -> list[int | None]:
        """Static dims of a forward value (``None`` for dynamic ones)."""
        assert value is not None
        return [d if isinstance(d, int) else None for d in (value.shape or ())]

    def count_ratio(self, big: ir.Value | None, small: ir.Value | None, like: ir.Value | None) -> ir.Value:
        """``Size(big) / Size(small)`` as a scalar of ``like``'s dtype (e.g. a mean's count)."""
        ratio = self.op("Div", self.op("Size", big), self.op("Size", small))
        return self.op("Cast", ratio, to=(like.dtype if like is not None else None) or ir.DataType.FLOAT)

    def unbroadcast(
        self, grad: ir.Value, target: ir.Value | None, grad_shape: ir.Shape | None
    ) -> ir.Value:
        """Sum ``grad`` (of shape ``grad_shape``) down to the shape of ``target``.

        Static axes when both shapes are known; otherwise a runtime axis mask built from
        ``Shape`` ops so dynamic dims (the batch) stay dynamic.
        """
        assert target is not None
        xs, gs = target.shape, grad_shape
        if xs is not None and gs is not None and len(xs) <= len(gs):
            lead = len(gs) - len(xs)
            axes, dynamic = list(range(lead)), False
            for i, xd in enumerate(xs):
                gd = gs[lead + i]
                if xd == 1:
                    if gd != 1:
                        axes.append(lead + i)
                elif isinstance(xd, int) or (getattr(xd, "value", None) is not None and xd == gd):
                    continue
                else:
                    dynamic = True
            if not dynamic:
                if not axes:
                    return grad
                if len(axes) == lead:
                    return self.op("ReduceSum", grad, self.ints(axes), keepdims=0)
                summed = self.op("ReduceSum", grad, self.ints(axes), keepdims=1)
                return self.op("Squeeze", summed, self.ints(range(lead))) if lead else summed
        if xs is None or gs is None:
            raise GradientError(
                f"cannot un-broadcast the gradient of '{target.name}' at node "
                f"'{self.node.name if self.node else '?'}': unknown rank"
            )
        lead = len(gs) - len(xs)
        xshape = self.shape(target)
        if lead:
            xshape_padded = self.op("Concat", self.ints([1] * lead), xshape, axis=0)
        else:
            xshape_padded = xshape
        one = self.ints([1])
        mask = self.op(
            "And",
            self.op("Equal", xshape_padded, one),
            self.op("Not", self.op("Equal", self.shape(grad), one)),
        )
        axes_v = self.op("Reshape", self.op("NonZero", mask), self.ints([-1]))
        summed = self.op("ReduceSum", grad, axes_v, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", summed, xshape)


def input_gradients(ctx: GradContext, node: ir.Node, rule: registry.GradientRule,
                    dys: Sequence[ir.Value | None]) -> list[tuple[ir.Value, ir.Value]]:
    """``(input, gradient)`` for each input ``ctx.needed`` marks, from ``rule`` applied to
    ``node`` with output cotangents ``dys``; broadcasting rules get their gradients reduced
    to the input's shape here, so rules read like the math."""
    return [(inp, grad) for _, inp, grad in _slot_gradients(ctx, node, rule, dys)]


def _slot_gradients(ctx: GradContext, node: ir.Node, rule: registry.GradientRule,
                    dys: Sequence[ir.Value | None]) -> list[tuple[int, ir.Value, ir.Value]]:
    """``input_gradients`` with each gradient's input slot."""
    grads = rule.fn(ctx, node, *dys)
    found = []
    for i, (inp, grad) in enumerate(zip(node.inputs, grads, strict=False)):
        if grad is None or inp is None or not ctx.needed[i]:
            continue
        if rule.broadcast:
            grad = ctx.unbroadcast(grad, inp, node.outputs[0].shape)
        found.append((i, inp, grad))
    return found


def _record_block(node: ir.Node, dys: Sequence[ir.Value | None],
                  found: Sequence[tuple[int, ir.Value, ir.Value]]) -> None:
    """Write on ``node`` which values its backward reads and makes (``NODE_GRAD_OUTPUTS``,
    ``NODE_GRAD_INPUTS``): lowering finds a node's backward by them, not by node shapes."""
    slots: list[str | None] = [None] * len(node.inputs)
    for i, _, grad in found:
        slots[i] = grad.name
    node.metadata_props[md.NODE_GRAD_INPUTS] = json.dumps(slots)
    node.metadata_props[md.NODE_GRAD_OUTPUTS] = json.dumps([d.name if d is not None else None for d in dys])


def differentiate(
    graph: ir.Graph,
    loss: ir.Value,
    wrt: Sequence[ir.Value],
    *,
    opset: int,
    seed: ir.Value | None = None,
    target: str | None = None,
) -> dict[str, ir.Value]:
    """Append the backward pass of ``loss`` with respect to ``wrt`` to ``graph``.

    Args:
        graph: A topologically sorted graph holding ``loss`` and ``wrt``.
        loss: The value to differentiate (any shape; its gradient seed is ones).
        wrt: Float values (graph inputs or initializers) to differentiate with respect to.
        opset: The model's default-domain opset version.
        seed: Optional gradient of ``loss`` (e.g. a loss scale); ones when omitted.
        target: Where the step will run (``GradContext.target``): picks the gradient forms
            measured fastest there; ``None`` picks them by layer shape (ORT CPU measurements).

    Returns:
        ``{name of wrt value: gradient value}``; a value the loss does not depend on gets zeros.

    Raises:
        GradientError: Empty ``wrt``, non-float loss, or a node on the path without a rule.
    """
    if not wrt:
        raise GradientError("nothing to differentiate: no trainable parameters")
    if not _is_float(loss):
        raise GradientError(f"loss '{loss.name}' is not a float tensor (dtype {loss.dtype})")
    nodes = list(graph)
    active = _active_values(nodes, wrt)
    if loss not in active:
        raise GradientError(
            f"loss '{loss.name}' does not depend on any trainable parameter; check --freeze"
        )
    path, needed = _gradient_path(graph, nodes, loss, active, opset)
    ctx = GradContext(graph, target=target)
    _name_optional_outputs(ctx, path)
    fan_in = _FanIn(Builder(graph, role=Role.BACKWARD, scope="grad", names=ctx.names))
    ctx.gradient_of = fan_in.totals.get
    fan_in.add(loss, seed if seed is not None else _ones_seed(ctx, loss))
    for node, rule in path:
        dys = [fan_in.total(o) for o in node.outputs]
        if all(d is None for d in dys):
            continue
        ctx.node = node
        ctx.needed = [v is not None and v in needed and v in active for v in node.inputs]
        found = _slot_gradients(ctx, node, rule, dys)
        for _, inp, grad in found:
            fan_in.add(inp, grad)
        _record_block(node, dys, found)
    ctx.node = None
    result: dict[str, ir.Value] = {}
    for value in wrt:
        grad = fan_in.total(value)
        result[value.name or ""] = grad if grad is not None else ctx.zeros_like(value)
    logger.debug("differentiated %d nodes for %d values", len(path), len(wrt))
    return result


def _active_values(nodes: Sequence[ir.Node], wrt: Sequence[ir.Value]) -> set[ir.Value]:
    """Pruning, forward: the float values that depend on ``wrt`` through differentiable ops."""
    active: set[ir.Value] = set(wrt)
    for node in nodes:
        if any(v in active for v in node.inputs if v is not None):
            if registry.is_non_differentiable(node.domain, node.op_type):
                continue
            active.update(o for o in node.outputs if _is_float(o))
    return active


def _gradient_path(
    graph: ir.Graph, nodes: Sequence[ir.Node], loss: ir.Value, active: set[ir.Value], opset: int
) -> tuple[list[tuple[ir.Node, registry.GradientRule]], set[ir.Value]]:
    """Pruning, backward: the nodes between ``active`` values and the loss with their rules, in
    reverse order, and the values whose gradient is needed. A missing rule raises here, before
    the graph is modified."""
    needed: set[ir.Value] = {loss}
    path: list[tuple[ir.Node, registry.GradientRule]] = []
    for node in reversed(nodes):
        if not any(o in needed for o in node.outputs):
            continue
        rule = registry.lookup_rule(
            node.domain, node.op_type, graph.opset_imports.get(node.domain or "", opset),
            node.name or node.op_type,
        )
        if rule == registry.NON_DIFFERENTIABLE:
            continue
        assert isinstance(rule, registry.GradientRule)
        path.append((node, rule))
        needed.update(v for v in node.inputs if v is not None and v in active)
    return path, needed


def _name_optional_outputs(ctx: GradContext, path: Sequence[tuple[ir.Node, registry.GradientRule]]) -> None:
    """Add the optional forward outputs some rules read (Dropout mask, MaxPool indices, ...),
    named ``<node>/output_<i>``, with their dtypes."""
    for node, rule in path:
        if rule.outputs > len(node.outputs):
            node.resize_outputs(rule.outputs)
        for i, out in enumerate(node.outputs):
            if not out.name:
                out.name = ctx.unique(f"{node.name}/output_{i}")
            first = node.inputs[0].dtype if node.inputs[0] is not None else None
            extra = _EXTRA_OUTPUT_DTYPES.get((node.op_type, i), first)
            if out.dtype is None and extra is not None:
                out.dtype = extra


def _ones_seed(ctx: GradContext, loss: ir.Value) -> ir.Value:
    """``dloss/dloss``: a scalar one, or ones shaped like the loss at runtime."""
    if loss.shape is not None and len(loss.shape) == 0:
        return ctx.scalar(1.0, loss)
    one = ir.tensor(np.ones((1,), dtype=(loss.dtype or ir.DataType.FLOAT).numpy()))
    return ctx.op("ConstantOfShape", ctx.shape(loss), value=one)


class _FanIn:
    """Fan-in: a value used by several nodes gets the sum of its gradient contributions,
    computed once, by a ``Sum`` named ``grad/<value>`` (``sums``' scope is ``grad``)."""

    def __init__(self, sums: Builder) -> None:
        self.sums = sums
        self.contributions: dict[ir.Value, list[ir.Value]] = {}
        self.totals: dict[ir.Value, ir.Value] = {}

    def add(self, value: ir.Value, grad: ir.Value) -> None:
        """Record one contribution to ``value``'s gradient."""
        self.contributions.setdefault(value, []).append(grad)

    def total(self, value: ir.Value) -> ir.Value | None:
        """The gradient of ``value`` (``None`` when nothing contributed); final once read."""
        if value in self.totals:
            return self.totals[value]
        parts = self.contributions.get(value)
        if not parts:
            return None
        result = parts[0] if len(parts) == 1 else self.sums.op("Sum", *parts, name=str(value.name))
        if len(parts) > 1 and value.dtype is not None:
            result.dtype = value.dtype
        self.totals[value] = result
        return result
