"""``build_training_graph``: the training passes, the backward pass and the optimizer, in order."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from mpgraph._ir.builder import Builder
from mpgraph._ir.contract import LR_INPUT, StepContract
from mpgraph._ir.meta import NODE_ROLE, Role
from mpgraph.autodiff import differentiate
from mpgraph.autodiff.rules.groupnorm import infer_group_norm_types
from mpgraph.errors import GradientError, UnsupportedModelError, ValidationError, first_line
from mpgraph.io import (
    CHECK_WITHOUT_WEIGHTS_BYTES,
    min_ir_version,
    shape_only_initializers,
    tensor_bytes,
)
from mpgraph.optim import make_optimizer
from mpgraph.optim.base import Optimizer
from mpgraph.training._common import name_of
from mpgraph.training.attach_loss import AttachLossPass, find_logits
from mpgraph.training.expand_conditions import ExpandWhereConditionsPass
from mpgraph.training.normalize_forward import NormalizeForwardPass, load_forward
from mpgraph.training.pad_gemm_columns import PadGemmColumnsPass
from mpgraph.training.select_parameters import SelectParametersPass
from mpgraph.training.set_batchnorm_mode import SetBatchNormModePass

__all__ = ["LR_INPUT", "MAX_IR_VERSION", "build_training_graph", "state_pairs"]

logger = logging.getLogger(__name__)

#: ONNX Runtime 1.31 refuses models with a higher ir_version (opset 28 needs 14).
MAX_IR_VERSION = 13
_DEFAULT_LR = {"sgd": 1e-2, "adam": 1e-3, "adamw": 1e-3}

State = list[tuple[ir.Value, ir.Value]]


def state_pairs(model: ir.Model) -> list[tuple[str, str]]:
    """``[(state input, updated output)]`` recorded on a training step graph."""
    return list(StepContract.read(model).state_pairs) if StepContract.recorded(model) else []


def build_training_graph(
    model: ir.Model | onnx.ModelProto | str | os.PathLike[str],
    *,
    optimizer: str | None = "adamw",
    loss: str | None = None,
    freeze: Sequence[str] = (),
    params: Sequence[str] = (),
    lr: float | None = None,
    optimizer_options: dict[str, Any] | None = None,
    batchnorm: str = "train",
    trainable_inputs: Sequence[str] = (),
    validate: bool = True,
    target: str | None = None,
    pad_gemms: bool | None = None,
    canonicalize: bool | None = None,
) -> ir.Model:
    """Build the training step graph of a forward model.

    Args:
        model: The forward model (onnx-ir, protobuf or a path).
        optimizer: ``sgd``, ``adam``, ``adamw``, or ``None`` for a gradient graph whose
            outputs are the loss and ``grad/<param>`` for every parameter.
        loss: ``None`` (the output named ``loss``, else the only output if it is a float
            scalar), an output name, ``cross_entropy`` or ``mse``.
        freeze: fnmatch patterns of parameters to keep fixed.
        params: fnmatch patterns naming the parameters among the float initializers, for a
            graph whose parameters cannot be told from its constants; nothing is inferred
            then (by default: the float graph inputs with initializers, else what torch's
            dynamo exporter marks as parameters, else every float initializer of rank >= 1).
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
            fastest on ORT CUDA (``benchmarks/results/conv_dw_ab_cuda.txt``), and gives
            ``Where`` full-size conditions (``ExpandWhereConditionsPass``). Same math.
        pad_gemms: Pad a weight GEMM's unaligned output columns to a multiple of 64 and
            slice them off its output (``PadGemmColumnsPass``: a 50257-token vocabulary's
            GEMMs then run on aligned tensor-core kernels). ``None``: when ``target`` is
            ``cuda``. Same math; the parameters keep their shapes.
        canonicalize: Rewrite exporters' written-out forms into standard ONNX ops before
            differentiating (``CanonicalizeOpsPass``), so gradient rules and fused kernels
            see one form: ``None`` (default) GELU (erf and tanh), LayerNorm and RMSNorm into
            ``Gelu``, ``LayerNormalization`` and ``RMSNormalization``, and with ``target="cuda"``
            attention into ``Attention`` (fused on CUDA by the ``sdpa`` lowering rule);
            ``True`` attention for any target; ``False`` nothing. The opset is raised to what the
            new ops need (``Gelu`` 20, ``RMSNormalization`` and ``Attention`` 23); by default
            not where that leaves an op of the model without the ORT kernel it has now on
            ``target`` (CUDA unless ``cpu``: Dropout, Elu, MaxPool, Selu at opset 22 and up),
            those forms are then kept written out (logged). Same math.

    Returns:
        The training step model, with the lowest ir_version its opsets allow (8 up to
        opset 18, 11 at opset 23, at most ``MAX_IR_VERSION``).

    Raises:
        GradientError: No loss, nothing trainable, bad freeze or params pattern, op without a rule.
        UnsupportedModelError: Control flow, an opset the converter cannot upgrade, or a
            graph whose exporter folded parameters into constants.
    """
    set_batchnorm_mode = SetBatchNormModePass(batchnorm)
    if target not in (None, "cpu", "cuda"):
        raise GradientError(f"target must be 'cpu' or 'cuda', got '{target}'")
    opt = make_optimizer(optimizer, **(optimizer_options or {})) if optimizer is not None else None
    forward = load_forward(model)
    m = forward.model
    NormalizeForwardPass(forward.inputs_mark_params, params)(m)
    if canonicalize is not False:
        # Imported here: it imports onnxscript's rewriter (0.13 s), which nothing else needs.
        from mpgraph.training.canonicalize_ops import CanonicalizeOpsPass

        # The default keeps a norm written out where its opset would cost an op its kernel
        # where the step runs (CUDA unless told cpu); asked for, the rewrite happens anyway.
        provider = None if canonicalize else "cpu" if target == "cpu" else "cuda"
        # Attention by default on CUDA: the lowering runs it as cuDNN's fused attention (``sdpa``)
        # or, where that cannot, as its ONNX function body (``attention_expand``); elsewhere
        # ORT's own Attention kernels would run it.
        attention = canonicalize is True or (canonicalize is None and target == "cuda")
        CanonicalizeOpsPass(attention=attention, provider=provider)(m)
    forward_outputs = [name_of(v) for v in m.graph.outputs]
    loss_value = AttachLossPass(loss)(m).loss
    assert loss_value is not None
    state = set_batchnorm_mode(m).state
    trained = SelectParametersPass(freeze, trainable_inputs, {name_of(s) for s, _ in state},
                                   inputs_mark_params=forward.inputs_mark_params, params=params)(m).params
    _keep_loss_only(m, loss_value, state)
    if pad_gemms or (pad_gemms is None and target == "cuda"):
        PadGemmColumnsPass()(m)
    grads, seed = _differentiate(m, loss_value, trained, target, forward.opset)
    if target == "cuda":
        ExpandWhereConditionsPass()(m)
    optim = Builder(m.graph, role=Role.OPTIMIZER, scope="optim")
    outputs: State = []
    if opt is None:
        outputs = _gradient_outputs(m.graph, trained, grads)
    else:
        state = _attach_optimizer(m, optim, opt, lr if lr is not None else _DEFAULT_LR[str(optimizer).lower()],
                                  trained, grads, state)
    outputs += _state_outputs(m.graph, optim, state)
    _finish(m, state, outputs)
    _record_contract(m, state, loss_value, seed, None if opt is None else [(p, grads[name_of(p)]) for p in trained],
                     forward_outputs)
    if validate:
        _validate(m)
    return m


def _keep_loss_only(model: ir.Model, loss: ir.Value, state: State) -> None:
    """The loss becomes the only output; what neither it nor a state update needs goes."""
    graph = model.graph
    graph.outputs.clear()
    graph.outputs.append(loss)
    live: set[ir.Value] = {loss} | {out for _, out in state}
    for node in reversed(list(graph)):
        if any(o in live for o in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            graph.remove(node, safe=False)
    for name, value in list(graph.initializers.items()):
        if value not in live and not value.is_graph_input():
            del graph.initializers[name]
    _infer_shapes(model)


def _differentiate(model: ir.Model, loss: ir.Value, params: list[ir.Value], target: str | None,
                   user_opset: int) -> tuple[dict[str, ir.Value], ir.Value]:
    """The backward pass from a ``grad/seed`` value: the gradients by parameter, and the seed."""
    graph = model.graph
    opset = graph.opset_imports[""]
    seed = _gradient_seed(graph, loss)
    try:
        grads = differentiate(graph, loss, params, opset=opset, seed=seed, target=target)
    except GradientError as e:
        if user_opset == opset:
            raise
        # The rules are looked up at the upgraded opset; the user knows their model's own.
        raise GradientError(str(e).replace(f" at opset {opset} ", f" at opset {user_opset} (upgraded to {opset}) ")) from None
    return grads, seed


def _gradient_seed(graph: ir.Graph, loss: ir.Value) -> ir.Value:
    """A dedicated ``dloss/dloss = 1`` value named ``grad/seed`` (loss scaling multiplies it)."""
    dtype = loss.dtype or ir.DataType.FLOAT
    b = Builder(graph, role=Role.BACKWARD, scope="grad")
    if loss.shape is not None and len(loss.shape) == 0:
        seed = b.op("Constant", value=ir.tensor(np.array(1.0, dtype=dtype.numpy())), name="seed")
    else:
        shape = b.op("Shape", loss, name="seed_shape")
        seed = b.op("ConstantOfShape", shape, value=ir.tensor(np.ones((1,), dtype=dtype.numpy())), name="seed")
    seed.dtype = dtype
    seed.shape = loss.shape
    return seed


def _gradient_outputs(graph: ir.Graph, params: list[ir.Value], grads: dict[str, ir.Value]) -> State:
    """No optimizer: every parameter's gradient is an output named ``grad/<param>``."""
    gctx = Builder(graph, role=Role.BACKWARD, scope="grad")
    outputs = []
    for p in params:
        g = grads[name_of(p)]
        if g.name != f"grad/{p.name}" or g.is_graph_output() or g.producer() is None:
            g = gctx.op("Identity", g)
            g.name = f"grad/{p.name}"
        outputs.append((p, g))
    return outputs


class _StateInputs:
    """The optimizer's ``StateFactory``: fp32 state inputs with same-named initializers."""

    def __init__(self, ctx: Builder) -> None:
        self.ctx = ctx
        self.inputs: list[ir.Value] = []

    def __call__(self, name: str, like: ir.Value | None, init: float) -> ir.Value:
        dims = [] if like is None or like.shape is None else list(like.shape)
        if not all(isinstance(d, int) for d in dims):
            raise GradientError(f"optimizer state '{name}' needs a static shape; '{like.name if like else ''}' has {dims}")
        array = np.full([int(d) for d in dims if isinstance(d, int)], init, dtype=np.float32)
        value = self.ctx.tape.initializer(ir.tensor(array, name=self.ctx.unique(name)))
        self.inputs.append(value)
        return value


def _attach_optimizer(model: ir.Model, ctx: Builder, opt: Optimizer, lr: float, params: list[ir.Value],
                      grads: dict[str, ir.Value], state: State) -> State:
    """The optimizer update with an ``lr`` input; returns every state pair, parameters first.

    The optimizer's state inputs join the graph inputs after ``lr``.
    """
    graph = model.graph
    lr_value = ctx.tape.initializer(ir.tensor(np.float32(lr), name=LR_INPUT))
    graph.inputs.append(lr_value)
    make_state = _StateInputs(ctx)
    updated, opt_state = opt.build(ctx, [(p, grads[name_of(p)]) for p in params], lr_value, make_state)
    graph.inputs.extend(make_state.inputs)
    return [(p, updated[name_of(p)]) for p in params] + state + opt_state


def _state_outputs(graph: ir.Graph, ctx: Builder, state: State) -> State:
    """Every state update as an output named ``<state input>/updated`` (an Identity if needed)."""
    outputs = []
    for i, (inp, out) in enumerate(state):
        if out.is_graph_output() or out.is_graph_input() or out.is_initializer():
            out = ctx.op("Identity", out)
            state[i] = (inp, out)
        out.name = f"{inp.name}/updated"
        outputs.append((inp, out))
    return outputs


def _finish(model: ir.Model, state: State, outputs: State) -> None:
    """Outputs, roles, the ir_version and the shapes of the new outputs.

    ``outputs`` pairs each new output with the value whose shape it has (its parameter or
    state input), for when shape inference leaves it unknown.
    """
    graph = model.graph
    graph.outputs.extend(out for _, out in outputs)
    for node in graph:
        node.metadata_props.setdefault(NODE_ROLE, Role.FORWARD)
    graph.name = graph.name or "train_step"
    model.ir_version = max(8, min_ir_version(model.opset_imports))
    if model.ir_version > MAX_IR_VERSION:
        raise UnsupportedModelError(
            f"opset {graph.opset_imports['']} needs ir_version {model.ir_version}; ONNX Runtime 1.31 loads ir_version <= {MAX_IR_VERSION}"
        )
    # No data propagation here: onnx would propagate the flat optimizer's 1-D Concat of every
    # parameter as if it were shape data (60 s for a 4M-parameter GPT, out of memory at 118M).
    _infer_shapes(model, data_prop=False)
    for like, out in outputs:
        if out.shape is None:
            out.shape = like.shape


def _record_contract(model: ir.Model, state: State, loss: ir.Value, seed: ir.Value,
                     gradients: State | None, forward_outputs: list[str]) -> None:
    """Write the step contract (``StepContract``): names are taken now, after every rename,
    so readers need not guess the logits or the forward outputs the step computes."""
    graph = model.graph
    computed = {v.name for node in graph for v in node.outputs} | {v.name for v in graph.inputs}
    StepContract(
        state_pairs=tuple((name_of(i), name_of(o)) for i, o in state),
        loss=name_of(loss),
        grad_seed=name_of(seed),
        gradients=None if gradients is None else tuple((name_of(p), name_of(g)) for p, g in gradients),
        logits=find_logits(graph),
        forward_outputs=tuple(name for name in forward_outputs if name in computed),
    ).write(model)


def _infer_shapes(model: ir.Model, data_prop: bool = True) -> None:
    infer = ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=data_prop)
    try:
        infer(model)
        # onnx leaves GroupNormalization outputs untyped, which would cut gradient paths.
        while infer_group_norm_types(model.graph):
            infer(model)
    except Exception as e:  # noqa: BLE001
        logger.warning("shape inference failed (%s); continuing with partial shapes", e)


def _validate(model: ir.Model, large: int | None = None) -> None:
    """The checker (full check) and strict, type-checked shape inference on the step graph. Over
    ``large`` bytes of tensors (``io.CHECK_WITHOUT_WEIGHTS_BYTES``: protobuf refuses to serialise
    2 GiB, and both serialise the model first; a diffusers UNet2D at its default config made a
    step graph over it) the checker is skipped and shape inference reads a copy without the float
    weights' bytes (``io.shape_only_initializers``: it needs their types and shapes only; small
    tensors keep theirs, for Reshape's shape and the like)."""
    small = tensor_bytes(model) < (CHECK_WITHOUT_WEIGHTS_BYTES if large is None else large)
    with shape_only_initializers(model) if not small else contextlib.nullcontext():
        proto = ir.to_proto(model)
    try:
        if small:
            onnx.checker.check_model(proto, full_check=True)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as e:  # noqa: BLE001 - checker errors are many types
        raise ValidationError(f"internal error: the training graph is invalid: {first_line(e)}") from e

