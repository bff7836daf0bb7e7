"""Evaluate the subgraphs of a forward model that read only constants (no model is run:
onnx's reference evaluator computes them in numpy)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from mpgraph.errors import first_line
from mpgraph.io import min_ir_version
from mpgraph.optypes import NONDETERMINISTIC_OPS
from mpgraph.training.select_parameters import parameter_like

__all__ = ["FoldConstantSubgraphsPass"]

logger = logging.getLogger(__name__)

#: Folded results larger than this (elements) stay computed, so the graph does not grow.
_FOLD_LIMIT = 1 << 20


class FoldConstantSubgraphsPass(ir.passes.InPlacePass):
    """Evaluate subgraphs that only read constants, and put Constant nodes in their place.

    Exporters compute pads, axes and shapes from chains of Constant, Cast, Concat and Reshape
    nodes (the TorchScript Swin's ``Pad``); gradient rules need those values as constants.

    Rules:

    1. A node folds when every input is a Constant output, a non-parameter initializer or an
       already folded value. Anything reading a parameter (``parameter_like``, with the same
       ``params`` patterns as ``SelectParametersPass``) or a graph input stays, and so do
       random ops, Dropout and nodes with subgraphs.
    2. Only folded values read outside the folded set (or graph outputs) are evaluated, by
       onnx's reference evaluator (numpy; building a step graph runs no model on ONNX
       Runtime); when it cannot evaluate them, nothing changes (a warning says why).
    3. Results become Constant nodes named ``<producer>/folded`` (the value keeps its name),
       rather than initializers, since a float initializer would be a parameter.
    4. Results of more than ``_FOLD_LIMIT`` elements, and graph outputs, stay computed.
    5. Folded nodes other than Constants that nothing reads any more are removed.

    Example:
        >>> import numpy as np
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
        >>> c = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.float32([1, 2])))], name="c")
        >>> neg = ir.Node("", "Neg", c.outputs, name="neg")
        >>> add = ir.Node("", "Add", [x, neg.outputs[0]], name="add")
        >>> for n in (c, neg, add): n.outputs[0].name, n.outputs[0].dtype = n.name, ir.DataType.FLOAT
        >>> graph = ir.Graph([x], add.outputs, nodes=[c, neg, add], opset_imports={"": 18})
        >>> FoldConstantSubgraphsPass(inputs_mark_params=True)(ir.Model(graph, ir_version=8)).modified
        True
        >>> [n.name for n in graph], ir.convenience.get_const_tensor(add.inputs[1]).numpy().tolist()
        (['c', 'neg/folded', 'add'], [-1.0, -2.0])
    """

    def __init__(self, inputs_mark_params: bool, params: Sequence[str] = ()) -> None:
        super().__init__()
        self.inputs_mark_params = inputs_mark_params
        self.params = tuple(params)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        folding = _foldable(graph, parameter_like(graph, self.inputs_mark_params, self.params))
        computed = [n for n in folding if n.op_type != "Constant"]
        folded_nodes = set(computed)
        # Only values read outside the folded set are materialized (and only plain tensors).
        frontier = [o for n in computed for o in n.outputs
                    if isinstance(o.type, ir.TensorType) and o.dtype not in (None, ir.DataType.STRING)
                    and (o.is_graph_output() or any(u not in folded_nodes for u, _ in o.uses()))]
        if not frontier:
            return ir.passes.PassResult(model, False)
        values = _evaluate(graph, folding, frontier)
        if values is None:
            return ir.passes.PassResult(model, False)
        count = 0
        for value, array in zip(frontier, values):
            if array.size > _FOLD_LIMIT or value.is_graph_output():
                continue
            _replace_with_constant(graph, value, array)
            count += 1
        removed = _remove_unused(graph, folded_nodes)
        if count:
            logger.info("folded %d constant subgraph values into Constant nodes", count)
        return ir.passes.PassResult(model, count > 0 or removed > 0)


def _evaluate(graph: ir.Graph, nodes: list[ir.Node], values: list[ir.Value]) -> list[np.ndarray] | None:
    """Rule 2: ``values`` computed from ``nodes`` (constant inputs only) of ``graph``; ``None``
    (with a warning) when the reference evaluator cannot, since folding is an optimization."""
    from onnx.reference import ReferenceEvaluator  # imported when something folds

    inits = sorted({v.name for n in nodes for v in n.inputs if v is not None and v.is_initializer() and v.name})
    # A view: the nodes stay in ``graph``.
    view = ir.GraphView([], values, nodes=nodes, initializers=[graph.initializers[name] for name in inits],
                        opset_imports=dict(graph.opset_imports), name="fold")
    try:
        proto = ir.to_proto(ir.Model(view, ir_version=max(8, min_ir_version(graph.opset_imports))))  # type: ignore[arg-type]
        evaluator = ReferenceEvaluator(proto, new_ops=[_gather_elements()])
        return [np.asarray(a) for a in evaluator.run([v.name or "" for v in values], {})]
    except Exception as e:  # noqa: BLE001 - the evaluator raises many types; folding is an optimization
        logger.warning("constant folding skipped: the reference evaluator cannot evaluate the constant subgraphs (%s)",
                       first_line(e))
        return None


@functools.cache
def _gather_elements() -> type:
    """``GatherElements`` for the reference evaluator, by ``np.take_along_axis``: onnx 1.23's own
    goes through ``np.choose``, which takes at most 64 arrays, and its fallback is wrong for any
    index but ``[n, 1]`` ("cannot reshape array of size 1 into shape (1,64)"): the TorchScript
    BERT's ``token_type_ids`` (a buffer gathered at the position ids, 512 long) did not fold, and
    its gradient was Shape arithmetic on ORT's CPU provider."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:
            axis = axis % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data, indices.astype(np.int64), axis=axis),)

    return GatherElements


def _foldable(graph: ir.Graph, params: set[ir.Value]) -> list[ir.Node]:
    """Rule 1: the Constant nodes and the nodes that read only constants, in graph order."""
    constant: set[ir.Value] = {v for v in graph.initializers.values() if v not in params and not v.is_graph_input()}
    folding: list[ir.Node] = []
    for node in graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            constant.update(node.outputs)
            folding.append(node)
        elif (node.domain in ("", "ai.onnx") and node.op_type not in NONDETERMINISTIC_OPS and node.inputs
              and all(v is None or v in constant for v in node.inputs)
              and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())):
            constant.update(node.outputs)
            folding.append(node)
    return folding


def _replace_with_constant(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    """Rule 3: a Constant node holding ``array`` takes ``value``'s place and name."""
    name = value.name
    producer = value.producer()
    assert producer is not None and name is not None
    const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array, name=name))], name=f"{producer.name}/folded")
    graph.insert_before(producer, const)
    value.replace_all_uses_with(const.outputs[0])
    value.name = None
    const.outputs[0].name = name
    const.outputs[0].dtype, const.outputs[0].shape = ir.DataType.from_numpy(array.dtype), ir.Shape(array.shape)


def _remove_unused(graph: ir.Graph, nodes: set[ir.Node]) -> int:
    """Rule 5; returns how many nodes were removed."""
    removed = 0
    for node in reversed(list(graph)):
        if node in nodes and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)
            removed += 1
    return removed
