"""A weight gradient built as per-tap slices, rebuilt as one Conv for ORT CPU's NCHWc kernels.

The Conv rule picks each layer's weight-gradient form from measurements on ORT CPU's plain
kernels (``mpgraph.autodiff.rules.pool_conv._weight_grad_form``). For small unit-stride maps
it writes one ``Slice`` of the input per kernel tap and one ``MatMul`` per tap::

    xt = Transpose(x, [1, 0, 2, 3])                                    # [C, N, H, W]
    rows = Reshape(Transpose(dy, [0, 2, 3, 1]), [-1, M])               # [N*P*Q, M]
    part_t = MatMul(Reshape(Slice(xt, (i, j), (i + P, j + Q)), [C, -1]), rows)   # per tap
    dW = Reshape(Transpose(Reshape(Concat(parts), [taps, C, M]), [2, 1, 0]), [M, C, kh, kw])

because the single-Conv form ran 1.2-2.1x slower there at 3x3. Once that Conv runs on the
blocked kernels (``nchwc.to_nchwc``) and the filter reorders on ``Permute``, the comparison
turns: on the Nature DQN's 3x3/1 layer (batch 32, 2 threads) the slices took 5.6 ms a step
(ORT's Slice copies rows of 7 floats) and the one blocked Conv 2.3 ms with its reorders
(``benchmarks/results/dqn_cpu_kernels_ab.txt``). ``slices_to_conv`` finds the pattern above and writes
``Transpose(Conv(xt, Transpose(dy, [1, 0, 2, 3])), [1, 0, 2, 3])`` instead, the rule's own
single-Conv form; ``to_nchwc`` then moves that Conv. Same sums, another order.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import consts, hand_over, perm, producer

__all__ = ["slices_to_conv"]


def _tap(part: ir.Value | None, rows: ir.Value, c: int) -> tuple[ir.Node, ir.Node, ir.Node, list[int], list[int]] | None:
    """``(MatMul, Reshape, Slice, starts, ends)`` of one tap's
    ``MatMul(Reshape(Slice(xt), [c, -1]), rows)``."""
    matmul = producer(part, "MatMul")
    if matmul is None or matmul.inputs[1] is not rows:
        return None
    reshape = producer(matmul.inputs[0], "Reshape")
    if reshape is None or consts(reshape.inputs[1]) != [c, -1]:
        return None
    piece = producer(reshape.inputs[0], "Slice")
    if piece is None or len(piece.inputs) < 4:
        return None
    starts, ends, axes = (consts(v) for v in piece.inputs[1:4])
    steps = consts(piece.inputs[4]) if len(piece.inputs) > 4 else [1, 1]
    if starts is None or ends is None or axes != [2, 3] or steps != [1, 1]:
        return None
    return matmul, reshape, piece, starts, ends  # type: ignore[return-value]


def _reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """``value``'s one reader when it is an ``op_type`` node and ``value`` no graph output."""
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output() or uses[0].node.op_type != op_type:
        return None
    return uses[0].node


def _match(concat: ir.Node) -> tuple | None:
    """``(xt, dy, out, kernel, size, nodes)`` when ``concat`` joins the slices form above."""
    axis = concat.attributes.get("axis")
    if concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx") or axis is None or axis.as_int() != 0:
        return None
    stack = _reader(concat.outputs[0], "Reshape")
    swap = _reader(stack.outputs[0], "Transpose") if stack is not None else None
    final = _reader(swap.outputs[0], "Reshape") if swap is not None and perm(swap) == [2, 1, 0] else None
    shape = consts(final.inputs[1]) if final is not None else None
    first = producer(concat.inputs[0], "MatMul")
    rows = producer(first.inputs[1], "Reshape") if first is not None else None
    dy_rows = producer(rows.inputs[0], "Transpose") if rows is not None else None
    if shape is None or len(shape) != 4 or dy_rows is None or perm(dy_rows) != [0, 2, 3, 1]:
        return None
    m, c, kernel = shape[0], shape[1], shape[2:]
    layouts = (consts(rows.inputs[1]), consts(stack.inputs[1]))  # type: ignore[union-attr]
    if layouts != ([-1, m], [kernel[0] * kernel[1], c, m]):  # the rule's reshapes, not look-alikes
        return None
    taps = [_tap(part, rows.outputs[0], c) for part in concat.inputs]  # type: ignore[union-attr]
    if len(taps) != kernel[0] * kernel[1] or any(t is None for t in taps):
        return None
    xt = taps[0][2].inputs[0]  # type: ignore[index]
    size = [e - s for s, e in zip(taps[0][3], taps[0][4])]  # type: ignore[index]
    for tap, start in zip(taps, np.ndindex(*kernel)):  # row-major taps, each the same window size
        if tap[2].inputs[0] is not xt or tap[3] != list(start) or [e - s for s, e in zip(tap[3], tap[4])] != size:  # type: ignore[index]
            return None
    transpose = producer(xt, "Transpose")
    dy = dy_rows.inputs[0]
    if transpose is None or perm(transpose) != [1, 0, 2, 3] or dy is None or xt.dtype != ir.DataType.FLOAT:  # type: ignore[union-attr]
        return None
    # producers before readers, so that _remove_dead, walking back, meets readers first
    nodes = [dy_rows, rows] + [n for t in taps for n in t[2::-1]] + [concat, stack, swap, final]  # type: ignore[index, list-item]
    return xt, dy, final.outputs[0], kernel, size, nodes  # type: ignore[union-attr]


def _remove_dead(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove those of ``nodes`` nothing reads any more (readers first)."""
    for node in reversed(nodes):
        if node.graph is graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def slices_to_conv(model: ir.Model, block: int, max_kernel: int) -> int:
    """Rebuild each per-tap-slices weight gradient in ``model``'s main graph as one Conv (see
    the module's docstring), in place, where ``to_nchwc`` then takes that Conv (``M`` a
    multiple of ``block``, ``P*Q`` at most ``max_kernel`` taps); how many were rebuilt."""
    graph = model.graph
    done = 0
    names: NameScope | None = None
    for node in list(graph):
        if node.graph is not graph:
            continue
        match = _match(node)
        if match is None:
            continue
        xt, dy, out, kernel, size, nodes = match
        m = out.shape[0] if out.shape is not None else None
        if not isinstance(m, int) or m % block or size[0] * size[1] > max_kernel:
            continue
        names = names or NameScope(graph)
        rw = Rewrite(graph, node.name or "concat", names=names)
        dyt = rw.node("Transpose", dy, perm=[1, 0, 2, 3], name="as_conv/SwapDy").outputs[0]
        conv = rw.node("Conv", xt, dyt, kernel_shape=size, name="as_conv", like=node).outputs[0]
        back = rw.node("Transpose", conv, perm=[1, 0, 2, 3], name="as_conv/Swap")
        dyt.shape = ir.Shape([m, dy.shape[0] if dy.shape is not None else None, *size])
        conv.shape = ir.Shape([xt.shape[0] if xt.shape is not None else None, m, *kernel])
        dyt.dtype = conv.dtype = ir.DataType.FLOAT
        graph.insert_before(nodes[-1], rw.nodes)
        hand_over([out], back.outputs)
        _remove_dead(graph, nodes)
        done += 1
    return done
