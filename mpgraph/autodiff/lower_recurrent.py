"""RNN, GRU and LSTM as unrolled primitive ops, so the per-op rules differentiate them.

For a static sequence length T a recurrent node is exactly its unrolled form, written here
after the ONNX operator definitions: one input projection for all steps
(``Gemm(Flatten(X), W, Wb + Rb, transB=1)``), then per step a ``Gemm`` for the recurrent
projection, the gate activations and the state update. Gate order is ``iofc`` for LSTM
(peepholes ``iof``), ``zrh`` for GRU; ``clip`` bounds every activation's input; default
activations are (Sigmoid, Tanh, Tanh) for LSTM, (Sigmoid, Tanh) for GRU and Tanh for RNN;
``sequence_lens`` masks the steps past each batch entry's length (the state is carried, ``Y``
is zero), which also makes the reverse direction start at each entry's last valid step.
Nothing here is a gradient formula: the existing rules differentiate the unrolled ops.

Two ways in:

1. ``lower_recurrent(graph)`` replaces every recurrent node of a forward graph by its unrolled
   ops before differentiation; the step graph then runs the unrolled forward once.
2. The gradient rules registered below recompute the unrolled forward from the node's inputs
   in a scratch graph, differentiate it there and inline the result: the forward keeps ONNX
   Runtime's fused kernel and the backward pays one recomputation.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([5, 2, 3]))
    >>> w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4, 3]))
    >>> r = ir.Value(name="r", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4, 4]))
    >>> rnn = ir.Node("", "RNN", [x, w, r], {"hidden_size": ir.AttrInt64("hidden_size", 4)}, num_outputs=2, name="rnn")
    >>> g = ir.Graph([x, w, r], [rnn.outputs[1]], nodes=[rnn], opset_imports={"": 18})
    >>> lower_recurrent(g)
    1
    >>> sorted({n.op_type for n in g})[:4]
    ['Concat', 'ConstantOfShape', 'Flatten', 'Gemm']
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from mpgraph._ir.builder import Builder
from mpgraph._ir.meta import Role
from mpgraph.autodiff.driver import GradContext, differentiate
from mpgraph.autodiff.registry import register
from mpgraph.errors import GradientError

__all__ = ["RECURRENT_OPS", "lower_recurrent", "unroll"]

logger = logging.getLogger(__name__)

V = ir.Value
RECURRENT_OPS = ("RNN", "GRU", "LSTM")

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
# name (lower case) -> (op, default alpha, default beta); None: the function takes no such value.
_ACTIVATIONS: dict[str, tuple[str, float | None, float | None]] = {
    "sigmoid": ("Sigmoid", None, None), "tanh": ("Tanh", None, None), "relu": ("Relu", None, None),
    "softsign": ("Softsign", None, None), "softplus": ("Softplus", None, None),
    "leakyrelu": ("LeakyRelu", 0.01, None), "thresholdedrelu": ("ThresholdedRelu", 1.0, None),
    "elu": ("Elu", 1.0, None), "hardsigmoid": ("HardSigmoid", 0.2, 0.5),
    "affine": ("Affine", 1.0, 0.0), "scaledtanh": ("ScaledTanh", 1.0, 1.0),
}


@dataclasses.dataclass(frozen=True)
class _Activation:
    op: str
    alpha: float | None
    beta: float | None


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the unrolling needs from a recurrent node, validated once."""

    op_type: str
    hidden: int
    steps: int
    directions: tuple[bool, ...]  # reverse? per direction
    layout: int
    clip: float | None
    activations: tuple[tuple[_Activation, ...], ...]  # per direction
    linear_before_reset: bool
    input_forget: bool


def _fail(node: ir.Node, what: str) -> GradientError:
    return GradientError(f"{node.op_type} node '{node.name}': {what}")


def _spec(node: ir.Node) -> _Spec:
    x, r = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
    if x is None or r is None:
        raise _fail(node, "X and R must be present")
    attrs = node.attributes
    layout = attrs.get_int("layout", 0)
    seq_axis = 1 if layout else 0
    dims = list(x.shape) if x.shape is not None else None
    steps = dims[seq_axis] if dims is not None and len(dims) == 3 else None
    if not isinstance(steps, int):
        raise _fail(node, (
            f"the sequence length (dim {seq_axis} of '{x.name}', shape {dims}) must be static to unroll "
            "it for the gradient; export with a fixed sequence length or fix that dim "
            "(onnxruntime.tools.make_dynamic_shape_fixed)"))
    hidden: int | None = attrs.get_int("hidden_size")
    if hidden is None:
        r_dims = list(r.shape) if r.shape is not None else []
        hidden = r_dims[-1] if r_dims else None
    if not isinstance(hidden, int):
        raise _fail(node, "hidden_size is neither an attribute nor a static dim of R")
    direction = attrs.get_string("direction", "forward")
    reverse = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(direction)
    if reverse is None:
        raise _fail(node, f"unknown direction '{direction}' (forward, reverse or bidirectional)")
    per_dir = len(_DEFAULT_ACTIVATIONS[node.op_type])
    names = list(attrs.get_strings("activations") or _DEFAULT_ACTIVATIONS[node.op_type] * len(reverse))
    if len(names) != per_dir * len(reverse):  # ONNX Runtime refuses a short list too
        raise _fail(node, f"expected {per_dir * len(reverse)} activations ({per_dir} per direction), got {names}")
    alphas = list(attrs.get_floats("activation_alpha") or [])
    betas = list(attrs.get_floats("activation_beta") or [])
    acts = []
    for name in names:
        if name.lower() not in _ACTIVATIONS:
            raise _fail(node, f"activation '{name}' has no unrolled form (known: {', '.join(_ACTIVATIONS)})")
        op, alpha, beta = _ACTIVATIONS[name.lower()]
        # The alpha/beta lists are consumed in order by the functions that take them.
        if alpha is not None and alphas:
            alpha = float(alphas.pop(0))
        if beta is not None and betas:
            beta = float(betas.pop(0))
        acts.append(_Activation(op, alpha, beta))
    clip = attrs.get_float("clip")
    return _Spec(
        node.op_type, hidden, steps, reverse, layout, clip,
        tuple(tuple(acts[d * per_dir:(d + 1) * per_dir]) for d in range(len(reverse))),
        bool(attrs.get_int("linear_before_reset", 0)), bool(attrs.get_int("input_forget", 0)),
    )


class _Cell:
    """Emits one direction of one recurrent node into ``b``'s graph."""

    def __init__(self, b: GradContext, spec: _Spec, acts: Sequence[_Activation], like: V, batch: ir.SymbolicDim | int) -> None:
        self.b, self.spec, self.acts, self.like, self.batch = b, spec, acts, like, batch

    def op(self, op_type: str, *inputs: V | None, **attrs: object) -> V:
        return self.b.op(op_type, *inputs, **attrs)

    def split(self, v: V, sizes: Sequence[int], axis: int) -> list[V]:
        return self.b.op_multi("Split", v, self.b.ints(sizes), axis=axis, num_outputs=len(sizes))

    def act(self, v: V, which: int, clipped: bool = True) -> V:
        """The activation ``which`` of the cell (f, g, h) on ``v``, clipped first when set."""
        b, like, clip = self.b, self.like, self.spec.clip
        if clip is not None and clipped:
            v = self.op("Clip", v, b.scalar(-clip, like), b.scalar(clip, like))
        a = self.acts[which]
        if a.op == "Affine":
            return self.op("Add", self.op("Mul", v, b.scalar(a.alpha or 0.0, like)), b.scalar(a.beta or 0.0, like))
        if a.op == "ScaledTanh":
            inner = self.op("Tanh", self.op("Mul", v, b.scalar(a.beta or 0.0, like)))
            return self.op("Mul", inner, b.scalar(a.alpha or 0.0, like))
        return self.op(a.op, v, alpha=a.alpha, beta=a.beta)

    def gemm(self, a: V, w: V, c: V | None) -> V:
        """``a @ w.T + c`` (weights stay in ONNX's [gates*hidden, in] layout)."""
        return self.op("Gemm", a, w, c, transB=1) if c is not None else self.op("Gemm", a, w, transB=1)

    def run(self, x_flat: V, w: V, r: V, bias: V | None, states: list[V], peep: V | None,
            masks: Sequence[V | None], reverse: bool) -> tuple[list[V], list[V]]:
        """Per-step outputs (in time order) and the final states of one direction."""
        h = self.spec.hidden
        if self.spec.op_type == "GRU":
            r_zr, r_h = self.split(r, [2 * h, h], 0)
            x_bias, rb_h = self.gru_bias(bias)
        else:
            x_bias = None if bias is None else self.op("Add", *self.split(bias, [_GATES[self.spec.op_type] * h] * 2, 0))
        projected = self.gemm(x_flat, w, x_bias)  # [T*B, gates*H]: every step's input term at once
        t_count = self.spec.steps
        xs = [_pin(v, self.batch, _GATES[self.spec.op_type] * h) for v in _split_even(self.b, projected, 0, t_count)]
        peeps = self.split(peep, [h] * 3, 0) if peep is not None else None
        outs: list[V] = [xs[0]] * t_count
        for t in reversed(range(t_count)) if reverse else range(t_count):
            if self.spec.op_type == "LSTM":
                new = self.lstm_step(xs[t], r, states[0], states[1], peeps)
            elif self.spec.op_type == "GRU":
                new = [self.gru_step(xs[t], r_zr, r_h, rb_h, states[0])]
            else:
                new = [self.act(self.gemm(states[0], r, xs[t]), 0)]
            mask = masks[t]
            if mask is None:
                outs[t], states = new[0], new
            else:  # past this entry's length: Y is zero and the state is carried
                outs[t] = self.op("Where", mask, new[0], self.b.scalar(0.0, self.like))
                states = [self.op("Where", mask, n, s) for n, s in zip(new, states, strict=True)]
        return outs, states

    def gru_bias(self, bias: V | None) -> tuple[V | None, V | None]:
        """The input-term bias, and Rbh when it must stay inside ``r * (H Rh^T + Rbh)``."""
        if bias is None:
            return None, None
        h = self.spec.hidden
        wb, rb = self.split(bias, [3 * h, 3 * h], 0)
        if not self.spec.linear_before_reset:
            return self.op("Add", wb, rb), None
        rb_zr, rb_h = self.split(rb, [2 * h, h], 0)
        wb_zr, wb_h = self.split(wb, [2 * h, h], 0)
        return self.op("Concat", self.op("Add", wb_zr, rb_zr), wb_h, axis=0), rb_h

    def lstm_step(self, xt: V, r: V, h_prev: V, c_prev: V, peeps: list[V] | None) -> list[V]:
        i, o, f, c = _split_even(self.b, self.gemm(h_prev, r, xt), 1, 4)
        if peeps is not None:
            i = self.op("Add", i, self.op("Mul", peeps[0], c_prev))
            f = self.op("Add", f, self.op("Mul", peeps[2], c_prev))
        i = self.act(i, 0)
        f = self.op("Sub", self.b.scalar(1.0, self.like), i) if self.spec.input_forget else self.act(f, 0)
        c_new = self.op("Add", self.op("Mul", f, c_prev), self.op("Mul", i, self.act(c, 1)))
        if peeps is not None:
            o = self.op("Add", o, self.op("Mul", peeps[1], c_new))
        # ONNX Runtime clips the gates' inputs but not the cell state that h reads (measured).
        return [self.op("Mul", self.act(o, 0), self.act(c_new, 2, clipped=False)), c_new]

    def gru_step(self, xt: V, r_zr: V, r_h: V, rb_h: V | None, h_prev: V) -> V:
        h = self.spec.hidden
        x_zr, x_h = self.split(xt, [2 * h, h], 1)
        z, r = _split_even(self.b, self.act(self.gemm(h_prev, r_zr, x_zr), 0), 1, 2)
        if self.spec.linear_before_reset:
            candidate = self.op("Add", x_h, self.op("Mul", r, self.gemm(h_prev, r_h, rb_h)))
        else:
            candidate = self.gemm(self.op("Mul", r, h_prev), r_h, x_h)
        hh = self.act(candidate, 1)
        return self.op("Add", hh, self.op("Mul", z, self.op("Sub", h_prev, hh)))  # (1-z)*hh + z*h


def _pin(v: V, *dims: ir.SymbolicDim | int | None) -> V:
    """Set ``v``'s shape where inference cannot see it (the rows of a flattened [T*B, n] split
    back per step, zeros shaped at run time): every step's values then carry X's batch dim, so
    broadcasting rules un-broadcast statically instead of with runtime shape arithmetic."""
    v.shape = ir.Shape(list(dims))
    return v


def _split_even(b: GradContext, v: V, axis: int, count: int) -> list[V]:
    """``count`` equal parts of ``v`` along ``axis`` (sizes need not be static)."""
    if count == 1:
        return [v]
    parts = b.op_multi("Split", v, axis=axis, num_outputs=count)
    producer = parts[0].producer()
    assert producer is not None
    # op_multi's num_outputs sizes the node; Split also needs it as an attribute.
    producer.attributes["num_outputs"] = ir.AttrInt64("num_outputs", count)
    return parts


def _per_direction(b: GradContext, v: V | None, count: int) -> list[V | None]:
    if v is None:
        return [None] * count
    parts = _split_even(b, v, 0, count)
    return [b.op("Squeeze", p, b.ints([0])) for p in parts]


def _step_masks(b: GradContext, lens: V | None, steps: int) -> list[V | None]:
    """Per step, ``t < sequence_lens`` as a [B, 1] bool; Nones when there are no lengths."""
    if lens is None:
        return [None] * steps
    times = b.const(np.arange(steps, dtype=np.dtype(lens.dtype.numpy() if lens.dtype else np.int32)).reshape(steps, 1))
    valid = b.op("Reshape", b.op("Less", times, b.op("Unsqueeze", lens, b.ints([0]))), b.ints([-1, 1]))
    return list(_split_even(b, valid, 0, steps))


def unroll(b: GradContext, node: ir.Node, inputs: Sequence[V | None]) -> list[V | None]:
    """Emit the unrolled computation of a recurrent ``node`` into ``b``'s graph.

    Args:
        b: Builder of the graph that receives the ops.
        node: The RNN, GRU or LSTM node (read for attributes and static dims).
        inputs: The values standing for ``node``'s inputs in ``b``'s graph (``None`` where
            omitted); a ``sequence_lens`` that is constant and equal to T may be passed as None.

    Returns:
        The values of ``node``'s outputs (Y, Y_h and, for LSTM, Y_c).

    Raises:
        GradientError: Dynamic sequence length, unknown activation or direction.
    """
    spec = _spec(node)
    padded = list(inputs) + [None] * (8 - len(inputs))
    x, w, r, bias, lens, h0, c0, peep = padded[:8]
    assert x is not None and w is not None and r is not None
    if spec.op_type != "LSTM":
        c0 = peep = None
    h, count = spec.hidden, len(spec.directions)
    if spec.layout:  # [B, T, I] and [B, dirs, H] -> the time-major layout
        x = b.op("Transpose", x, perm=[1, 0, 2])
        h0, c0 = (None if s is None else b.op("Transpose", s, perm=[1, 0, 2]) for s in (h0, c0))
    x_flat = b.op("Flatten", x, axis=2)
    zero = ir.tensor(np.zeros((1,), dtype=b.np_dtype(x)))
    batch = (x.shape or [None, None])[1]
    zeros = _pin(b.op("ConstantOfShape", b.op("Concat", b.shape(x, 1, 2), b.ints([h]), axis=0), value=zero), batch, h)
    masks = [None if m is None else _pin(m, batch, 1) for m in _step_masks(b, lens, spec.steps)]
    ws, rs, bs, ps = (_per_direction(b, v, count) for v in (w, r, bias, peep))
    h0s, c0s = ([None if s is None else _pin(s, batch, h) for s in _per_direction(b, v, count)] for v in (h0, c0))
    ys, finals = [], []
    for d, reverse in enumerate(spec.directions):
        cell = _Cell(b, spec, spec.activations[d], x, batch)
        states = [h0s[d] or zeros] + ([c0s[d] or zeros] if spec.op_type == "LSTM" else [])
        w_d, r_d = ws[d], rs[d]
        assert w_d is not None and r_d is not None
        outs, last = cell.run(x_flat, w_d, r_d, bs[d], states, ps[d], masks, reverse)
        stacked = b.op("Concat", *outs, axis=0) if len(outs) > 1 else outs[0]
        ys.append(b.op("Reshape", stacked, b.ints([spec.steps, 1, -1, h])))
        finals.append([b.op("Unsqueeze", s, b.ints([0])) for s in last])
    y = ys[0] if count == 1 else b.op("Concat", *ys, axis=1)  # [T, dirs, B, H]
    states_out = [f[0] if count == 1 else b.op("Concat", *f, axis=0) for f in zip(*finals, strict=True)]
    if spec.layout:
        y = b.op("Transpose", y, perm=[2, 0, 1, 3])
        states_out = [b.op("Transpose", s, perm=[1, 0, 2]) for s in states_out]
    results: list[V | None] = [y, *states_out]
    return results[: len(node.outputs)]


def _static_lens(node: ir.Node, steps: int) -> bool:
    """Whether ``sequence_lens`` is absent or a constant equal to the sequence length everywhere."""
    lens = node.inputs[4] if len(node.inputs) > 4 else None
    if lens is None:
        return True
    tensor = ir.convenience.get_const_tensor(lens)
    return tensor is not None and bool(np.all(tensor.numpy() == steps))


def _scratch(node: ir.Node, opset: int, role: str) -> tuple[GradContext, list[V | None]]:
    """A scratch graph with stand-ins for ``node``'s inputs, and its builder."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset})
    stand_ins: list[V | None] = []
    steps = _spec(node).steps
    for i, v in enumerate(node.inputs):
        if v is None or (i == 4 and _static_lens(node, steps)):
            stand_ins.append(None)
            continue
        s = ir.Value(name=f"in{i}", type=v.type, shape=v.shape)
        graph.inputs.append(s)
        stand_ins.append(s)
    b = GradContext(graph, role=role, scope="unroll")
    b.node = node
    return b, stand_ins


def _inline(scratch: ir.Graph, host: Builder, bindings: dict[V, V], keep: Sequence[V], prefix: str,
            before: ir.Node | None) -> None:
    """Move the scratch nodes that ``keep`` needs into ``host``'s graph (before ``before`` or at
    the end), binding stand-ins to real values, constants to host constants, and naming every
    node ``<prefix>/<op>`` with ``host``'s role."""
    live: set[V] = set(keep)
    nodes: list[ir.Node] = []
    for n in reversed(list(scratch)):
        if any(o in live for o in n.outputs):
            live.update(v for v in n.inputs if v is not None)
            nodes.append(n)
    nodes.reverse()
    kept = set(nodes)
    scratch.remove([n for n in scratch if n not in kept], safe=True)
    for stand_in, real in bindings.items():
        stand_in.replace_all_uses_with(real)
    for init in list(scratch.initializers.values()):
        if init.const_value is not None and init.uses():
            init.replace_all_uses_with(host.const(init.const_value.numpy()))
    scratch.remove(nodes, safe=False)
    counts: dict[str, int] = {}
    for n in nodes:
        # Numbered per op type here (<prefix>/<op>_<k>), then made unique: a taken name gets
        # its own suffix instead of shifting every later node's number.
        k = counts[n.op_type] = counts.get(n.op_type, -1) + 1
        n.name = host.unique(f"{prefix}/{n.op_type}" + (f"_{k}" if k else ""))
        for k, out in enumerate(n.outputs):
            out.name = n.name if len(n.outputs) == 1 else host.unique(f"{n.name}:{k}")
        n.metadata_props.update(host.metadata())
    if before is None:
        host.graph.extend(nodes)
    elif nodes:
        host.graph.insert_before(before, nodes)


def lower_recurrent(graph: ir.Graph) -> int:
    """Replace every RNN, GRU and LSTM node of ``graph`` by its unrolled ops, in place.

    Call it on the forward graph before differentiating; outputs keep their names, so graph
    outputs and later consumers are unchanged.

    Returns:
        The number of nodes replaced.

    Raises:
        GradientError: A sequence length that is not static, or an unsupported attribute.
    """
    targets = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type in RECURRENT_OPS]
    if not targets:
        return 0
    host = Builder(graph, role=Role.FORWARD, scope="unroll")
    opset = graph.opset_imports.get("", 18)
    for node in targets:
        b, stand_ins = _scratch(node, opset, Role.FORWARD)
        outs = unroll(b, node, stand_ins)
        pairs = [(old, new) for old, new in zip(node.outputs, outs, strict=True)
                 if new is not None and (old.uses() or old.is_graph_output())]
        bindings = {s: v for s, v in zip(stand_ins, node.inputs, strict=False) if s is not None and v is not None}
        _inline(b.graph, host, bindings, [new for _, new in pairs], node.name or node.op_type, node)
        for old, new in pairs:
            name = old.name
            new.dtype, new.shape = old.dtype, old.shape
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name = None
            new.name = name
        graph.remove(node, safe=True)
        logger.debug("unrolled %s node '%s' into primitive ops", node.op_type, node.name)
    return len(targets)


def _recurrent_grad(ctx: GradContext, node: ir.Node, *dys: V | None) -> tuple:
    """Recompute the unrolled forward in a scratch graph, differentiate it, inline the result."""
    opset = ctx.graph.opset_imports.get("", 18)
    b, stand_ins = _scratch(node, opset, ctx.role)
    outs = unroll(b, node, stand_ins)
    terms = []
    bindings = {s: v for s, v in zip(stand_ins, node.inputs, strict=False) if s is not None and v is not None}
    for k, (dy, out, fwd) in enumerate(zip(dys, outs, node.outputs, strict=False)):
        if dy is None or out is None:
            continue
        seed = ir.Value(name=f"d_out{k}", type=fwd.type or dy.type, shape=fwd.shape)
        b.graph.inputs.append(seed)
        bindings[seed] = dy
        # <out, dy> summed: its gradient with respect to the inputs is the vector-Jacobian product.
        terms.append(b.op("ReduceSum", b.op("Mul", out, seed), keepdims=0))
    loss = terms[0] if len(terms) == 1 else b.op("Sum", *terms)
    onnx_ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(
        ir.Model(b.graph, ir_version=10))
    wanted = [(i, s) for i, s in enumerate(stand_ins) if s is not None and ctx.needs(i)]
    grads = differentiate(b.graph, loss, [s for _, s in wanted], opset=opset)
    by_index = {i: grads[s.name or ""] for i, s in wanted}
    _inline(b.graph, ctx, bindings, list(by_index.values()), f"{ctx.scope}/{node.name}", None)
    return tuple(by_index.get(i) for i in range(len(node.inputs)))


for _op in RECURRENT_OPS:
    register(_op, opsets=(14, None))(_recurrent_grad)
