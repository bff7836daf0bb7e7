"""Run a CPU step graph's float32 transposes on the library's ``Permute`` (a session lowering).

ONNX Runtime's CPU ``Transpose`` has fast paths for a 2-D transpose (MLAS) and for a single
axis moved over whole rows; every other permutation walks a multi-index element by element.
The NCHWc filter reorders (``nchwc.py``: ``[co/B, B, ci/B, B, kh, kw]`` by ``[0, 2, 4, 5, 3,
1]``) took 7-12 ns an element there: 1.0-1.5 ms a step for the Nature DQN's 4x4/2 weight
gradient alone, whose "filter" is the batch's ``dy`` (``benchmarks/results/dqn_cpu_kernels_ab.txt``).
``Permute(x, perm)`` computes the same values (a copy: the bits are the input's) with axes that
stay adjacent merged and the output rows spread over the session's threads; an entry ``~a``
(``-1 - a``) reads axis ``a`` reversed, so a ``Slice`` that flips axes whole before the
``Transpose`` (the convolution rewrites' flipped filters) folds in.

``fast_transposes`` rewrites the float32 ``Transpose`` nodes that move the innermost axis
(ORT gathers those element by element) except where ORT does well or can fold them away: a
plain 2-D transpose once adjacent axes merge (MLAS's), and one that feeds a matrix multiply
(ORT's optimizer folds those into ``FusedMatMul``); one after a flip is rewritten whatever its
permutation. A permutation that keeps the innermost axis
last copies whole rows in ORT too (the weight-gradient convolutions' batch/channel swaps:
within 10% of ``Permute`` on the DQN's), and stays.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph._ir.rewrite import Rewrite
from mpgraph.lowering.match import DOMAIN, constant, hand_over
from mpgraph.lowering.match import perm as transpose_perm

__all__ = ["fast_transposes", "merged_perm"]

_MATMULS = frozenset({"MatMul", "Gemm", "FusedMatMul", "MatMulInteger"})


def merged_perm(perm: list[int]) -> list[int]:
    """``perm`` with the runs of axes that stay adjacent (``perm[k + 1] == perm[k] + 1``)
    merged into one axis each, renumbered.

    Example:
        >>> merged_perm([0, 2, 4, 5, 3, 1])  # the NCHWc filter reorder: 4 and 5 stay together
        [0, 2, 4, 3, 1]
        >>> merged_perm([0, 2, 3, 1])  # NCHW to NHWC: a 2-D transpose per image
        [0, 2, 1]
        >>> merged_perm([1, 2, 0])
        [1, 0]
    """
    runs: list[list[int]] = []
    for axis in perm:
        if runs and axis == runs[-1][-1] + 1:
            runs[-1].append(axis)
        else:
            runs.append([axis])
    order = sorted(range(len(runs)), key=lambda r: runs[r][0])
    rank = {r: i for i, r in enumerate(order)}
    return [rank[r] for r in range(len(runs))]


def _flipped(value: ir.Value, rank: int) -> tuple[ir.Value, set[int]] | None:
    """``(x, axes)`` when ``value`` is ``Slice(x)`` reversing ``axes`` whole (steps -1 from the
    last element past the first) and read only here; else ``None``."""
    node = value.producer()
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 5:
        return None
    starts, ends, axes, steps = (constant(v) for v in node.inputs[1:])
    if any(a is None for a in (starts, ends, axes, steps)) or len(value.uses()) != 1 or value.is_graph_output():
        return None
    if not (np.all(steps == -1) and np.all(starts == -1) and np.all(ends <= -(2**31))):  # type: ignore[operator]
        return None
    return node.inputs[0], {int(a) % rank for a in axes.reshape(-1)}  # type: ignore[union-attr]


def _rewritable(node: ir.Node) -> tuple[ir.Value, list[int]] | None:
    """``(input, Permute's perm)`` when ``fast_transposes`` rewrites ``node``, else ``None``."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    x = node.inputs[0]
    perm = transpose_perm(node)
    if x is None or perm is None or any(reader.op_type in _MATMULS for reader, _ in node.outputs[0].uses()):
        return None
    flip = _flipped(x, len(perm))
    if flip is not None and flip[0].dtype == ir.DataType.FLOAT:  # the flip folds in: reversed axes written ~axis
        return flip[0], [~a if a in flip[1] else a for a in perm]
    if x.dtype != ir.DataType.FLOAT:
        return None
    merged = merged_perm(perm)
    if merged[-1] == len(merged) - 1 or merged == [1, 0]:
        return None  # whole rows (or nothing) to move, or MLAS's 2-D transpose
    return x, perm


def fast_transposes(model: ir.Model) -> int:
    """Rewrite ``model``'s main-graph float32 ``Transpose`` nodes onto ``Permute`` (see the
    module's docstring for which), in place; how many were rewritten."""
    graph = model.graph
    done = 0
    names: NameScope | None = None
    for node in list(graph):
        plan = _rewritable(node)
        if plan is None:
            continue
        x, perm = plan
        flip = node.inputs[0].producer() if x is not node.inputs[0] else None  # type: ignore[union-attr]
        names = names or NameScope(graph)
        rw = Rewrite(graph, node.name or "transpose", names=names)
        order = rw.constant("permute/perm", np.array(perm, np.int64))
        permute = rw.node("Permute", x, order, name="permute", domain=DOMAIN, like=node)
        graph.insert_before(node, permute)
        hand_over(node.outputs, permute.outputs)
        graph.remove(node, safe=True)
        if flip is not None:
            graph.remove(flip, safe=True)
        done += 1
    if done:
        model.opset_imports.setdefault(DOMAIN, 1)
    return done
