"""Turn a forward ONNX model into one training-step graph in standard ONNX ops.

``build_training_graph`` runs these phases on an onnx-ir copy of the model:

1. **Normalize.** Shape inference; opsets below 18 are upgraded to 18 (errors still name the
   model's own opset); a warning when the exporter folded BatchNorm into convolutions; unnamed
   nodes get deterministic names; ``ConstantOfShape`` weights with a constant shape (as in
   compressed "light" model files) become initializers; initializers the exporter deduplicated
   behind ``Identity`` nodes are untied; constant-only subgraphs are folded.
2. **Loss.** Use a loss output of the graph (``loss=None`` picks an output named ``loss``, or
   the only output when it is a float scalar; ``loss="<output name>"`` picks another), or
   attach ``cross_entropy`` (classes on the last axis, int64 label shaped like the output
   without it) / ``mse`` (float target shaped like the output) to the first float output, with
   a new input ``label``.
3. **Training mode.** BatchNormalization runs in training mode; its running statistics
   become state inputs of its own paired with the updated statistics (ONNX semantics: the
   running variance is updated with the biased batch variance).
4. **Parameters.** When the model marks parameters explicitly (float graph inputs with
   same-named initializers, as ``torch.onnx`` with parameters as inputs produces), those are
   the parameters; otherwise every float initializer of rank >= 1. ``freeze`` patterns
   (fnmatch) keep some fixed; a pattern that matches nothing is an error.
5. **Backward** (``mpgraph.autodiff``), then the **optimizer** (``mpgraph.optim``) with the
   learning rate as an input ``lr`` and fp32 state inputs (step counter, moments).
6. **Outputs and metadata.** Outputs: the loss, updated parameters (``<param>/updated``) and
   updated state; ``MODEL_STATE_PAIRS`` pairs every state input with its output;
   every node carries a role; the result passes the full checker and strict shape inference.

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

import fnmatch
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from mpgraph.autodiff import differentiate
from mpgraph.autodiff.driver import FLOAT_TYPES, GradContext
from mpgraph.autodiff.rules import pool_conv
from mpgraph.autodiff.rules.groupnorm import infer_group_norm_types
from mpgraph.errors import GradientError, UnsupportedModelError, ValidationError
from mpgraph._ir.meta import (
    MODEL_GRAD_SEED,
    MODEL_GRADIENTS,
    MODEL_LOSS,
    MODEL_STATE_PAIRS,
    MODEL_TRAINING,
    NODE_ROLE,
)
from mpgraph.optim import make_optimizer
from mpgraph.runtime.probe import evaluate_nodes

__all__ = ["build_training_graph", "BUILTIN_LOSSES", "MIN_OPSET", "LR_INPUT", "state_pairs"]


#: The conv weight-gradient form per ``target`` (``None``: by layer shape, from ORT CPU
#: measurements). On ORT CUDA (H200) the one-hot im2col form beat the single Conv on the
#: Nature DQN's 8x8/4 (0.085 vs 0.309 ms) and 4x4/2 layers (0.074 vs 0.117 ms).
TARGET_WEIGHT_GRAD_FORM: dict[str, str | None] = {"cpu": None, "cuda": "im2col"}

logger = logging.getLogger(__name__)

BUILTIN_LOSSES = ("cross_entropy", "mse")
MIN_OPSET = 18
#: ONNX Runtime 1.31 refuses models with a higher ir_version (opset 28 needs 14).
MAX_IR_VERSION = 13
LR_INPUT = "lr"
_LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
_DEFAULT_LR = {"sgd": 1e-2, "adam": 1e-3, "adamw": 1e-3}
#: Ops never folded: random generators (and Dropout) give a new value every run.
_NO_FOLD = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                      "Bernoulli", "Dropout"})
#: Folded results larger than this (elements) stay computed, so the graph does not grow.
_FOLD_LIMIT = 1 << 20


def _name(value: ir.Value) -> str:
    assert value.name is not None, "graph values are named by _name_nodes"
    return value.name


def state_pairs(model: ir.Model) -> list[tuple[str, str]]:
    """``[(state input, updated output)]`` recorded on a training step graph."""
    raw = model.metadata_props.get(MODEL_STATE_PAIRS)
    return [] if raw is None else [(a, b) for a, b in json.loads(raw)]


def _normalize(model: ir.Model | onnx.ModelProto | str | os.PathLike[str]) -> tuple[ir.Model, bool, int]:
    """The model as onnx-ir at opset >= 18 with inferred shapes, whether its graph inputs
    can mark parameters (IR < 4 lists every initializer as an input, so they cannot), and the
    model's own opset (errors name it, not the one it was upgraded to)."""
    if isinstance(model, (str, os.PathLike)):
        proto = onnx.load(str(model))
    elif isinstance(model, ir.Model):
        proto = ir.to_proto(model)
    else:
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    if any(n.op_type in ("If", "Loop", "Scan") for n in proto.graph.node):
        raise UnsupportedModelError("control flow (If/Loop/Scan) is not supported by train-graph")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET)
    inputs_mark_params = proto.ir_version >= 4
    if opset < 7:
        _legacy_prelu_slopes(proto)
    if opset < MIN_OPSET:
        proto.ir_version = max(proto.ir_version, 8)
        _inputs_for_initializers(proto)
        try:
            proto = onnx.version_converter.convert_version(proto, MIN_OPSET)
        except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors
            raise UnsupportedModelError(f"cannot upgrade opset {opset} to {MIN_OPSET}: {str(e).splitlines()[0]}") from None
    try:
        proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as e:  # noqa: BLE001
        logger.warning("shape inference failed (%s); continuing with partial shapes", e)
    return ir.from_proto(proto), inputs_mark_params, opset


def _legacy_prelu_slopes(proto: onnx.ModelProto) -> None:
    """Before opset 7 a 1-D PRelu slope applied per channel; make that explicit ([C, 1, ...])."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in list(inferred.graph.input) + list(inferred.graph.value_info)}
    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "PRelu" or node.input[1] not in inits:
            continue
        slope, rank = inits[node.input[1]], ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            new_dims = [slope.dims[0]] + [1] * (rank - 2)
            del slope.dims[:]
            slope.dims.extend(new_dims)
            for value in proto.graph.input:
                if value.name == slope.name:
                    value.type.tensor_type.shape.CopyFrom(onnx.helper.make_tensor_type_proto(slope.data_type, new_dims).tensor_type.shape)


def _inputs_for_initializers(proto: onnx.ModelProto) -> None:
    """Old IR versions list initializers as inputs; newer converters reject the mismatch."""
    names = {i.name for i in proto.graph.input}
    for init in proto.graph.initializer:
        if init.name not in names:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))


def _name_nodes(graph: ir.Graph) -> None:
    used = {n.name for n in graph if n.name}
    for i, node in enumerate(graph):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in used:
                name += "_"
            node.name = name
            used.add(name)
        for k, out in enumerate(node.outputs):
            if not out.name:
                out.name = f"{node.name}/output_{k}"


def _materialize_constant_weights(graph: ir.Graph) -> None:
    for node in list(graph):
        if node.op_type != "ConstantOfShape" or node.outputs[0].is_graph_output():
            continue
        dims = ir.convenience.get_const_tensor(node.inputs[0]) if node.inputs[0] is not None else None
        if dims is None:
            continue
        attr = node.attributes.get("value")
        fill = attr.value.numpy().reshape(-1) if attr is not None else np.zeros(1, np.float32)
        if fill.dtype.kind != "f" or dims.numpy().size == 0:
            continue
        out = node.outputs[0]
        array = np.full([int(d) for d in dims.numpy()], fill[0], dtype=fill.dtype)
        value = ir.Value(name=out.name, const_value=ir.tensor(array, name=out.name),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=ir.Shape(array.shape))
        out.name = None
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        graph.register_initializer(value)


def _untie_identity_initializers(graph: ir.Graph) -> int:
    """Give every float initializer reached through an ``Identity`` its own initializer.

    The TorchScript exporter deduplicates equal-valued initializers (all LayerNorm weights, all
    zero biases, BatchNorm scales and running variances) and brings each dropped one back as an
    ``Identity`` named after it. torch trains those tensors apart, so each Identity-named value
    becomes a separate initializer (a parameter, or BatchNorm state) with the same value.
    Truly tied weights (GPT-2's lm_head and wte) are one initializer used directly, with no
    Identity, and stay tied. Returns the number of untied values.
    """
    untied = 0
    for node in list(graph):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        source, out = node.inputs[0], node.outputs[0]
        if (source is None or not source.is_initializer() or source.const_value is None
                or source.dtype not in FLOAT_TYPES or out.is_graph_output() or not out.name):
            continue
        name = out.name
        tensor = ir.tensor(source.const_value.numpy(), name=name)
        value = ir.Value(name=None, type=source.type, shape=source.shape, const_value=tensor)
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        out.name = None
        value.name = name
        graph.register_initializer(value)
        if source.is_graph_input():  # parameters marked as graph inputs: the copy is one too
            graph.inputs.insert(graph.inputs.index(source) + 1, value)
        untied += 1
    if untied:
        logger.info("untied %d initializers that the exporter had deduplicated behind Identity nodes", untied)
    return untied


def _parameter_like(graph: ir.Graph, inputs_mark_params: bool) -> set[ir.Value]:
    """Initializers that ``_select_params`` may make parameters (before freeze): never folded."""
    floats = [v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES]
    explicit = {v for v in floats if v.is_graph_input()} if inputs_mark_params else set()
    if explicit:
        return explicit
    return {v for v in floats if v.is_graph_input() or (v.shape is not None and len(v.shape) >= 1)}


def _fold_constants(graph: ir.Graph, inputs_mark_params: bool) -> int:
    """Evaluate subgraphs that only read constants, and put Constant nodes in their place.

    Exporters compute pads, axes and shapes from chains of Constant, Cast, Concat and Reshape
    nodes (the TorchScript Swin's ``Pad``); gradient rules need those values as constants. A
    node folds when every input is a Constant output, a non-parameter initializer or an already
    folded value; anything reading a parameter or a graph input stays. The results become
    Constant nodes rather than initializers, since a float initializer would be a parameter.
    Results of more than ``_FOLD_LIMIT`` elements stay computed. Returns the number of values
    folded.
    """
    params = _parameter_like(graph, inputs_mark_params)
    constant: set[ir.Value] = {v for v in graph.initializers.values() if v not in params and not v.is_graph_input()}
    folding: list[ir.Node] = []
    for node in graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            constant.update(node.outputs)
            folding.append(node)
        elif (node.domain in ("", "ai.onnx") and node.op_type not in _NO_FOLD and node.inputs
              and all(v is None or v in constant for v in node.inputs)
              and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())):
            constant.update(node.outputs)
            folding.append(node)
    computed = [n for n in folding if n.op_type != "Constant"]
    folded_nodes = set(computed)
    # Only values read outside the folded set are materialized (and only plain tensors).
    frontier = [o for n in computed for o in n.outputs
                if isinstance(o.type, ir.TensorType) and o.dtype not in (None, ir.DataType.STRING)
                and (o.is_graph_output() or any(u not in folded_nodes for u, _ in o.uses()))]
    if not frontier:
        return 0
    values = evaluate_nodes(graph, folding, frontier)
    if values is None:
        return 0
    count = 0
    for value, array in zip(frontier, values):
        if array.size > _FOLD_LIMIT or value.is_graph_output():
            continue
        name = value.name
        producer = value.producer()
        assert producer is not None and name is not None
        const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(array, name=name))], name=f"{producer.name}/folded")
        graph.insert_before(producer, const)
        value.replace_all_uses_with(const.outputs[0])
        value.name = None
        const.outputs[0].name = name
        const.outputs[0].dtype, const.outputs[0].shape = ir.DataType.from_numpy(array.dtype), ir.Shape(array.shape)
        count += 1
    _remove_unused(graph, folded_nodes)
    if count:
        logger.info("folded %d constant subgraph values into Constant nodes", count)
    return count


def _remove_unused(graph: ir.Graph, nodes: set[ir.Node]) -> None:
    for node in reversed(list(graph)):
        if node in nodes and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _warn_folded_batchnorm(graph: ir.Graph) -> list[str]:
    """Warn when the exporter folded BatchNorm layers into convolutions (and name them).

    torch's dynamo exporter runs onnxscript's ``FuseBatchNormIntoConv`` even on a module in
    train mode (``training=TrainingMode.TRAINING`` changes nothing): the running statistics
    are baked into the conv weights and the BatchNorm is gone, so training the graph trains a
    different model. The rewriter stamps the rule name on the fused node; the conv also keeps
    the BatchNorm's torch class in its provenance metadata.
    """
    fused = [_name_of(n) for n in graph
             if "FuseBatchNorm" in n.metadata_props.get("pkg.onnxscript.rewriter.rule_name", "")
             or (n.op_type in ("Conv", "ConvTranspose", "Gemm")
                 and "torch.nn.modules.batchnorm" in n.metadata_props.get("pkg.torch.onnx.class_hierarchy", ""))]
    if fused:
        logger.warning(
            "%d BatchNorm layers were folded into the preceding convolution by the exporter (first: node '%s'); "
            "training this graph trains a model without them. Export with torch.onnx.export(dynamo=False), or "
            "dynamo=True with optimize=False", len(fused), fused[0],
        )
    return fused


def _name_of(node: ir.Node) -> str:
    return node.name or node.op_type


def _set_role(nodes: Sequence[ir.Node], role: str) -> None:
    for node in nodes:
        node.metadata_props[NODE_ROLE] = role


def _attach_loss(graph: ir.Graph, loss: str | None, ctx: GradContext) -> tuple[ir.Value, list[ir.Node]]:
    outputs = {v.name: v for v in graph.outputs}
    if loss is None:
        loss = _default_loss(graph)
    if loss in outputs:
        value = outputs[loss]
        if value.dtype not in FLOAT_TYPES:
            raise GradientError(f"loss output '{loss}' is {value.dtype}, not a float tensor")
        return value, []
    if loss not in BUILTIN_LOSSES:
        raise GradientError(
            f"unknown loss '{loss}'; pass --loss with one of the outputs ({_listing(outputs)}), "
            "or --loss cross_entropy / --loss mse to attach one to the first float output"
        )
    logits = next((v for v in graph.outputs if v.dtype in FLOAT_TYPES), None)
    if logits is None:
        raise GradientError("cannot attach a loss: the model has no float output")
    rank = len(logits.shape) if logits.shape is not None else None
    before = len(graph)
    label_name = ctx.unique("label")
    if loss == "cross_entropy":
        if rank is None or rank < 2:
            raise GradientError(f"cross_entropy needs logits of rank >= 2; '{logits.name}' has rank {rank}")
        # Classes on the last axis (torch/Keras convention: [batch, ..., classes]); the label
        # holds one class index per position, shaped like the logits without that axis.
        label = ir.Value(name=label_name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(list(logits.shape or ())[:-1]))
        scores, target = logits, label
        if rank > 2:
            scores = ctx.op("Flatten", logits, axis=rank - 1)
            target = ctx.op("Reshape", label, ctx.ints([-1]))
        value = ctx.op("SoftmaxCrossEntropyLoss", scores, target, reduction="mean")
    else:
        label = ir.Value(name=label_name, type=ir.TensorType(logits.dtype or ir.DataType.FLOAT), shape=logits.shape)
        diff = ctx.op("Sub", logits, label)
        value = ctx.op("ReduceMean", ctx.op("Mul", diff, diff), keepdims=0)
    graph.inputs.append(label)
    value.name = ctx.unique("loss")
    return value, list(graph)[before:]


def _listing(outputs: dict[str | None, ir.Value]) -> str:
    return ", ".join(f"{n} {_describe(v)}" for n, v in outputs.items() if n)


def _describe(value: ir.Value) -> str:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    return f"{dtype}[{', '.join(str(d) for d in value.shape)}]" if value.shape is not None else dtype


def _is_scalar(value: ir.Value) -> bool:
    return value.shape is not None and all(d == 1 for d in value.shape)


def _default_loss(graph: ir.Graph) -> str:
    """The output named ``loss``, else the only output when it is a float scalar.

    Neither torch exporter names a loss output ``loss`` (TorchScript numbers it, ``233``;
    dynamo names it after the op, ``cross_entropy_loss``), so a model whose only output is a
    float scalar is taken at its word.
    """
    outputs = {v.name: v for v in graph.outputs}
    if "loss" in outputs:
        return "loss"
    only = graph.outputs[0] if len(graph.outputs) == 1 else None
    if only is not None and only.name and only.dtype in FLOAT_TYPES and _is_scalar(only):
        logger.info("using the only output '%s' (a float scalar) as the loss", only.name)
        return only.name
    raise GradientError(
        f"no loss: the model has no output named 'loss' and no single float scalar output; pass "
        f"--loss NAME with one of its outputs ({_listing(outputs)}), or --loss cross_entropy / "
        "--loss mse to attach one to the first float output"
    )


def _loss_nodes(graph: ir.Graph, loss: ir.Value) -> list[ir.Node]:
    """The loss op that produces ``loss`` and the nodes between it and the loss output."""
    chain, node = [], loss.producer()
    while node is not None:
        chain.append(node)
        if node.op_type in _LOSS_OPS:
            return chain
        floats = [v for v in node.inputs if v is not None and v.dtype in FLOAT_TYPES]
        node = floats[0].producer() if len(floats) == 1 else None
    return chain[:1]


def _prune(graph: ir.Graph, keep: Sequence[ir.Value] = ()) -> None:
    """Remove nodes and initializers that neither the outputs nor ``keep`` (state updates) need."""
    live: set[ir.Value] = set(graph.outputs) | set(keep)
    for node in reversed(list(graph)):
        if any(o in live for o in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            graph.remove(node, safe=False)
    for name, value in list(graph.initializers.items()):
        if value not in live and not value.is_graph_input():
            del graph.initializers[name]


def build_training_graph(
    model: ir.Model | onnx.ModelProto | str | os.PathLike[str],
    *,
    optimizer: str | None = "adamw",
    loss: str | None = None,
    freeze: Sequence[str] = (),
    lr: float | None = None,
    optimizer_options: dict[str, Any] | None = None,
    batchnorm: str = "train",
    trainable_inputs: Sequence[str] = (),
    validate: bool = True,
    target: str | None = None,
) -> ir.Model:
    """Build the training step graph of a forward model.

    Args:
        model: The forward model (onnx-ir, protobuf or a path).
        optimizer: ``sgd``, ``adam``, ``adamw``, or ``None`` for a gradient graph whose
            outputs are the loss and ``grad/<param>`` for every parameter.
        loss: ``None`` (the output named ``loss``, else the only output if it is a float
            scalar), an output name, ``cross_entropy`` or ``mse``.
        freeze: fnmatch patterns of parameters to keep fixed.
        lr: Default learning rate (initializer of the ``lr`` input).
        optimizer_options: Hyperparameters (``momentum``, ``nesterov``, ``dampening``,
            ``weight_decay``, ``beta1``, ``beta2``, ``eps``), as in ``torch.optim``.
        batchnorm: ``train`` (batch statistics, running statistics as state), ``train-ops``
            (the same, written as ReduceMean/Sub/Mul/Sqrt ops: ONNX Runtime's CUDA provider
            refuses ``BatchNormalization(training_mode=1)`` at opset >= 14) or ``eval``.
        trainable_inputs: fnmatch patterns of float graph inputs without initializers to
            differentiate as parameters (for models whose weights are runtime inputs).
        validate: Run the ONNX checker (full) and strict shape inference on the result.
        target: Where the step will run, for the gradient forms picked by measured speed:
            ``None``/``cpu`` picks each conv weight gradient's form by layer shape from ORT
            CPU measurements, ``cuda`` uses the one-hot im2col forms, which measured
            fastest on ORT CUDA (``benchmarks/results/conv_dw_ab_cuda.txt``). Same math.

    Returns:
        The training step model, with the lowest ir_version its opsets allow (8 up to
        opset 18, 11 at opset 23, at most ``MAX_IR_VERSION``).

    Raises:
        GradientError: No loss, nothing trainable, bad freeze pattern, op without a rule.
        UnsupportedModelError: Control flow, or an opset the converter cannot upgrade.
    """
    if batchnorm not in ("train", "train-ops", "eval"):
        raise GradientError(f"batchnorm must be 'train', 'train-ops' or 'eval', got '{batchnorm}'")
    if target not in (None, "cpu", "cuda"):
        raise GradientError(f"target must be 'cpu' or 'cuda', got '{target}'")
    opt = make_optimizer(optimizer, **(optimizer_options or {})) if optimizer is not None else None
    m, inputs_mark_params, user_opset = _normalize(model)
    graph = m.graph
    graph.opset_imports[""] = opset = max(graph.opset_imports.get("", MIN_OPSET), MIN_OPSET)
    _warn_folded_batchnorm(graph)
    _name_nodes(graph)
    _materialize_constant_weights(graph)
    _untie_identity_initializers(graph)
    _fold_constants(graph, inputs_mark_params)
    _set_role(list(graph), "forward")
    fwd = GradContext(graph, role="loss", scope="loss")
    loss_value, attached = _attach_loss(graph, loss, fwd)
    _set_role(attached or _loss_nodes(graph, loss_value), "loss")

    state: list[tuple[ir.Value, ir.Value]] = []
    _training_mode(graph, batchnorm, state, fwd)

    params = _select_params(graph, freeze, trainable_inputs, {_name(s) for s, _ in state}, inputs_mark_params)
    graph.outputs.clear()
    graph.outputs.append(loss_value)
    _prune(graph, keep=[out for _, out in state])
    _infer_shapes(m)
    seed = _gradient_seed(graph, loss_value)
    try:
        with pool_conv.weight_grad_form(TARGET_WEIGHT_GRAD_FORM.get(target or "cpu")):
            grads = differentiate(graph, loss_value, params, opset=opset, seed=seed)
    except GradientError as e:
        if user_opset == opset:
            raise
        # The rules are looked up at the upgraded opset; the user knows their model's own.
        raise GradientError(str(e).replace(f" at opset {opset} ", f" at opset {user_opset} (upgraded to {opset}) ")) from None
    m.metadata_props[MODEL_GRAD_SEED] = _name(seed)
    m.metadata_props[MODEL_LOSS] = _name(loss_value)

    ctx = GradContext(graph, role="optimizer", scope="optim")
    new_inputs: list[ir.Value] = []

    def make_state(name: str, like: ir.Value | None, init: float) -> ir.Value:
        dims = [] if like is None or like.shape is None else list(like.shape)
        if not all(isinstance(d, int) for d in dims):
            raise GradientError(f"optimizer state '{name}' needs a static shape; '{like.name if like else ''}' has {dims}")
        array = np.full([int(d) for d in dims if isinstance(d, int)], init, dtype=np.float32)
        value = ir.Value(name=ctx.unique(name), type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(array.shape),
                         const_value=ir.tensor(array))
        array_tensor = value.const_value
        assert array_tensor is not None
        array_tensor.name = value.name
        new_inputs.append(value)
        graph.register_initializer(value)
        return value

    outputs: list[ir.Value] = []
    shaped_like: list[tuple[ir.Value, ir.Value]] = []
    if opt is None:
        gctx = GradContext(graph, role="backward", scope="grad")
        for p in params:
            g = grads[_name(p)]
            if g.name != f"grad/{p.name}" or g.is_graph_output() or g.producer() is None:
                g = gctx.op("Identity", g)
                g.name = f"grad/{p.name}"
            outputs.append(g)
            shaped_like.append((p, g))
    else:
        lr_value = ir.Value(name=LR_INPUT, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]),
                            const_value=ir.tensor(np.float32(lr if lr is not None else _DEFAULT_LR[str(optimizer).lower()]), name=LR_INPUT))
        graph.inputs.append(lr_value)
        graph.register_initializer(lr_value)
        updated, opt_state = opt.build(ctx, [(p, grads[_name(p)]) for p in params], lr_value, make_state)
        m.metadata_props[MODEL_GRADIENTS] = json.dumps([[_name(p), grads[_name(p)].name] for p in params])
        state = [(p, updated[_name(p)]) for p in params] + state + opt_state
    for i, (inp, out) in enumerate(state):
        if out.is_graph_output() or out.is_graph_input() or out.is_initializer():
            out = ctx.op("Identity", out)
            state[i] = (inp, out)
        out.name = _rename(graph, out, f"{inp.name}/updated")
        outputs.append(out)
        shaped_like.append((inp, out))
    graph.inputs.extend(new_inputs)
    graph.outputs.extend(outputs)
    for node in graph:
        node.metadata_props.setdefault(NODE_ROLE, "forward")
    m.metadata_props[MODEL_STATE_PAIRS] = json.dumps([[i.name, o.name] for i, o in state])
    m.metadata_props[MODEL_TRAINING] = "true"
    graph.name = graph.name or "train_step"
    m.ir_version = max(8, onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid(d, v) for d, v in m.opset_imports.items()], True))
    if m.ir_version > MAX_IR_VERSION:
        raise UnsupportedModelError(
            f"opset {opset} needs ir_version {m.ir_version}; ONNX Runtime 1.31 loads ir_version <= {MAX_IR_VERSION}"
        )
    # No data propagation here: onnx would propagate the flat optimizer's 1-D Concat of every
    # parameter as if it were shape data (60 s for a 4M-parameter GPT, out of memory at 118M).
    _infer_shapes(m, data_prop=False)
    for inp, out in shaped_like:
        if out.shape is None:
            out.shape = inp.shape
    if validate:
        _validate(m)
    return m


def _gradient_seed(graph: ir.Graph, loss: ir.Value) -> ir.Value:
    """A dedicated ``dloss/dloss = 1`` value named ``grad/seed`` (loss scaling multiplies it)."""
    dtype = loss.dtype or ir.DataType.FLOAT
    if loss.shape is not None and len(loss.shape) == 0:
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(1.0, dtype=dtype.numpy())))],
                       name="grad/seed", metadata_props={NODE_ROLE: "backward"})
    else:
        shape = ir.Node("", "Shape", [loss], name="grad/seed_shape", metadata_props={NODE_ROLE: "backward"})
        graph.append(shape)
        one = ir.tensor(np.ones((1,), dtype=dtype.numpy()))
        node = ir.Node("", "ConstantOfShape", [shape.outputs[0]], [ir.AttrTensor("value", one)],
                       name="grad/seed", metadata_props={NODE_ROLE: "backward"})
        shape.outputs[0].name = "grad/seed_shape"
    node.outputs[0].name = "grad/seed"
    node.outputs[0].dtype = dtype
    node.outputs[0].shape = loss.shape
    graph.append(node)
    return node.outputs[0]


def _rename(graph: ir.Graph, value: ir.Value, name: str) -> str:
    taken = {v.name for v in graph.inputs} | set(graph.initializers)
    assert name not in taken, name
    return name


def _training_mode(graph: ir.Graph, batchnorm: str, state: list[tuple[ir.Value, ir.Value]],
                   ctx: GradContext) -> None:
    """BatchNormalization: training mode with running statistics as state (or eval mode)."""
    for node in list(graph):
        if node.op_type != "BatchNormalization":
            continue
        if batchnorm == "eval":
            node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
            if len(node.outputs) > 1 and not any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
                node.resize_outputs(1)
            continue
        node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
        if len(node.outputs) < 3:
            node.resize_outputs(3)
        for k, what in ((1, "mean"), (2, "var")):
            out, stat = node.outputs[k], _own_running_stat(graph, node, k + 2, what, ctx)
            if not out.name:
                out.name = ctx.unique(f"{node.name}/output_{k}")
            if not stat.is_graph_input():
                graph.inputs.append(stat)
        pairs = [(node.inputs[3], node.outputs[1]), (node.inputs[4], node.outputs[2])]
        if batchnorm == "train-ops":
            pairs = _decompose_batchnorm(graph, node, ctx)
        state.extend((stat, out) for stat, out in pairs if stat is not None)


def _own_running_stat(graph: ir.Graph, node: ir.Node, slot: int, what: str, ctx: GradContext) -> ir.Value:
    """The running statistic at input ``slot`` of ``node``, as a value only this node uses.

    Every training-mode BatchNormalization needs its running statistics as state: ONNX Runtime
    computes a wrong normalization when the updated statistics are unused (with its default
    optimizations) or when a running statistic is the same tensor as the scale or bias (even
    with none), and a statistic shared with a parameter or another node would be updated twice.
    So a shared initializer is copied, and a computed statistic is refused.
    """
    stat = node.inputs[slot]
    if stat is None:
        raise UnsupportedModelError(f"BatchNormalization node '{node.name}' has no running {what}")
    if not stat.is_initializer() and not stat.is_graph_input():
        raise UnsupportedModelError(
            f"BatchNormalization node '{node.name}': its running {what} '{stat.name}' is computed, not an "
            "initializer or graph input; export it as an initializer, or pass --batchnorm eval"
        )
    shared = stat.is_graph_output() or any(user is not node or index != slot for user, index in stat.uses())
    if not shared:
        return stat
    if stat.const_value is None:
        raise UnsupportedModelError(
            f"BatchNormalization node '{node.name}': its running {what} '{stat.name}' is a graph input that "
            "other nodes use too; give the node its own running statistics"
        )
    name = ctx.unique(f"{node.name}/running_{what}")
    own = ir.Value(name=name, type=stat.type, shape=stat.shape, const_value=ir.tensor(stat.const_value.numpy(), name=name))
    graph.register_initializer(own)
    node.replace_input_with(slot, own)
    logger.info("BatchNormalization '%s': running %s '%s' is shared; it gets its own state '%s'", node.name, what, stat.name, name)
    return own


def _decompose_batchnorm(graph: ir.Graph, node: ir.Node, ctx: GradContext) -> list[tuple[ir.Value | None, ir.Value]]:
    """Replace a training-mode BatchNormalization with the ops of its definition (ONNX opset 15).

    ``Y = (X - mean) / sqrt(var + eps) * scale + B`` with the batch mean and biased variance
    over every axis but 1; ``running = running * momentum + batch * (1 - momentum)``.
    """
    x, scale, bias, mean_in, var_in = node.inputs[:5]
    assert x is not None and scale is not None and bias is not None and mean_in is not None and var_in is not None
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise UnsupportedModelError(f"BatchNormalization node '{node.name}': train-ops needs the input rank")
    eps = node.attributes.get("epsilon")
    momentum = node.attributes.get("momentum")
    eps_v = float(eps.value) if eps is not None else 1e-5
    mom_v = float(momentum.value) if momentum is not None else 0.9
    reduce_axes = ctx.const(np.array([0, *range(2, rank)], dtype=np.int64))
    channel_axes = ctx.const(np.array([0, *range(2, rank)], dtype=np.int64))
    flat = ctx.const(np.array([-1], dtype=np.int64))
    new_nodes: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        name = ctx.unique(f"{node.name}/bn/{op_type}")
        n = ir.Node("", op_type, list(inputs), ir.convenience.convert_attributes(attrs), name=name,
                    metadata_props={NODE_ROLE: "forward"})
        n.outputs[0].name = name
        new_nodes.append(n)
        return n.outputs[0]

    def scalar(value: float) -> ir.Value:
        return ctx.const(np.array(value, dtype=(x.dtype or ir.DataType.FLOAT).numpy()))

    mean = op("ReduceMean", x, reduce_axes, keepdims=1)
    centered = op("Sub", x, mean)
    var = op("ReduceMean", op("Mul", centered, centered), reduce_axes, keepdims=1)
    normed = op("Mul", centered, op("Reciprocal", op("Sqrt", op("Add", var, scalar(eps_v)))))
    y = op("Add", op("Mul", normed, op("Unsqueeze", scale, channel_axes)), op("Unsqueeze", bias, channel_axes))
    rm = op("Add", op("Mul", mean_in, scalar(mom_v)), op("Mul", op("Reshape", mean, flat), scalar(1 - mom_v)))
    rv = op("Add", op("Mul", var_in, scalar(mom_v)), op("Mul", op("Reshape", var, flat), scalar(1 - mom_v)))
    graph.insert_before(node, new_nodes)
    for old, new in zip(node.outputs, (y, rm, rv)):
        name = old.name
        new.shape = old.shape
        dtype = old.dtype or x.dtype
        if dtype is not None:
            new.dtype = dtype
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = None
        new.name = name
    graph.remove(node, safe=True)
    return [(mean_in, rm), (var_in, rv)]


def _select_params(graph: ir.Graph, freeze: Sequence[str], trainable_inputs: Sequence[str],
                   exclude: set[str], inputs_mark_params: bool) -> list[ir.Value]:
    floats = {n: v for n, v in graph.initializers.items() if v.dtype in FLOAT_TYPES and n not in exclude}
    explicit = [v for v in graph.inputs if v.name in floats] if inputs_mark_params else []
    if explicit:
        candidates = explicit
    else:
        candidates = [v for v in floats.values() if v.shape is not None and len(v.shape) >= 1]
    for pattern in trainable_inputs:
        matched = [v for v in graph.inputs if fnmatch.fnmatchcase(_name(v), pattern)
                   and v.dtype in FLOAT_TYPES and v not in candidates and v.name not in exclude]
        if not matched:
            raise GradientError(f"trainable input pattern '{pattern}' matches no float graph input")
        candidates += matched
    for pattern in freeze:
        if not any(fnmatch.fnmatchcase(_name(v), pattern) for v in candidates):
            raise GradientError(
                f"freeze pattern '{pattern}' matches no parameter (parameters: "
                f"{', '.join(_name(v) for v in candidates[:8])}{', ...' if len(candidates) > 8 else ''})"
            )
    params = [v for v in candidates if not any(fnmatch.fnmatchcase(_name(v), p) for p in freeze)]
    for v in candidates:
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
    return params


def _infer_shapes(model: ir.Model, data_prop: bool = True) -> None:
    infer = ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=data_prop)
    try:
        infer(model)
        # onnx leaves GroupNormalization outputs untyped, which would cut gradient paths.
        while infer_group_norm_types(model.graph):
            infer(model)
    except Exception as e:  # noqa: BLE001
        logger.warning("shape inference failed (%s); continuing with partial shapes", e)


def _validate(model: ir.Model) -> None:
    proto = ir.to_proto(model)
    try:
        if proto.ByteSize() < 1_500_000_000:
            onnx.checker.check_model(proto, full_check=True)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as e:  # noqa: BLE001 - checker errors are many types
        raise ValidationError(f"internal error: the training graph is invalid: {str(e).splitlines()[0]}") from e
