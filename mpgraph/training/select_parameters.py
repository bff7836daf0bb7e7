"""Decide which values of a forward model are trained, and make them graph inputs."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Collection, Sequence

import onnx_ir as ir

from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import GradientError
from mpgraph.training._common import name_of
from mpgraph.training.untie_exported_parameters import torch_parameter_names

__all__ = ["ParametersResult", "SelectParametersPass", "parameter_like"]


def parameter_like(graph: ir.Graph, inputs_mark_params: bool, params: Sequence[str] = ()) -> set[ir.Value]:
    """Initializers that ``SelectParametersPass`` may make parameters (before freeze).

    Constant folding never folds these.
    """
    return set(_inferred(graph, inputs_mark_params, params))


def _inferred(graph: ir.Graph, inputs_mark_params: bool, params: Sequence[str],
              exclude: Collection[str] = ()) -> list[ir.Value]:
    """Rules 1 to 4 and 8 of ``SelectParametersPass``, in graph-input or initializer order."""
    floats = {n: v for n, v in graph.initializers.items() if v.dtype in FLOAT_TYPES and n not in exclude}
    if params:
        for pattern in params:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in floats):
                raise GradientError(f"params pattern '{pattern}' matches no float initializer "
                                    f"(initializers: {_first(list(floats))})")
        return [v for n, v in floats.items() if any(fnmatch.fnmatchcase(n, p) for p in params)]
    explicit = [v for v in graph.inputs if v.name in floats] if inputs_mark_params else []
    if explicit:
        return explicit
    marked = torch_parameter_names(graph)
    if marked is not None:
        return [v for n, v in floats.items() if n in marked]
    return [v for v in floats.values() if v.shape is not None and len(v.shape) >= 1]


def _first(names: list[str]) -> str:
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


@dataclasses.dataclass
class ParametersResult(ir.passes.PassResult):
    """``PassResult`` with the parameters, in graph-input order (explicit) or initializer order."""

    params: list[ir.Value] = dataclasses.field(default_factory=list)


class SelectParametersPass(ir.passes.InPlacePass):
    """Pick the parameters: the values the step differentiates and updates.

    Rules:

    1. ``params`` patterns (fnmatch), when given, name the candidates: every float
       initializer that one matches, nothing inferred; a pattern that matches none is an
       error naming the first initializers. Float graph inputs with initializers that no
       pattern matches become constants (they leave the inputs).
    2. Otherwise, when the model marks parameters explicitly (float graph inputs with
       same-named initializers, as ``torch.onnx`` with parameters as inputs produces), those
       are the candidates.
    3. Otherwise, when torch's dynamo exporter wrote the graph, the initializers it marks as
       parameters (``UntieExportedParametersPass`` has given merged ones back): buffers
       (rotary ``inv_freq``), lifted constants and what its optimizer folded (attention
       masks such as ``val_74``, rotary caches) are constants.
    4. Otherwise every float initializer of rank >= 1.
    5. ``trainable_inputs`` patterns add float graph inputs; a pattern that matches none is
       an error.
    6. ``freeze`` patterns keep candidates fixed; a pattern that matches no candidate is an
       error naming the first candidates. A frozen parameter that was a graph input becomes
       a constant (it leaves the inputs).
    7. Every parameter is a graph input. No parameter at all is an error.
    8. Values named in ``exclude`` (BatchNorm running statistics: state, not parameters) are
       never parameters.

    Example:
        >>> import numpy as np
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
        >>> w = ir.Value(name="w", const_value=ir.tensor(np.float32([1, 2]), name="w"))
        >>> w.dtype, w.shape = ir.DataType.FLOAT, ir.Shape([2])
        >>> mul = ir.Node("", "Mul", [x, w], name="mul")
        >>> graph = ir.Graph([x], mul.outputs, nodes=[mul], initializers=[w], opset_imports={"": 18})
        >>> result = SelectParametersPass(inputs_mark_params=True)(ir.Model(graph, ir_version=8))
        >>> result.modified, [p.name for p in result.params], [v.name for v in graph.inputs]
        (True, ['w'], ['x', 'w'])
    """

    def __init__(self, freeze: Sequence[str] = (), trainable_inputs: Sequence[str] = (),
                 exclude: Collection[str] = (), *, inputs_mark_params: bool, params: Sequence[str] = ()) -> None:
        super().__init__()
        self.params = tuple(params)
        self.freeze = tuple(freeze)
        self.trainable_inputs = tuple(trainable_inputs)
        self.exclude = frozenset(exclude)
        self.inputs_mark_params = inputs_mark_params

    def call(self, model: ir.Model) -> ParametersResult:
        graph = model.graph
        candidates = self._candidates(graph)
        for pattern in self.freeze:
            if not any(fnmatch.fnmatchcase(name_of(v), pattern) for v in candidates):
                raise GradientError(f"freeze pattern '{pattern}' matches no parameter "
                                    f"(parameters: {_first([name_of(v) for v in candidates])})")
        params = [v for v in candidates if not any(fnmatch.fnmatchcase(name_of(v), p) for p in self.freeze)]
        inputs_before = list(graph.inputs)
        dropped = candidates
        if self.params:  # parameters the patterns leave out are constants too
            dropped = [v for v in graph.inputs if v.is_initializer() and v.dtype in FLOAT_TYPES]
        for v in dropped:
            if v not in params and v.is_graph_input() and v.is_initializer():
                graph.inputs.remove(v)  # a frozen parameter is a constant
        for v in params:
            if not v.is_graph_input():
                graph.inputs.append(v)
        if not params:
            raise GradientError(
                "nothing to train: the model has no float parameters (or all are frozen); "
                "pass trainable_inputs to differentiate with respect to graph inputs"
            )
        return ParametersResult(model, list(graph.inputs) != inputs_before, params)

    def _candidates(self, graph: ir.Graph) -> list[ir.Value]:
        """Rules 1 to 5 and 8."""
        candidates = _inferred(graph, self.inputs_mark_params, self.params, self.exclude)
        for pattern in self.trainable_inputs:
            matched = [v for v in graph.inputs if fnmatch.fnmatchcase(name_of(v), pattern)
                       and v.dtype in FLOAT_TYPES and v not in candidates and v.name not in self.exclude]
            if not matched:
                raise GradientError(f"trainable input pattern '{pattern}' matches no float graph input")
            candidates += matched
        return candidates
