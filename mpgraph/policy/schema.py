"""Precision policies as frozen dataclasses.

A policy says, per ONNX op type, whether the op may run in the low dtype. Categories follow
TensorFlow's automatic mixed precision:

* ``allow``: numerically safe and fast in low precision (MatMul, Conv); always lowered.
* ``infer``: follows its inputs (Add, Relu); lowered when it sits between or after allow ops.
* ``clear``: dtype-neutral data movement (Reshape, Transpose); lowered next to low ops.
* ``deny``: must stay float32 (Softmax, reductions, losses); deny spreads forward through
  infer/clear ops.

Ops the policy does not list get ``default_category`` (``deny`` unless the policy says so).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import onnx_ir as ir

from mpgraph._ir.meta import Category, StrEnum

__all__ = [
    "CATEGORIES",
    "OpRule",
    "RuleSource",
    "DTYPES",
    "LOSS_SCALING_MODES",
    "OVERFLOW_ACTIONS",
    "UNDERFLOW_ACTIONS",
    "InitializerRange",
    "LossScaling",
    "FP8_FORMATS",
    "SCALING_RECIPES",
    "AMAX_COMPUTE",
    "SCALE_ROUNDING",
    "FP8_PRODUCTS",
    "Fp8",
    "Fp8Scaling",
    "Override",
    "Pin",
    "Policy",
]

CATEGORIES = tuple(Category)

#: Accepted spellings of each target dtype.
DTYPES: Mapping[str, ir.DataType] = {
    "float16": ir.DataType.FLOAT16,
    "fp16": ir.DataType.FLOAT16,
    "half": ir.DataType.FLOAT16,
    "bfloat16": ir.DataType.BFLOAT16,
    "bf16": ir.DataType.BFLOAT16,
    "float32": ir.DataType.FLOAT,
    "fp32": ir.DataType.FLOAT,
    "float": ir.DataType.FLOAT,
}

LOSS_SCALING_MODES = ("none", "static", "dynamic")

#: Accepted spellings of the fp8 formats (ONNX's names first).
FP8_FORMATS: Mapping[str, ir.DataType] = {
    "float8e4m3fn": ir.DataType.FLOAT8E4M3FN,
    "e4m3": ir.DataType.FLOAT8E4M3FN,
    "float8e5m2": ir.DataType.FLOAT8E5M2,
    "e5m2": ir.DataType.FLOAT8E5M2,
}
#: ``delayed``: the scale comes from a history of earlier steps' amax; ``current``: this step's.
SCALING_RECIPES = ("delayed", "current")
#: Which products of ``Fp8.ops`` are quantised: ``all``, or ``linear``: those with a parameter
#: operand (a weight: an initializer or a step graph's parameter, read through data movement)
#: and their backward products, as Transformer Engine quantises its Linear layers only.
FP8_PRODUCTS = ("all", "linear")
#: How the delayed recipe reduces its amax history: its maximum, or the newest entry.
AMAX_COMPUTE = ("max", "most_recent")
#: ``pow2``: the scale is rounded down to a power of two (exact multiplication, the dequantised
#: values are exact in bfloat16); ``none``: ``fp8_max / amax / 2**margin`` as computed.
SCALE_ROUNDING = ("pow2", "none")
OVERFLOW_ACTIONS = ("keep_fp32", "clamp", "error")
UNDERFLOW_ACTIONS = ("keep", "keep_fp32", "error")


class RuleSource(StrEnum):
    """Where an op type's category comes from."""

    #: The policy lists the op type.
    POLICY = "policy"
    #: The policy does not list it: its ``default_category``.
    DEFAULT = "default"
    #: The conversion target has no low kernel for it (``mpgraph.targets.with_target``).
    TARGET = "target"
    #: A node-name ``Override`` (a rule for one node, not an op type).
    OVERRIDE = "override"


@dataclasses.dataclass(frozen=True)
class OpRule:
    """What a policy says about one op type.

    >>> Policy("p", ir.DataType.BFLOAT16, ops={"MatMul": ("allow", "fast")}).rule("MatMul")
    OpRule(category=<Category.ALLOW: 'allow'>, reason='fast', source=<RuleSource.POLICY: 'policy'>)

    Attributes:
        category: The op type's category.
        reason: Why, in words (the policy's text, or the target's kernel gap).
        source: Whether the policy lists it, defaults it, the target denies it, or an
            override decides the node.
    """

    category: Category
    reason: str
    source: RuleSource


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Loss-scaling settings; defaults are ``torch.amp.GradScaler``'s.

    Attributes:
        mode: ``none``, ``static`` (multiply by ``init`` forever) or ``dynamic``.
        init: Initial (or, for static, the fixed) scale.
        growth_interval: Finite steps in a row before the scale grows.
        growth_factor: Multiplier applied on growth (> 1).
        backoff_factor: Multiplier applied on overflow (in (0, 1)).
        min: Lower bound of the scale.
        max: Upper bound of the scale.
    """

    mode: str = "none"
    init: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min: float = 1.0
    max: float = 2.0**24


@dataclasses.dataclass(frozen=True)
class Fp8Scaling:
    """How a per-tensor fp8 scale is chosen (Transformer Engine's recipes).

    The scale ``s`` multiplies a tensor before the cast to fp8 and divides it after:
    ``s = fp8_max / amax / 2**margin`` (rounded down to a power of two with
    ``rounding: pow2``), kept as it was when ``amax`` is 0 or not finite.

    Attributes:
        recipe: ``delayed`` (the amax of earlier steps, a training step graph's state) or
            ``current`` (this step's amax, computed before the cast).
        history: Length of the delayed recipe's amax history (newest first).
        amax: ``max`` of the history or its ``most_recent`` entry.
        margin: Powers of two of headroom below ``fp8_max``.
        rounding: ``pow2`` or ``none`` (``SCALE_ROUNDING``).
    """

    recipe: str = "delayed"
    history: int = 1024
    amax: str = "max"
    margin: int = 0
    rounding: str = "pow2"


@dataclasses.dataclass(frozen=True)
class Fp8:
    """Which matrix-product inputs are quantised to fp8, in which format, with which scales.

    Attributes:
        ops: Op types whose (low-precision) data inputs are quantised: ``MatMul``, ``Gemm``.
        products: ``all`` of them, or the ``linear`` ones (``FP8_PRODUCTS``).
        forward: Format of activations and weights (forward values), E4M3 by default.
        backward: Format of gradients read by the backward products, E5M2 by default.
        scaling: The scaling recipe.
    """

    ops: tuple[str, ...] = ("MatMul", "Gemm")
    products: str = "all"
    forward: ir.DataType = ir.DataType.FLOAT8E4M3FN
    backward: ir.DataType = ir.DataType.FLOAT8E5M2
    scaling: Fp8Scaling = Fp8Scaling()


@dataclasses.dataclass(frozen=True)
class InitializerRange:
    """What to do with initializer values the low dtype cannot hold.

    Attributes:
        overflow: ``keep_fp32`` keeps the consuming ops in float32, ``clamp`` clamps to the
            largest finite value (recorded), ``error`` refuses to convert.
        underflow: ``keep`` lowers anyway and records how many nonzeros flush to zero,
            ``keep_fp32`` keeps the consuming ops in float32, ``error`` refuses.
    """

    overflow: str = "keep_fp32"
    underflow: str = "keep"


@dataclasses.dataclass(frozen=True)
class Override:
    """Force the precision of nodes whose name matches an fnmatch ``pattern``.

    Attributes:
        pattern: fnmatch pattern over node names (``*`` matches ``/``).
        precision: ``low`` (the policy's dtype) or ``float32`` (``Precision.FLOAT32``).
        reason: Why, shown in the audit.
    """

    pattern: str
    precision: str
    reason: str = ""

    def matches(self, node_name: str) -> bool:
        return fnmatch.fnmatchcase(node_name, self.pattern)


@dataclasses.dataclass(frozen=True)
class Pin:
    """Keep input slots of an op type in float32.

    A pinned slot whose type is tied to the op's compute type keeps the whole node float32.

    Attributes:
        op_type: ONNX op type (``domain.Op`` for other domains).
        inputs: Input slot indices.
        reason: Why, shown in the audit.
    """

    op_type: str
    inputs: tuple[int, ...]
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Policy:
    """A precision policy.

    Attributes:
        name: Preset name or file path.
        dtype: Target low dtype (``FLOAT`` means the identity policy).
        ops: Op type -> (category, reason).
        default_category: Category of ops the policy does not list.
        kernel_gaps: Op type -> reason, for ops the conversion target cannot run in ``dtype``
            (set by ``mpgraph.targets.with_target``): they are ``deny`` whatever ``ops`` says.
        overrides: Per-node overrides, first match wins.
        pins: Per-op input-slot float32 pins.
        keep_io_types: ``True`` keeps every graph input/output float32; a tuple names the ones
            to keep; ``False`` lets inputs/outputs take the low dtype.
        initializers: Range handling for weights.
        loss_scaling: Loss-scale settings for training graphs.
        description: One paragraph for ``policy show``.
        tf32: Whether float32 MatMul/Gemm/Conv may run as TF32 on providers that offer it
            (ORT's CUDA provider does unless told otherwise). ``False`` (every preset but
            ``tf32``) means strict IEEE float32: the runtime sets ``use_tf32=0``.
        fp8: fp8 formats and scaling of matrix-product inputs on top of the low dtype
            (``None``: no fp8; the ``fp8`` preset sets it).
    """

    name: str
    dtype: ir.DataType
    ops: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    default_category: Category = Category.DENY
    kernel_gaps: Mapping[str, str] = dataclasses.field(default_factory=dict)
    overrides: tuple[Override, ...] = ()
    pins: tuple[Pin, ...] = ()
    keep_io_types: bool | tuple[str, ...] = True
    initializers: InitializerRange = InitializerRange()
    loss_scaling: LossScaling = LossScaling()
    description: str = ""
    tf32: bool = False
    fp8: Fp8 | None = None

    @property
    def is_identity(self) -> bool:
        """True when the policy lowers nothing (dtype float32)."""
        return self.dtype == ir.DataType.FLOAT

    def category(self, op_type: str, domain: str = "") -> tuple[Category, str]:
        """Category and reason for an op type; unlisted ops get ``default_category``."""
        rule = self.rule(op_type, domain)
        return rule.category, rule.reason

    def rule(self, op_type: str, domain: str = "") -> OpRule:
        """The op type's ``OpRule``: a target's kernel gap, else the policy's entry, else its default."""
        key = op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"
        if key in self.kernel_gaps:
            return OpRule(Category.DENY, self.kernel_gaps[key], RuleSource.TARGET)
        if key in self.ops:
            category, reason = self.ops[key]
            return OpRule(Category(category), reason, RuleSource.POLICY)
        default = Category(self.default_category)
        return OpRule(default, f"not listed (default {default})", RuleSource.DEFAULT)

    def override_for(self, node_name: str) -> Override | None:
        """The first override whose pattern matches ``node_name``."""
        for override in self.overrides:
            if override.matches(node_name):
                return override
        return None

    def pinned_slots(self, op_type: str, domain: str = "") -> dict[int, str]:
        """Input slot -> reason for the op type's pins."""
        key = op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"
        slots: dict[int, str] = {}
        for pin in self.pins:
            if pin.op_type == key:
                for i in pin.inputs:
                    slots[i] = pin.reason or f"pinned by policy ({key} input {i})"
        return slots

    def keeps_io(self, name: str) -> bool:
        """Whether the graph input/output ``name`` must stay float32."""
        if isinstance(self.keep_io_types, bool):
            return self.keep_io_types
        return name in self.keep_io_types
