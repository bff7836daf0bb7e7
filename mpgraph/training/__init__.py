"""Turn a forward ONNX model into one training-step graph in standard ONNX ops.

``build_training_graph`` loads a copy of the model (``load_forward``: opsets below 18 are
upgraded, shapes inferred) and runs these passes and phases on it:

1. ``NormalizeForwardPass``: names, parameters the exporter merged untied (and graphs where
   it folded some refused: ``UntieExportedParametersPass``), constant weights, sequence
   splits as ``Split``, folded constants.
2. ``AttachLossPass``: the loss output, or an attached ``cross_entropy`` / ``mse``.
3. ``SetBatchNormModePass``: BatchNormalization in training mode, running statistics as
   state (or eval mode).
4. ``SelectParametersPass``: the parameters (``params`` patterns, explicit inputs, what
   torch's dynamo exporter marks as parameters, or float initializers), minus ``freeze``.
5. The **backward** pass (``mpgraph.autodiff``) from a ``grad/seed`` value, then the
   **optimizer** (``mpgraph.optim``) with the learning rate as an input ``lr`` and fp32 state
   inputs (step counter, moments).
6. **Outputs and metadata.** Outputs: the loss, updated parameters (``<param>/updated``) and
   updated state; ``MODEL_STATE_PAIRS`` pairs every state input with its output; every node
   carries a role; the result passes the full checker and strict shape inference.

Every state input (parameters included) also has a same-named initializer holding its
initial value, so the saved step graph is self-contained.

Example:
    >>> import onnx_ir as ir, numpy as np
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 3]))
    >>> w = ir.Value(name="w", const_value=ir.tensor(np.ones((3, 2), np.float32), name="w"))
    >>> mm = ir.Node("", "MatMul", [x, w], name="mm")
    >>> mm.outputs[0].name = "y"
    >>> g = ir.Graph([x], [mm.outputs[0]], nodes=[mm], initializers=[w], opset_imports={"": 18})
    >>> step = build_training_graph(ir.Model(g, ir_version=8), optimizer="sgd", loss="mse")
    >>> [v.name for v in step.graph.outputs]
    ['loss', 'w/updated']
"""

from __future__ import annotations

from mpgraph.training.attach_loss import BUILTIN_LOSSES, AttachLossPass, LossResult, find_logits
from mpgraph.training.build import LR_INPUT, MAX_IR_VERSION, build_training_graph, state_pairs
from mpgraph.training.fold_constant_subgraphs import FoldConstantSubgraphsPass
from mpgraph.training.normalize_forward import (
    MIN_OPSET,
    ForwardModel,
    NormalizeForwardPass,
    load_forward,
    refuse_step_graph,
)
from mpgraph.training.options import optimizer_options
from mpgraph.training.select_parameters import ParametersResult, SelectParametersPass
from mpgraph.training.set_batchnorm_mode import (
    SetBatchNormModePass,
    StateResult,
    training_batchnorms,
)
from mpgraph.training.untie_exported_parameters import UntieExportedParametersPass

__all__ = [
    "BUILTIN_LOSSES",
    "LR_INPUT",
    "MAX_IR_VERSION",
    "MIN_OPSET",
    "AttachLossPass",
    "FoldConstantSubgraphsPass",
    "ForwardModel",
    "LossResult",
    "NormalizeForwardPass",
    "ParametersResult",
    "SelectParametersPass",
    "SetBatchNormModePass",
    "StateResult",
    "UntieExportedParametersPass",
    "build_training_graph",
    "find_logits",
    "load_forward",
    "optimizer_options",
    "refuse_step_graph",
    "state_pairs",
    "training_batchnorms",
]
