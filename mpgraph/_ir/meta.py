"""Every metadata key mpgraph writes, in one place.

Passes talk to each other and to the audit through these keys (on ``node.metadata_props``
and ``model.metadata_props``), so Netron shows them and a saved model carries its decisions.
"""

from __future__ import annotations

import enum
import sys

import onnx_ir as ir

__all__ = [
    "PRECISION_OF_DTYPE",
    "Role",
    "Precision",
    "NODE_PRECISION",
    "NODE_REASON",
    "NODE_INSERTED",
    "NODE_ROLE",
    "MODEL_POLICY",
    "MODEL_DTYPE",
    "MODEL_TF32",
    "MODEL_EMULATED",
    "MODEL_WEIGHT_BYTES_BEFORE",
    "MODEL_INIT_RANGE",
    "MODEL_LOSS_SCALING",
    "MODEL_STATE_PAIRS",
    "MODEL_TRAINING",
    "MODEL_OPSET_UPGRADED",
    "MODEL_TARGET",
    "MODEL_CALIBRATION",
    "MODEL_GRADIENTS",
    "MODEL_GRAD_SEED",
    "MODEL_LOSS",
    "NODE_GRAD_OF",
    "NODE_GRAD_OF_VALUE",
    "NODE_GRAD_INPUTS",
    "NODE_GRAD_OUTPUTS",
    "NODE_FLAT",
    "FLAT_GRADIENT",
    "FLAT_PARAM",
    "FLAT_SPLIT",
    "NODE_ON_SKIP",
    "LOSS_SCALE",
    "GROWTH_TRACKER",
    "FOUND_INF",
    "ROLES",
    "Category",
    "Phase",
    "NODE_PHASE",
    "MODEL_LOSS_SCALE_STATE",
]

#: Final compute precision of a node: a dtype name (``float32``, ``float16``, ``bfloat16``)
#: or ``none`` for nodes that touch no float tensor.
NODE_PRECISION = "mpgraph.precision"
#: The rule or phase that decided ``NODE_PRECISION``, in words.
NODE_REASON = "mpgraph.reason"
#: The step that decided ``NODE_PRECISION``: one of ``Phase`` (code tests this, never the reason).
NODE_PHASE = "mpgraph.phase"
#: Set on nodes mpgraph created: ``cast`` (policy boundary), ``round`` (emulation rounding).
NODE_INSERTED = "mpgraph.inserted"
#: Role of a node in a training graph: one of ``ROLES``.
NODE_ROLE = "mpgraph.role"

#: Name (or path) of the policy a model was converted with.
MODEL_POLICY = "mpgraph.policy"
#: Target low dtype of the conversion.
MODEL_DTYPE = "mpgraph.dtype"
#: ``true`` when the policy lets float32 matmuls run as TF32 (the ``tf32`` preset); the
#: trainer sets ORT CUDA's ``use_tf32`` from it. Absent or ``false``: strict float32.
MODEL_TF32 = "mpgraph.tf32"
#: ``true`` when the model is the CPU-emulated lowering.
MODEL_EMULATED = "mpgraph.emulated"
#: Bytes of float weights before conversion (the audit compares with after).
MODEL_WEIGHT_BYTES_BEFORE = "mpgraph.weight_bytes_before"
#: JSON list of initializer range events (overflow/underflow), one record per initializer.
MODEL_INIT_RANGE = "mpgraph.initializer_range"
#: JSON of the loss-scaling section of the policy.
MODEL_LOSS_SCALING = "mpgraph.loss_scaling"
#: JSON list of ``[state input, updated output]`` pairs of a training step graph.
MODEL_STATE_PAIRS = "mpgraph.state_pairs"
#: ``true`` on a training step graph built by ``train-graph``.
MODEL_TRAINING = "mpgraph.training"

#: ``<old>-><new>`` when convert upgraded the opset so ops admit the low dtype.
MODEL_OPSET_UPGRADED = "mpgraph.opset_upgraded"
#: Where the native lowering is meant to run: ``cuda``, ``cpu`` or ``any`` (``mpgraph.targets``);
#: ops without a low kernel there stayed float32. Runners refuse a provider that lacks a kernel.
MODEL_TARGET = "mpgraph.target"
#: JSON summary of the range check: feeds, ops kept float32 and why, values that flush to zero.
MODEL_CALIBRATION = "mpgraph.calibration"

#: JSON list of ``[parameter input, gradient value]`` pairs of a training step graph: the
#: gradients the optimizer reads (loss scaling unscales and checks exactly these).
MODEL_GRADIENTS = "mpgraph.gradients"
#: Name of the value seeding reverse mode (dloss/dloss = 1); loss scaling multiplies it.
MODEL_GRAD_SEED = "mpgraph.grad_seed"
#: Name of the scalar loss value of a training step graph.
MODEL_LOSS = "mpgraph.loss"
#: On backward nodes: the name of the forward node whose gradient rule emitted them (for
#: people; code follows ``NODE_GRAD_OF_VALUE``, which survives renaming nodes).
NODE_GRAD_OF = "mpgraph.grad_of"
#: On backward nodes: the first output value of the forward node whose gradient rule emitted
#: them, the link code resolves (``_ir.links.forward_twins``).
NODE_GRAD_OF_VALUE = "mpgraph.grad_of_value"
#: On forward nodes that autodiff differentiated: JSON list, per input slot, of the name of the
#: value that is this node's contribution to that input's gradient (``null``: none), as its
#: gradient rule returned it. Lowering replaces a node's whole backward by these names
#: (``_ir.links.gradient_blocks``), whatever nodes the rule emitted between.
NODE_GRAD_INPUTS = "mpgraph.grad_inputs"
#: On the same nodes: JSON list, per output, of the name of the gradient flowing into it.
NODE_GRAD_OUTPUTS = "mpgraph.grad_outputs"
#: On the flat-buffer nodes of a flat optimizer (``optimizer_options={"flat": True}``): which
#: buffer the node makes, one of ``FLAT_GRADIENT``, ``FLAT_PARAM``, ``FLAT_SPLIT``. Loss
#: scaling unscales, checks and guards these once instead of once per parameter.
NODE_FLAT = "mpgraph.flat"
#: ``NODE_FLAT`` of the Concat of the flattened gradients (the optimizer reads only it).
FLAT_GRADIENT = "gradient"
#: ``NODE_FLAT`` of the Concat of the flattened parameters (the current flat master).
FLAT_PARAM = "param"
#: ``NODE_FLAT`` of the Split of the updated flat parameter back into the parameters.
FLAT_SPLIT = "split"
#: On an optimizer node whose scalar output is a per-step coefficient: the value it must take
#: on a step that loss scaling skips (``"0"`` or ``"1"``), so the update leaves every state
#: value as it was. ``ScaleLossPass`` gates these, zeroes the gradients the optimizer reads on
#: overflow, and then needs no select over each state tensor (see ``optim.adam``).
NODE_ON_SKIP = "mpgraph.on_skip"

#: Graph state input holding the current loss scale (fp32 scalar) when loss scaling is on.
LOSS_SCALE = "loss_scale"
#: Graph state input counting finite steps since the last scale change (fp32 scalar).
GROWTH_TRACKER = "loss_scale/growth_tracker"
#: Bool scalar graph output: true when a gradient was inf/NaN and the update was skipped.
FOUND_INF = "found_inf"

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class Role(StrEnum):
    """``NODE_ROLE`` of a node in a training step graph.

    >>> Role.BACKWARD == "backward", str(Role.OPTIMIZER)
    (True, 'optimizer')
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    LOSS = "loss"
    OPTIMIZER = "optimizer"


class Precision(StrEnum):
    """``NODE_PRECISION``: the dtype a node computes in, or ``none`` (it touches no float)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    NONE = "none"


#: ``Precision`` of each float dtype a node computes in (a policy's low dtype, or float32).
PRECISION_OF_DTYPE = {
    ir.DataType.FLOAT: Precision.FLOAT32,
    ir.DataType.FLOAT16: Precision.FLOAT16,
    ir.DataType.BFLOAT16: Precision.BFLOAT16,
}


ROLES = tuple(Role)


class Category(StrEnum):
    """A policy's category for an op type (TensorFlow AMP's lists).

    >>> Category("deny") is Category.DENY, Category.ALLOW == "allow"
    (True, True)
    """

    ALLOW = "allow"
    INFER = "infer"
    CLEAR = "clear"
    DENY = "deny"


class Phase(StrEnum):
    """``NODE_PHASE``: the step that decided a node's precision (``AssignPrecisionPass``'s phases).

    Validation, the range-check summary and ``mpgraph targets`` test this, never the reason's
    words. Phase 0 (fixed decisions) is split by what fixed it, so each is testable.
    """

    #: Phase 0: the node cannot be lowered (no float, no schema, control flow, a training role,
    #: shape arithmetic, a pin, the opset, a constant out of range).
    FIXED = "fixed"
    #: Phase 0: the input model already computes it in another float dtype.
    INPUT_DTYPE = "input_dtype"
    #: Phase 0: an activation beyond the low dtype's range / 2 on calibration data.
    CALIBRATION = "calibration"
    #: Phase 0: a node-name override of the policy.
    OVERRIDE = "override"
    #: The identity (float32) policy lowers nothing.
    IDENTITY = "identity"
    #: Phase 1: an ``allow`` op.
    ALLOW = "allow"
    #: Phase 2: deny spreads forward through ``infer``/``clear`` ops.
    DENY_SPREAD = "deny_spread"
    #: Phase 3: ``infer``/``clear`` between low ops.
    BETWEEN = "between"
    #: Phase 4: ``infer``/``clear`` whose float inputs all come from low ops.
    FOLLOW = "follow"
    #: Phase 5: backward elementwise ops follow their low forward op.
    BACKWARD = "backward"
    #: Phase 6: ``clear`` ops whose every consumer is low.
    CLEAR_FEEDS_LOW = "clear_feeds_low"
    #: Phase 7: a float32-accumulating kernel with low I/O (Softmax, bfloat16 ReduceSum).
    LOW_IO = "low_io"
    #: Phase 8: the backward of a Softmax that phase 7 gave low I/O follows it.
    LOW_IO_BACKWARD = "low_io_backward"
    #: Phase 9: a ``deny`` op (listed, or by the policy's default category) stays float32.
    DENY = "deny"
    #: Phase 9: the target has no low kernel for the op (``mpgraph.targets``).
    KERNEL_GAP = "kernel_gap"
    #: Phase 9: an ``infer``/``clear`` op none of phases 3-6 lowered stays float32.
    FLOAT32_INPUTS = "float32_inputs"
    #: Convert's finite check: the low output turned non-finite where float32's is finite.
    FINITE = "finite"
    #: Inside a control-flow body (bodies stay float32).
    BODY = "body"
    #: Decided before this pass ran (a model converted earlier, without a recorded phase).
    RECORDED = "recorded"


#: JSON object naming, by role, the loss-scale state ``ScaleLossPass`` added to a step graph:
#: ``found_inf`` (the bool graph output), and in dynamic mode ``scale`` and ``growth_tracker``
#: (state inputs). Its presence, never a value's name, says the step graph is loss-scaled.
MODEL_LOSS_SCALE_STATE = "mpgraph.loss_scale_state"

#: Name of the logits value of a training step graph (what a runtime evaluates): the value
#: named ``logits`` if there is one, else the scores input of the loss op. Absent when neither.
MODEL_LOGITS = "mpgraph.logits"
#: JSON list of the forward model's output names that a training step graph still computes.
MODEL_FORWARD_OUTPUTS = "mpgraph.forward_outputs"
__all__ += ["MODEL_LOGITS", "MODEL_FORWARD_OUTPUTS"]

#: On a MatMul/Gemm whose operands ``QuantizeFp8Pass`` quantised: JSON object, input slot ->
#: ``{"tensor", "format", "fp8", "scale_inv"}`` (the quantised tensor's key, its fp8 format,
#: the value holding its fp8 bits and the value holding ``1 / scale``). A lowering rule reads
#: these to replace the float32 dequantise -> product with a native fp8 GEMM.
NODE_FP8 = "mpgraph.fp8"
#: JSON record of a model's fp8 quantisation: ``recipe`` (the scaling settings, and the recipe
#: used: inference graphs use ``current``), ``formats`` and ``tensors``, a list of
#: ``{"tensor", "format", "kind", "scale", "history", "amax", "gemms"}`` (``kind`` ``forward`` or
#: ``gradient``; ``scale``/``history`` the state inputs, ``null`` with the current recipe).
#: Its presence says the model is quantised already.
MODEL_FP8 = "mpgraph.fp8"
#: On a GemmFp8 that computes its product transposed, with its operands in the other slots
#: (``fp8_gemm``'s rule 6 absorbing a Transpose of its output): ``"1"``. Its ``mpgraph.fp8``
#: slots are swapped to match.
NODE_FP8_SWAPPED = "mpgraph.fp8_swapped"
__all__ += ["NODE_FP8", "MODEL_FP8", "NODE_FP8_SWAPPED"]
