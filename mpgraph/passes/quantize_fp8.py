"""QuantizeFp8Pass: fp8 operands for the matrix products a policy lowers, with per-tensor scales.

Each operand ``x`` of a lowered MatMul/Gemm becomes ``Cast(Cast(x * s, fp8, saturate), float)
* (1 / s)``: exact fp8 rounding with saturation (ONNX ``Cast`` to float8, opset 19), which ONNX
Runtime's CPU provider runs. The product then reads the dequantised operand (float32 in the
emulated lowering, cast back to the low dtype in the native one).

The graph form is chosen for a later native lowering: ``mpgraph.fp8`` on the product names, per
input slot, the value holding the fp8 bits and the value holding ``1 / s``, which are
``com.microsoft.GemmFloat8``'s ``A``/``B`` and ``scaleA``/``scaleB``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.builder import Builder
from mpgraph._ir.contract import StepContract
from mpgraph._ir.links import forward_twins
from mpgraph._ir.names import NameScope
from mpgraph.errors import MpgraphError
from mpgraph.policy.schema import Fp8, Fp8Scaling

__all__ = ["FP8_MIN_OPSET", "QuantizeFp8Pass", "fp8_max"]

#: Cast to the float8 types (and its ``saturate``) arrived in opset 19.
FP8_MIN_OPSET = 19
#: Scope of every name the pass makes (``fp8/<tensor>/scale``, ``fp8/<tensor>/float8e4m3fn``).
_SCOPE = "fp8"
#: The delayed recipe's state: one scale per tensor ``[T]`` and the amax history ``[history, T]``
#: (newest first), as Transformer Engine keeps them; tensor ``i`` is column ``i``.
_SCALES = "fp8/scales"
_HISTORY = "fp8/amax_history"
#: The most inputs one Concat gets: ORT 1.31's CUDA Concat takes at most 32 while a CUDA graph
#: is captured ("CUDA Concat supports at most 32 inputs during CUDA Graph capture").
MAX_CONCAT_INPUTS = 32
#: Ops that only move or re-type data: an operand read through them is the same tensor.
_MOVES = frozenset({"Transpose", "Reshape", "Flatten", "Identity", "Squeeze", "Unsqueeze", "Cast"})
#: Data movement a backward product reads a saved activation through (its data is input 0).
_VIEWS = _MOVES - {"Cast"}
_NUMPY = {ir.DataType.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn, ir.DataType.FLOAT8E5M2: ml_dtypes.float8_e5m2}


def fp8_max(fmt: ir.DataType) -> float:
    """The largest finite value of an fp8 format (448 for E4M3FN, 57344 for E5M2)."""
    return float(ml_dtypes.finfo(_NUMPY[fmt]).max)


@dataclasses.dataclass
class _Tensor:
    """One quantised tensor: its scale (and state), shared by every product reading it."""

    key: str
    fmt: ir.DataType
    kind: str
    scale: ir.Value | None = None
    scale_inv: ir.Value | None = None
    amax: ir.Value | None = None
    index: int = -1
    gemms: list[str] = dataclasses.field(default_factory=list)


class QuantizeFp8Pass(ir.passes.InPlacePass):
    """Quantises the operands of the policy's fp8 products and adds their scale state.

    Runs after the precision lowering (and after the emulation): it quantises the operands of
    the MatMul/Gemm nodes decided in the low dtype whose op type ``fp8.ops`` lists.

    Rules:
        0. With ``products: linear``, only the products with an operand read (through data
           movement, rule 1) from an initializer, i.e. a weight or a step graph's parameter,
           and the backward products of those (linked by ``mpgraph.grad_of_value``, ``_ir.links``).
        1. An operand is a *tensor*: the value it is read through ``Transpose``, ``Reshape``,
           ``Flatten``, ``Identity``, ``Squeeze``, ``Unsqueeze`` and ``Cast`` from. A tensor
           a backward node makes is a gradient and gets ``fp8.backward`` (E5M2); every other
           (activations, weights, graph inputs) gets ``fp8.forward`` (E4M3). Example: the
           backward ``Gemm`` computing ``dW = x^T dY`` reads ``Flatten(x)``, the tensor ``x``
           (E4M3, the forward product's scale) and ``Flatten(dY)`` (E5M2).
        2. Each tensor has one scale ``s``; each operand value is quantised once:
           ``q = Cast(x * s, fp8, saturate=1)``, ``x' = Cast(q, float) * s_inv`` with
           ``s_inv = 1 / s``, cast back to the operand's dtype when that is not float32.
           ``x`` is the float32 value itself where the operand is its policy-boundary cast to
           the low dtype (a master weight, an activation of a float32 op): one rounding, to
           fp8, as a fused quantising kernel would do; a value computed in the low dtype is
           widened as it is.
        3. ``amax = ReduceMax(|x|)`` of the first operand read of the tensor (graph order).
           The scale from an amax ``a`` and a previous scale ``s0`` (``Fp8Scaling``):
           ``r = fp8_max / a / 2**margin``, rounded down to a power of two with ``pow2``; ``s0``
           where ``a`` is 0, inf or NaN or ``r`` is inf.
        4. Delayed recipe on a training step graph: the scales of all T tensors are one state
           input ``fp8/scales`` ``[T]`` (ones; tensor ``i`` reads ``Gather(scales, i)``) and
           their amax histories one ``fp8/amax_history`` ``[history, T]`` (zeros, newest row
           first). The step outputs the history with this step's amaxes pushed in as a row
           (an inf or NaN amax as 0, so one bad step does not hold the scales for ``history`` steps),
           and the scales derived from its column max (or newest row) with ``s0`` the incoming
           scales, element-wise in one set of nodes; both pairs join ``mpgraph.state_pairs``.
           Otherwise (current recipe, or an inference graph) ``s`` is derived per tensor from
           this run's amax with ``s0 = 1``.
        5. The product gets ``mpgraph.fp8`` (slot -> tensor, format, fp8 value, ``s_inv``), the
           model ``mpgraph.fp8`` (the recipe and every tensor); a model with that record is
           quantised already and left as it is.

    Raises:
        MpgraphError: The model's opset is below 19 (no fp8 ``Cast``), or a step graph has its
            own input named ``fp8/scales`` or ``fp8/amax_history``.
    """

    def __init__(self, fp8: Fp8, low: ir.DataType) -> None:
        super().__init__()
        self.fp8 = fp8
        self.low = low

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if md.MODEL_FP8 in model.metadata_props:
            return ir.passes.PassResult(model, False)
        gemms = self._products(model.graph)
        if not gemms:
            return ir.passes.PassResult(model, False)
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset < FP8_MIN_OPSET:
            raise MpgraphError(
                f"fp8: Cast to float8 needs opset {FP8_MIN_OPSET}, the model has opset {opset}; convert without "
                f"--no-opset-upgrade (upgrade_opset=True) so it is upgraded"
            )
        props = model.metadata_props
        delayed = self.fp8.scaling.recipe == "delayed" and StepContract.is_training(model) and StepContract.recorded(model)
        taken = [v.name for v in model.graph.inputs if v.name in (_SCALES, _HISTORY)]
        if delayed and taken:
            raise MpgraphError(f"fp8: the step graph has an input named '{taken[0]}', but it is not fp8 state "
                               f"(metadata '{md.MODEL_FP8}' records none); rename that input, since fp8 scaling "
                               "adds its state under that name")
        quantizer = _Quantizer(model, self.fp8, delayed)
        for gemm in gemms:
            quantizer.quantize(gemm)
        quantizer.finish()
        recipe = {**dataclasses.asdict(self.fp8.scaling), "used": "delayed" if delayed else "current"}
        props[md.MODEL_FP8] = json.dumps({
            "recipe": recipe,
            "formats": {"forward": self.fp8.forward.name.lower(), "backward": self.fp8.backward.name.lower()},
            "tensors": [quantizer.record(t) for t in quantizer.tensors.values()],
        })
        model.graph.sort()  # the quantise chains were appended after their readers
        return ir.passes.PassResult(model, True)

    def _products(self, graph: ir.Graph) -> list[ir.Node]:
        """Rule 0: the products to quantise."""
        low = self.low.name.lower()
        found = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type in self.fp8.ops
                 and n.metadata_props.get(md.NODE_PRECISION) == low]
        if self.fp8.products == "all":
            return found
        weights = set(graph.initializers.values())
        linear = {n for n in found if n.metadata_props.get(md.NODE_ROLE) != md.Role.BACKWARD
                  and any(v is not None and _source(v) in weights for v in n.inputs[:2])}
        twins = forward_twins(graph)
        return [n for n in found if n in linear or twins.get(n) in linear]


class _Quantizer:
    """Builds the quantise chains and the scale state of one model."""

    def __init__(self, model: ir.Model, fp8: Fp8, delayed: bool) -> None:
        self.model = model
        self.graph = model.graph
        self.fp8 = fp8
        self.scaling: Fp8Scaling = fp8.scaling
        self.delayed = delayed
        names = NameScope(model)
        self.builders = {role: _Fp8Builder(self.graph, role=role, scope=_SCOPE, names=names) for role in (*md.Role, "")}
        self.tensors: dict[ir.Value, _Tensor] = {}
        self.dequantized: dict[ir.Value, tuple[ir.Value, ir.Value]] = {}  # operand -> (fp8 bits, dequantised)
        self.amaxes: list[ir.Value] = []  # in tensor order
        # Delayed recipe: the state inputs (typed and registered by ``finish``).
        self.scales = ir.Value(name=_SCALES, type=ir.TensorType(ir.DataType.FLOAT))
        self.scales_inv: ir.Value | None = None
        self.history: ir.Value | None = None

    def quantize(self, gemm: ir.Node) -> None:
        """Rules 1-3 for the operands (inputs 0 and 1) of one product."""
        b = self.builders[gemm.metadata_props.get(md.NODE_ROLE, "")]
        slots: dict[str, dict[str, str]] = {}
        for slot in (0, 1):
            value = gemm.inputs[slot] if slot < len(gemm.inputs) else None
            if value is None or value.dtype is None or value.dtype.name not in ("FLOAT", "FLOAT16", "BFLOAT16"):
                continue
            tensor = self._tensor(value)
            if value not in self.dequantized:
                self.dequantized[value] = self._chain(b, value, tensor)
            bits, dequantized = self.dequantized[value]
            gemm.replace_input_with(slot, dequantized)
            tensor.gemms.append(gemm.name or "")
            assert tensor.scale_inv is not None
            slots[str(slot)] = {"tensor": tensor.key, "format": tensor.fmt.name.lower(), "fp8": bits.name or "",
                                "scale_inv": tensor.scale_inv.name or ""}
        if slots:
            gemm.metadata_props[md.NODE_FP8] = json.dumps(slots, sort_keys=True)

    def _tensor(self, value: ir.Value) -> _Tensor:
        source = _source(value)
        if source not in self.tensors:
            producer = source.producer()
            gradient = producer is not None and producer.metadata_props.get(md.NODE_ROLE) == md.Role.BACKWARD
            fmt = self.fp8.backward if gradient else self.fp8.forward
            self.tensors[source] = _Tensor(source.name or f"tensor{len(self.tensors)}", fmt,
                                           "gradient" if gradient else "forward")
        return self.tensors[source]

    def _chain(self, b: _Fp8Builder, value: ir.Value, tensor: _Tensor) -> tuple[ir.Value, ir.Value]:
        """Rule 2 (and rule 3 at the tensor's first operand): the fp8 bits and the dequantised operand."""
        key = tensor.key
        wide = _lowered_float32(value)
        viewed = _viewed_float32(value) if wide is None and tensor.kind == "forward" else None
        if viewed is not None:  # a saved activation: the float32 value the forward quantised, moved as read here
            wide, moves = viewed
            for move in moves:
                attrs = {a.name: a.value for a in move.attributes.values()}
                wide = b.op(move.op_type, wide, *move.inputs[1:], name=f"{key}/float32_{move.op_type.lower()}", **attrs)
                wide.dtype, wide.shape = ir.DataType.FLOAT, move.outputs[0].shape
        elif wide is None:
            wide = value if value.dtype == ir.DataType.FLOAT else b.cast_float(value, f"{key}/float32")
        if tensor.scale is None:
            self._scale(b, wide, tensor)
        assert tensor.scale is not None and tensor.scale_inv is not None
        scaled = b.op("Mul", wide, tensor.scale, name=f"{key}/scaled")
        bits = b.op("Cast", scaled, to=tensor.fmt, saturate=1, name=f"{key}/{tensor.fmt.name.lower()}")
        b.mark_cast(bits)
        back = b.cast_float(bits, f"{key}/fp8_value")
        out = b.op("Mul", back, tensor.scale_inv, name=f"{key}/dequantized")
        for v in (scaled, back, out):
            v.shape = value.shape
        bits.shape = value.shape
        if value.dtype != ir.DataType.FLOAT:
            out = b.op("Cast", out, to=value.dtype, name=f"{key}/dequantized_{value.dtype.name.lower()}")
            b.mark_cast(out)
            out.shape = value.shape
        return bits, out

    def _scale(self, b: _Fp8Builder, wide: ir.Value, tensor: _Tensor) -> None:
        """Rules 3-4 at the tensor's first operand: its amax, scale and ``1 / scale``."""
        key = tensor.key
        amax = b.op("ReduceMax", b.op("Abs", wide, name=f"{key}/abs"), keepdims=0, name=f"{key}/amax")
        amax.shape = ir.Shape([])
        tensor.amax, tensor.index = amax, len(self.amaxes)
        self.amaxes.append(amax)
        if not self.delayed:
            top = b.scalar32(fp8_max(tensor.fmt))
            tensor.scale = self._derive(b, amax, b.scalar32(1.0), top, key)
            tensor.scale_inv = b.op("Reciprocal", tensor.scale, name=f"{key}/scale_inv")
        else:
            index = b.const(np.array(tensor.index, np.int64))
            tensor.scale = b.op("Gather", self.scales, index, axis=0, name=f"{key}/scale")
            tensor.scale_inv = b.op("Gather", self._scales_inv(), index, axis=0, name=f"{key}/scale_inv")
        tensor.scale.shape = tensor.scale_inv.shape = ir.Shape([])

    def _scales_inv(self) -> ir.Value:
        """``1 / fp8/scales``, once for every tensor."""
        if self.scales_inv is None:
            self.scales_inv = self.builders[md.Role.FORWARD].op("Reciprocal", self.scales, name="scales_inv")
        return self.scales_inv

    def _derive(self, b: _Fp8Builder, amax: ir.Value, old: ir.Value, top: ir.Value, key: str) -> ir.Value:
        """Rule 3: the scale for ``amax`` (element-wise), ``old`` where ``amax`` gives none."""
        s = self.scaling
        ratio = b.op("Div", top, amax, name=f"{key}/headroom")
        if s.margin:
            ratio = b.op("Div", ratio, b.scalar32(2.0**s.margin), name=f"{key}/headroom_margin")
        scale = ratio
        if s.rounding == "pow2":
            # 2**floor(log2(r)), exact: Log can be off by an ulp, so the power is corrected by one step each way.
            exponent = b.op("Floor", b.op("Mul", b.op("Log", ratio, name=f"{key}/log"), b.scalar32(1 / math.log(2)),
                                          name=f"{key}/log2"), name=f"{key}/exponent")
            power = b.op("Pow", b.scalar32(2.0), exponent, name=f"{key}/pow2")
            half = b.op("Mul", power, b.scalar32(0.5), name=f"{key}/pow2_half")
            power = b.op("Where", b.op("Greater", power, ratio, name=f"{key}/pow2_over"), half, power, name=f"{key}/pow2_down")
            double = b.op("Mul", power, b.scalar32(2.0), name=f"{key}/pow2_double")
            scale = b.op("Where", b.op("LessOrEqual", double, ratio, name=f"{key}/pow2_under"), double, power,
                         name=f"{key}/pow2_up")
        positive = b.op("Greater", amax, b.scalar32(0.0), name=f"{key}/amax_positive")
        finite = b.op("Not", b.op("Or", b.op("IsInf", amax, name=f"{key}/amax_inf"),
                                  b.op("IsInf", ratio, name=f"{key}/headroom_inf"), name=f"{key}/any_inf"),
                      name=f"{key}/finite")
        valid = b.op("And", positive, finite, name=f"{key}/scale_valid")
        return b.op("Where", valid, scale, old, name=f"{key}/scale_new")

    def finish(self) -> None:
        """Rule 4 (delayed): this step's amaxes pushed into the history, the new scales, and
        their state pairs."""
        if not self.delayed or not self.amaxes:
            return
        opt, h, count = self.builders[md.Role.OPTIMIZER], self.scaling.history, len(self.amaxes)
        history = ir.Value(name=_HISTORY, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([h, count]))
        self._register(self.scales, np.ones((count,), np.float32))
        self._register(history, np.zeros((h, count), np.float32))
        raw = _concat_columns(opt, [opt.op("Unsqueeze", a, opt.ints([0, 1]), name=f"{t.key}/amax_2d")
                                    for t, a in zip(self.tensors.values(), self.amaxes)])
        bad = opt.op("Or", opt.op("IsNaN", raw, name="amaxes_nan"), opt.op("IsInf", raw, name="amaxes_inf"), name="amaxes_bad")
        newest = opt.op("Where", bad, opt.scalar32(0.0), raw, name="amaxes_finite")
        pushed = newest if h == 1 else opt.op(
            "Concat", newest, opt.op("Slice", history, opt.ints([0]), opt.ints([h - 1]), opt.ints([0]), name="amax_older"),
            axis=0, name="amax_pushed")
        reduced = opt.op("ReduceMax", newest if self.scaling.amax == "most_recent" else pushed, opt.ints([0]),
                         keepdims=0, name="amax_reduced")
        top = opt.const(np.array([fp8_max(t.fmt) for t in self.tensors.values()], np.float32))
        new_scales = self._derive(opt, reduced, self.scales, top, "scales")
        new_history = opt.op("Identity", pushed, name="amax_history_next")
        new_scales.name, new_history.name = opt.unique(f"{_SCALES}/updated"), opt.unique(f"{_HISTORY}/updated")
        new_scales.shape, new_history.shape = ir.Shape([count]), ir.Shape([h, count])
        self.graph.outputs.extend([new_scales, new_history])
        contract = StepContract.read(self.model)
        pairs = (*contract.state_pairs, (_SCALES, new_scales.name), (_HISTORY, new_history.name))
        dataclasses.replace(contract, state_pairs=pairs, loss_scale=None).record_state(self.model)  # adds no loss scaling
        self.history = history

    def _register(self, value: ir.Value, initial: np.ndarray) -> None:
        """``value`` becomes a state input whose initializer holds ``initial``."""
        value.shape = ir.Shape(list(initial.shape))
        value.const_value = ir.tensor(initial, name=value.name)
        self.graph.inputs.append(value)
        self.graph.register_initializer(value)

    def record(self, t: _Tensor) -> dict[str, object]:
        return {"tensor": t.key, "format": t.fmt.name.lower(), "kind": t.kind,
                "scale": _SCALES if self.delayed else None, "history": _HISTORY if self.delayed else None,
                "index": t.index, "amax": t.amax.name if t.amax is not None else None, "gemms": t.gemms}


def _concat_columns(b: _Fp8Builder, columns: list[ir.Value]) -> ir.Value:
    """``Concat(columns, axis=1)`` named ``amaxes``, as Concats of at most ``MAX_CONCAT_INPUTS``
    inputs: a group of consecutive columns each, then the groups (a tree where one level is not
    enough), so the columns keep their order and values. ORT's CUDA Concat refuses more inputs
    during a CUDA-graph capture (the zoo GPT's 39 tensors failed there on the H200)."""
    level = 0
    while len(columns) > MAX_CONCAT_INPUTS:
        columns = [columns[i] if i + 1 == len(columns) else
                   b.op("Concat", *columns[i:i + MAX_CONCAT_INPUTS], axis=1, name=f"amaxes_{level}_{i // MAX_CONCAT_INPUTS}")
                   for i in range(0, len(columns), MAX_CONCAT_INPUTS)]
        level += 1
    return b.op("Concat", *columns, axis=1, name="amaxes")


class _Fp8Builder(Builder):
    """A ``Builder`` whose nodes are marked as the fp8 pass's (float32 compute)."""

    def metadata(self) -> dict[str, str]:
        # An inference graph's nodes carry no role: neither do these.
        return {**({md.NODE_ROLE: self.role} if self.role else {}), md.NODE_INSERTED: "fp8", md.NODE_PRECISION: md.Precision.FLOAT32,
                md.NODE_REASON: "fp8 quantisation (policy fp8 section)"}

    def scalar32(self, number: float) -> ir.Value:
        return self.const(np.array(number, np.float32))

    def cast_float(self, value: ir.Value, name: str) -> ir.Value:
        out = self.op("Cast", value, to=ir.DataType.FLOAT, name=name)
        self.mark_cast(out)
        return out

    @staticmethod
    def mark_cast(value: ir.Value) -> None:
        """A Cast computes nothing: precision ``none``, like the casts of the lowering."""
        producer = value.producer()
        assert producer is not None
        producer.metadata_props[md.NODE_PRECISION] = md.Precision.NONE


def _lowered_float32(value: ir.Value) -> ir.Value | None:
    """The float32 value that ``value`` is the policy-boundary cast of (in the emulation:
    that cast's rounding), else ``None`` (a value computed in the low dtype)."""
    producer = value.producer()
    if _is_cast(producer, ir.DataType.FLOAT, "round"):
        assert producer is not None
        value = producer.inputs[0]
        producer = value.producer()
    if producer is None or producer.op_type != "Cast" or producer.metadata_props.get(md.NODE_INSERTED) != "cast":
        return None
    source = producer.inputs[0]
    return source if source is not None and source.dtype == ir.DataType.FLOAT else None


def _viewed_float32(value: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """The float32 value behind a policy-boundary cast that ``value`` reaches through data
    movement (``_VIEWS``), and those moves, innermost first; else ``None``. The backward reads a
    saved activation as the forward's product read it, flattened or transposed: quantised from
    the same float32 value, it is the forward's fp8 tensor moved, not a second rounding of its
    bf16 copy (which can differ where the bf16 rounding lands on an fp8 tie)."""
    moves: list[ir.Node] = []
    while True:
        producer = value.producer()
        if producer is None or producer.domain not in ("", "ai.onnx") or producer.op_type not in _VIEWS \
                or not producer.inputs or producer.inputs[0] is None:
            return None
        moves.append(producer)
        value = producer.inputs[0]
        wide = _lowered_float32(value)
        if wide is not None:
            return wide, moves[::-1]


def _is_cast(node: ir.Node | None, to: ir.DataType, inserted: str) -> bool:
    if node is None or node.op_type != "Cast" or node.metadata_props.get(md.NODE_INSERTED) != inserted:
        return False
    attr = node.attributes.get("to")
    return attr is not None and attr.as_int() == to.value and node.inputs[0] is not None


def _source(value: ir.Value) -> ir.Value:
    """Rule 1: the value behind data movement and float casts."""
    while True:
        producer = value.producer()
        if producer is None or producer.domain not in ("", "ai.onnx") or producer.op_type not in _MOVES:
            return value
        inner = producer.inputs[0] if producer.inputs else None
        if inner is None or (producer.op_type == "Cast" and (inner.dtype is None or inner.dtype.name not in
                                                              ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE"))):
            return value
        value = inner
