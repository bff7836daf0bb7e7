"""Specialise a graph to fixed input shapes, so shape arithmetic folds away.

A step graph exported with a symbolic batch dimension computes shapes at run time:
``Shape``/``Size``/``Gather``/``Concat`` chains on int64 values that ONNX Runtime places on the
CPU provider, and float scalars derived from them (the element count in a mean's backward).
Such CPU nodes stop ORT from capturing the step as a CUDA graph (a CPU result that a CUDA node
reads needs a copy node, and ORT refuses capture when a graph has one). With every input shape
fixed, those chains are constants:

1. Every symbolic dimension of the named inputs becomes the given size.
2. Shape inference runs again, so every intermediate value has a static shape.
3. ``Shape``, ``Size`` and the integer arithmetic on them are constant-folded (onnxscript's
   folder), and nodes left without consumers are removed.
4. Steps 2 and 3 repeat while a round folds something (a folded constant can give the values
   after it static shapes only in the next round's inference).

Values that depend on data (parameters, batches, state) are never folded: they are graph
inputs, and an initializer that is also a graph input is an overridable default, not a constant.

Example:
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")
    >>> fixed = specialize_shapes(step, {"x": (64, 4), "label": (64,)})
    >>> [sum(n.op_type in ("Shape", "Size") for n in g.graph) for g in (step, fixed)]
    [2, 0]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import onnx_ir as ir
import onnx_ir.passes.common

from mpgraph.errors import MpgraphError
from mpgraph.io import as_model

__all__ = ["specialize_shapes", "shape_ops"]

logger = logging.getLogger(__name__)

_SHAPE_OPS = frozenset({"Shape", "Size"})


def shape_ops(model: ir.Model) -> int:
    """How many ``Shape``/``Size`` nodes the graph computes at run time."""
    return sum(1 for node in model.graph if node.op_type in _SHAPE_OPS)


def specialize_shapes(model: ir.Model, shapes: Mapping[str, Sequence[int]]) -> ir.Model:
    """A copy of ``model`` with the named inputs' shapes fixed and shape arithmetic folded.

    Args:
        model: Any model (a training step graph, typically).
        shapes: Graph input name -> its concrete shape.

    Returns:
        The specialised copy; the metadata is kept.

    Raises:
        MpgraphError: A name is not a graph input, or a shape contradicts a static dim.
    """
    m = as_model(model, copy=True)
    inputs = {v.name: v for v in m.graph.inputs}
    for name, shape in shapes.items():
        value = inputs.get(name)
        if value is None:
            raise MpgraphError(f"cannot fix the shape of '{name}': not a graph input ({', '.join(n for n in inputs if n)[:200]})")
        dims = [int(d) for d in shape]
        if value.shape is not None:
            declared = list(value.shape)
            if len(declared) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(declared, dims)):
                raise MpgraphError(f"input '{name}' is declared {declared}; cannot fix it to {dims}")
        value.shape = ir.Shape(dims)
    before = counts = shape_ops(m), len(m.graph)
    for _ in range(_MAX_ROUNDS):
        _infer_and_fold(m)
        after = shape_ops(m), len(m.graph)
        if after == counts:
            break
        counts = after
    logger.info("specialised to %s: Shape/Size %d -> %d, nodes %d -> %d",
                dict(shapes), before[0], after[0], before[1], after[1])
    return m


#: Rounds of inference and folding at most. A round's folding makes constants that inference
#: did not see (a gradient Split's sizes, folded from Shape arithmetic), so the values after them
#: get static shapes, and their own Shape reads fold, only in the next round (the Llama-style
#: rotary backward: 8 Shape nodes left after one round, none after two).
_MAX_ROUNDS = 4


def _infer_and_fold(m: ir.Model) -> None:
    """One round: shapes inferred anew for every value without a static one, then constant
    folding and dead-node removal."""
    import onnxscript.optimizer  # an optional speed path: imported only when used

    # Intermediate shapes inferred for the symbolic batch would otherwise win over the new ones.
    for node in m.graph:
        for out in node.outputs:
            if out.shape is not None and not all(isinstance(d, int) for d in out.shape):
                out.shape = None
    try:
        # No data propagation: onnx would treat a flat optimizer's 1-D Concat of every parameter as
        # shape data (out of memory at 118M parameters); the folder infers what it folds.
        ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=False)(m)
    except Exception as e:  # noqa: BLE001 - inference failures are many types
        logger.warning("shape inference after fixing shapes failed (%s); folding what is known", e)
    onnxscript.optimizer.fold_constants(m)
    ir.passes.common.RemoveUnusedNodesPass()(m)
