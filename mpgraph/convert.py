"""``mpgraph.convert``: compile a precision policy onto an ONNX graph."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph._ir.contract import StepContract
from mpgraph._ir.meta import Phase, Precision
from mpgraph.data import check_inputs, random_feeds, read_npz
from mpgraph.dtypes import float_weight_bytes, is_float
from mpgraph.errors import MpgraphError
from mpgraph.io import ModelLike, as_model, check_node_order, load_model, save_model
from mpgraph.passes import Pipeline
from mpgraph.passes.assign_precision import AssignPrecisionPass, Decision, record_decision
from mpgraph.passes.calibrate_range import CalibrateRangePass
from mpgraph.passes.emulate_precision import EmulatePrecisionPass
from mpgraph.passes.fold_casts import FoldCastsPass
from mpgraph.passes.infer_types import InferTypesPass
from mpgraph.passes.insert_casts import InsertCastsPass
from mpgraph.passes.quantize_fp8 import QuantizeFp8Pass
from mpgraph.passes.scale_loss import ScaleLossPass
from mpgraph.passes.upgrade_opset import UpgradeOpsetPass
from mpgraph.passes.validate_model import PROTO_LIMIT, ValidateModelPass, check_onnx
from mpgraph.policy import Policy, load_policy
from mpgraph.runtime.probe import Calibration, measure_ranges, run_with_values
from mpgraph.targets import cuda_opset_gaps, resolve_target, with_target

__all__ = ["convert", "convert_file", "build_pipeline", "CalibrateSpec"]

logger = logging.getLogger(__name__)

#: ``"auto"`` (random feeds when the low dtype is float16), ``"random"``, an ``.npz`` path,
#: a mapping of inputs, or ``None``/``False`` (no range check).
CalibrateSpec = str | os.PathLike | Mapping[str, np.ndarray] | bool | None

#: Rounds of "keep the ops that turned non-finite float32, convert again" before giving up.
MAX_FINITE_ROUNDS = 4


def build_pipeline(
    policy: Policy,
    *,
    emulate: bool = False,
    validate: bool = True,
    calibration: Calibration | None = None,
    infer_types: bool = True,
) -> Pipeline:
    """The passes ``convert`` runs, in order, as one ``PassManager``.

    Args:
        policy: The policy (with the target's kernel gaps, ``targets.with_target``).
        emulate: Add the CPU emulation (``EmulatePrecisionPass``).
        validate: End with ``ValidateModelPass``.
        calibration: Ranges measured on sample inputs (``CalibrateRangePass`` records them).
        infer_types: Start with ``InferTypesPass``; off when the types are already known.

    Example:
        >>> build_pipeline(load_policy("fp16"), emulate=True).names  # doctest: +NORMALIZE_WHITESPACE
        ['InferTypesPass', 'ScaleLossPass', 'AssignPrecisionPass', 'InsertCastsPass', 'FoldCastsPass',
         'EmulatePrecisionPass', 'FoldCastsPass', 'ValidateModelPass']
    """
    passes: list[ir.passes.PassBase] = [InferTypesPass()] if infer_types else []
    if calibration is not None and not policy.is_identity:
        passes.append(CalibrateRangePass(calibration.absmax()))
    if not policy.is_identity:
        # Training step graphs only; the loss-scale nodes it adds are float32 optimizer nodes.
        passes.append(ScaleLossPass(policy.loss_scaling))
    passes.append(AssignPrecisionPass(policy))
    if not policy.is_identity:
        passes += [InsertCastsPass(policy), FoldCastsPass()]
        if emulate:
            passes += [EmulatePrecisionPass(policy.dtype), FoldCastsPass()]
        if policy.fp8 is not None:
            # Then types for the values it made, as a second conversion would infer them.
            # (FoldCastsPass drops the low copies only the products read before.)
            passes += [QuantizeFp8Pass(policy.fp8, policy.dtype), FoldCastsPass(), InferTypesPass()]
    if validate:
        passes.append(ValidateModelPass())
    return Pipeline(passes)


def convert(
    model: ModelLike,
    policy: str | os.PathLike | Policy = "bf16",
    *,
    emulate: bool = False,
    validate: bool = True,
    calibrate: CalibrateSpec = "auto",
    upgrade_opset: bool = True,
    target: str | None = None,
) -> ir.Model:
    """Rewrite ``model`` so it computes per ``policy``; the input object is modified in place.

    Args:
        model: An ``onnx_ir.Model``, an ``onnx.ModelProto``, its bytes or a path.
        policy: A preset name (``bf16``), a YAML path, or a ``Policy``.
        emulate: Produce the CPU emulation (float32 compute, low-precision rounding) instead
            of the native lowering.
        validate: Run ``onnx.checker`` (full), strict shape inference and the precision
            invariants on the result.
        calibrate: The range check. ``"auto"`` (default): on seeded random inputs when the
            low dtype is float16 (bfloat16 has float32's range); ``"random"``; an ``.npz``
            path or a mapping of inputs; ``None`` or ``False``: off. Ops whose float32
            activations exceed the low dtype's range / 2 stay float32; then the result
            (emulated) runs on the same inputs, and ops whose output turns non-finite where
            float32 is finite stay float32 too, until no output is (``MAX_FINITE_ROUNDS``).
            The summary lands in ``mpgraph.calibration``. With ``"auto"``, a model ORT CPU
            cannot run in float32 is converted unchecked, with a warning.
        upgrade_opset: When the model's opset predates the low dtype in op schemas (bfloat16
            arrived in opset 13), upgrade it with ``onnx.version_converter`` first (recorded
            in ``mpgraph.opset_upgraded``); if the upgrade fails, those ops stay float32.
        target: ``cuda``, ``cpu`` or ``any`` (``mpgraph.targets``): ops the target has no
            low kernel for stay float32. Default ``cuda``, ``cpu`` when ``emulate``.
            Recorded in ``mpgraph.target``.

    Returns:
        The rewritten model, with every node's decision in its metadata.

    Example:
        >>> import onnx
        >>> from onnx import helper as h, TensorProto as T
        >>> g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"], name="allow1")], "g",
        ...     [h.make_tensor_value_info("x", T.FLOAT, [2, 3]), h.make_tensor_value_info("w", T.FLOAT, [3, 4])],
        ...     [h.make_tensor_value_info("y", T.FLOAT, [2, 4])])
        >>> m = convert(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]), "bf16")
        >>> [n.op_type for n in m.graph]
        ['Cast', 'Cast', 'MatMul', 'Cast']
        >>> m.graph.node("allow1").metadata_props["mpgraph.precision"]
        'bfloat16'
    """
    pol = load_policy(policy)
    where = resolve_target(target, emulate)
    with _collector_paused():
        ir_model = as_model(model)
        # The one order check of this entry (convert_file's is load_model(ordered=True)).
        check_node_order(ir_model, "model")
        return _convert(
            ir_model, pol, emulate=emulate, validate=validate, calibrate=calibrate, upgrade_opset=upgrade_opset,
            target=where,
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Loading and the passes allocate hundreds of thousands of short-lived IR objects; pausing
    the cyclic collector meanwhile saves about a third of the time on 10k-node graphs."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _convert(
    ir_model: ir.Model,
    pol: Policy,
    *,
    emulate: bool,
    validate: bool,
    calibrate: CalibrateSpec,
    upgrade_opset: bool,
    target: str,
) -> ir.Model:
    """``convert`` of a model already in onnx-ir and checked for node order."""
    if _emulated_already(ir_model, pol, emulate):
        return ir_model
    ir_model.metadata_props.setdefault(md.MODEL_WEIGHT_BYTES_BEFORE, str(float_weight_bytes(ir_model)))
    if upgrade_opset and not pol.is_identity:
        _upgrade_opset(ir_model, pol, target, emulate)
    # Kernel gaps at the opset the model ends with (before the upgrade they decided what it needs).
    effective = with_target(pol, target, ir_model, emulate=emulate)
    pristine = _range_check_start(ir_model, pol, calibrate)
    calibration = _calibrate(ir_model, pol, calibrate, pristine) if pristine is not None else None
    ir_model = _lower_until_finite(
        ir_model, effective, emulate=emulate, calibrate=calibrate, calibration=calibration, pristine=pristine
    )
    if validate:
        ValidateModelPass()(ir_model)
    _record(ir_model, pol, target, calibration)
    return ir_model


def _emulated_already(model: ir.Model, policy: Policy, emulate: bool) -> bool:
    """True when ``model`` is already the emulated lowering asked for (nothing to do).

    Raises:
        MpgraphError: ``model`` is an emulated lowering of something else.
    """
    props = model.metadata_props
    if props.get(md.MODEL_EMULATED) != "true":
        return False
    if emulate and props.get(md.MODEL_POLICY) == policy.name:
        logger.info("model is already the emulated lowering of policy %s; nothing to do", policy.name)
        return True
    raise MpgraphError("model is a CPU-emulated lowering; convert the original float32 model instead")


def _upgrade_opset(model: ir.Model, policy: Policy, target: str, emulate: bool) -> None:
    """``UpgradeOpsetPass`` for ``policy`` on ``target``; warn of ops CUDA cannot run at the new opset."""
    UpgradeOpsetPass(with_target(policy, target, model, emulate=emulate))(model)
    stranded = cuda_opset_gaps(model) if md.MODEL_OPSET_UPGRADED in model.metadata_props and not emulate else []
    if stranded:
        logger.warning(
            "opset upgraded %s: onnxruntime-gpu 1.31 has no CUDA kernel for %s at that opset, so on "
            "CUDA they run on the CPU provider; upgrade_opset=False (--no-opset-upgrade) keeps the "
            "original opset (ops that need the upgrade then stay float32)",
            model.metadata_props[md.MODEL_OPSET_UPGRADED], ", ".join(stranded),
        )


def _range_check_start(model: ir.Model, policy: Policy, calibrate: CalibrateSpec) -> onnx.ModelProto | None:
    """The float32 ``model``, typed and serialized once, when the range check runs; else None.

    The proto is what the range check runs, and the start of every retry.

    Raises:
        MpgraphError: A range check asked for explicitly on 2 GB of weights or more.
    """
    if md.MODEL_POLICY in model.metadata_props or not _wants_check(policy, calibrate):
        return None
    if float_weight_bytes(model) >= PROTO_LIMIT:
        # ORT opens models from serialized bytes here, which protobuf caps at 2 GB.
        if not (isinstance(calibrate, str) and calibrate == "auto"):
            raise MpgraphError("the range check runs models under 2 GB of weights only; pass calibrate=None (--no-calibrate)")
        logger.warning("range check skipped: over 2 GB of weights; the %s model is not range-checked", policy.dtype.name.lower())
        return None
    InferTypesPass()(model)  # the range check reduces float values only: it needs their types
    return ir.to_proto(model)


def _record(model: ir.Model, policy: Policy, target: str, calibration: Calibration | None) -> None:
    """Write what the conversion was into ``model``'s metadata (in this order: it is serialized)."""
    props = model.metadata_props
    props[md.MODEL_POLICY] = policy.name
    props[md.MODEL_DTYPE] = policy.dtype.name.lower()
    props[md.MODEL_TF32] = "true" if policy.tf32 else "false"
    props[md.MODEL_LOSS_SCALING] = json.dumps(
        {k: getattr(policy.loss_scaling, k) for k in policy.loss_scaling.__dataclass_fields__}, sort_keys=True
    )
    if not policy.is_identity:
        props.setdefault(md.MODEL_TARGET, target)
    if calibration is not None:
        props[md.MODEL_CALIBRATION] = _calibration_summary(model, calibration, policy)


def _lower_until_finite(
    ir_model: ir.Model,
    policy: Policy,
    *,
    emulate: bool,
    calibrate: CalibrateSpec,
    calibration: Calibration | None,
    pristine: onnx.ModelProto | None,
) -> ir.Model:
    """Run the pipeline; with a calibration, again from ``pristine`` while outputs turn non-finite.

    Each round keeps float32 the nodes where the (emulated) result first turns non-finite on
    the calibration inputs while float32 stays finite, until none does (``MAX_FINITE_ROUNDS``).
    """
    low = policy.dtype.name.lower()
    kept: dict[int, str] = {}  # node index -> why it stays float32 (non-finite in the low dtype)
    for attempt in range(MAX_FINITE_ROUNDS + 1):
        if attempt:
            assert pristine is not None
            ir_model = ir.from_proto(pristine)
            for i, node in enumerate(ir_model.graph):
                if i in kept:
                    record_decision(node, Decision(Precision.FLOAT32, Phase.FINITE, kept[i]))
        position = {node: i for i, node in enumerate(ir_model.graph)}
        # Without InferTypesPass when the types came with the proto.
        build_pipeline(policy, emulate=emulate, validate=False, calibration=calibration,
                       infer_types=pristine is None)(ir_model)
        if calibration is None or not _checks_finite(ir_model, policy):
            return ir_model
        try:
            bad, culprits = _nonfinite_sources(ir_model, calibration, emulate, policy.dtype)
        except MpgraphError as e:
            if not (isinstance(calibrate, str) and calibrate == "auto"):
                raise type(e)(f"finite check of the {low} result failed: {e}") from None
            logger.warning("finite check skipped (%s); --no-calibrate silences this", e)
            return ir_model
        if not bad:
            return ir_model
        new = {position[n]: f"calibration: output non-finite in {low} where float32 is finite" for n in culprits}
        if not culprits or attempt == MAX_FINITE_ROUNDS or set(new) <= set(kept):
            where = ", ".join(f"{n.op_type} '{n.name}'" for n in culprits[:3]) or "no low-precision node leads there"
            raise MpgraphError(
                f"outputs {bad[:3]} of the {low} conversion are non-finite on the calibration inputs "
                f"({calibration.source}) where float32 is finite ({where}; {len(kept)} ops kept float32 so far); "
                "pass calibrate=None (--no-calibrate) to write it anyway, or keep nodes float32 with a policy override"
            )
        kept.update(new)
        logger.info("kept %d ops float32 whose outputs turned non-finite; converting again", len(new))
    return ir_model


def _wants_check(policy: Policy, calibrate: CalibrateSpec) -> bool:
    """Whether ``calibrate`` asks for the range check under ``policy``."""
    if calibrate is None or calibrate is False or policy.is_identity:
        return False
    return not (isinstance(calibrate, str) and calibrate == "auto" and policy.dtype != ir.DataType.FLOAT16)


def _calibrate(model: ir.Model, policy: Policy, calibrate: CalibrateSpec, proto: onnx.ModelProto) -> Calibration | None:
    """Measure ranges per ``calibrate`` on ``proto`` (``model`` serialized); ``None`` if skipped."""
    auto = isinstance(calibrate, str) and calibrate == "auto"
    if calibrate is True or (isinstance(calibrate, str) and calibrate in ("auto", "random")):
        source = "random inputs, seed 0"
        try:
            feeds = random_feeds(model, seed=0)
        except MpgraphError as e:
            # A model that declares a huge or negative input dimension converted before the
            # range check was on by default; it still does, unchecked, and says why.
            if not auto:
                raise type(e)(f"range check: {e} (--calibrate FILE.npz)") from None
            logger.warning("range check skipped (%s); the %s model is not range-checked, --calibrate FILE.npz gives "
                           "inputs, --no-calibrate silences this", e, policy.dtype.name.lower())
            return None
    else:
        if isinstance(calibrate, (str, os.PathLike)):
            feeds, source = read_npz(calibrate), str(calibrate)
        else:
            feeds, source = dict(calibrate), "given inputs"
        # Given inputs with NaN or no samples range-check nothing, and the check would pass.
        check_inputs(feeds, f"calibration inputs ({source})")
    try:
        return measure_ranges(model, feeds, policy.dtype, source=source, proto=proto)
    except MpgraphError as e:
        if not auto:
            raise type(e)(f"calibration run failed: {e}") from None
        logger.warning("range check skipped (%s); the %s model is not range-checked, --no-calibrate silences this",
                       e, policy.dtype.name.lower())
        return None


def _checks_finite(model: ir.Model, policy: Policy) -> bool:
    # A loss-scaled step graph overflows on purpose: it detects inf/NaN and skips the update.
    return not (StepContract.is_training(model) and policy.loss_scaling.mode == "dynamic")


def _emulated_view(model: ir.Model, emulate: bool, low: ir.DataType) -> ir.Model:
    """``model`` itself when emulated, else an emulated copy (ORT CPU runs native float16 in float32)."""
    if emulate:
        return model
    # A clone shares tensors and value types with ``model``; the emulation replaces both, never
    # edits them (a third of a serialized round trip's time). The casts the emulation leaves as
    # float32 identities run as they are (no FoldCastsPass: this is a view for one run).
    copy = model.clone()
    EmulatePrecisionPass(low)(copy)
    return copy


def _nonfinite_sources(
    model: ir.Model, calibration: Calibration, emulate: bool, dtype: ir.DataType
) -> tuple[list[str], list[ir.Node]]:
    """Outputs of ``model`` non-finite where float32's are not, and the nodes to keep float32 for it.

    One run of the emulated lowering with only the graph outputs; only when one is non-finite
    where float32's is finite, a second run with every value exposed names the nodes whose
    output turns non-finite from finite inputs (for a float32 node, its low producers).
    """
    view = _emulated_view(model, emulate, dtype)
    outs = run_with_values(view, calibration.feeds, lambda v: False)
    bad_out = [
        n for n, ref in calibration.outputs.items()
        if n in outs and ref.dtype.kind == "f" and outs[n].shape == ref.shape
        and bool((np.isfinite(ref) & ~np.isfinite(outs[n].astype(np.float64))).any())
    ]
    if not bad_out:
        return [], []
    # Not the fp8 operands: numpy gets E4M3 as raw bytes and E5M2 not at all (their widened
    # float32 values are exposed).
    arrays = run_with_values(view, calibration.feeds,
                             lambda v: v.dtype is None or (is_float(v.dtype) and v.dtype.itemsize > 1))

    def nonfinite(name: str) -> bool:
        held = arrays.get(f"round/{name}", arrays.get(name))
        return held is not None and held.dtype.kind == "f" and not bool(np.isfinite(held).all())

    def finite_in_fp32(name: str) -> bool:
        found = calibration.ranges.get(name)
        return found is not None and bool(np.isfinite(found.absmax))

    low = dtype.name.lower()
    culprits: list[ir.Node] = []
    for node in model.graph:
        if md.NODE_INSERTED in node.metadata_props:
            continue
        outputs = [v.name for v in node.outputs if v.name]
        if not any(nonfinite(n) and finite_in_fp32(n) for n in outputs):
            continue
        inputs = [_origin(v) for v in node.inputs if v is not None]
        if any(v.name and nonfinite(v.name) for v in inputs):
            continue  # inherited, not born here
        if node.metadata_props.get(md.NODE_PRECISION) == low:
            culprits.append(node)
        else:  # e.g. Log of a value that flushed to zero: keep the nearest low producers float32
            culprits += _low_producers(node, low)
    return bad_out, list(dict.fromkeys(culprits))


def _low_producers(node: ir.Node, low: str | None) -> list[ir.Node]:
    """The nearest low-precision nodes upstream of ``node``, through float32 ones."""
    found: list[ir.Node] = []
    seen: set[ir.Node] = set()
    stack = [v for v in node.inputs if v is not None]
    while stack:
        producer = _origin(stack.pop()).producer()
        if producer is None or producer in seen:
            continue
        seen.add(producer)
        if producer.metadata_props.get(md.NODE_PRECISION) == low:
            found.append(producer)
        else:
            stack.extend(v for v in producer.inputs if v is not None and is_float(v.dtype))
    return found


def _origin(value: ir.Value) -> ir.Value:
    """The value behind mpgraph's casts (the name the float32 model knows)."""
    producer = value.producer()
    while producer is not None and producer.metadata_props.get(md.NODE_INSERTED) and producer.inputs and producer.inputs[0] is not None:
        value = producer.inputs[0]
        producer = value.producer()
    return value


def _held_low(model: ir.Model, low: ir.DataType) -> set[str]:
    """Names of the values converted ``model`` rounds to ``low``: typed ``low``, cast to it, or
    cast back from it.

    Both lowerings keep the float32 model's names: the native one casts a float32 value to
    ``low`` or computes it there; the emulation computes it in float32 under its name and
    rounds it with a ``Cast(to=low)``. A low graph output kept float32 is computed under
    another name and cast back to its own.
    """
    held = {v.name for v in model.graph.inputs if v.name and v.dtype == low}
    for node in model.graph:
        held.update(v.name for v in node.outputs if v.name and v.dtype == low)
        if node.op_type != "Cast" or not node.inputs or node.inputs[0] is None:
            continue
        source, to = node.inputs[0], node.attributes.get("to")
        if source.name and to is not None and to.as_int() == low.value:
            held.add(source.name)
        if source.dtype == low:
            held.update(v.name for v in node.outputs if v.name)
    return held


def _calibration_summary(model: ir.Model, calibration: Calibration, policy: Policy) -> str:
    kept: dict[str, int] = {}
    for node in model.graph:
        phase = node.metadata_props.get(md.NODE_PHASE)
        if phase in (Phase.CALIBRATION, Phase.FINITE):
            kind = "non-finite" if phase == Phase.FINITE else "range"
            kept[kind] = kept.get(kind, 0) + 1
    # Only values the result rounds to the low dtype can flush there: a step graph's optimizer
    # state and updates stay float32, however small their entries.
    held = _held_low(model, policy.dtype)
    flushing = [(name, r) for name, r in calibration.flushing() if name in held]
    return json.dumps(
        {
            "feeds": calibration.source,
            "dtype": policy.dtype.name.lower(),
            "kept_float32": kept,
            "values_flushing": len(flushing),
            "worst_flushing": [[name, float(f"{r.flushed:.3g}")] for name, r in flushing[:5]],
        },
        sort_keys=True,
    )


def convert_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    policy: str | os.PathLike | Policy = "bf16",
    *,
    emulate: bool = False,
    validate: bool = True,
    overwrite_input: bool = False,
    calibrate: CalibrateSpec = "auto",
    upgrade_opset: bool = True,
    target: str | None = None,
) -> ir.Model:
    """Convert the model at ``src`` and write it atomically to ``dst`` (arguments as ``convert``).

    Raises:
        MpgraphError: Bad input, bad policy, invalid result, or ``dst`` is ``src`` without
            ``overwrite_input``.
    """
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists() and src_p.exists() and dst_p.resolve() == src_p.resolve() and not overwrite_input:
        raise MpgraphError(f"{dst_p}: output is the input file; pass a different -o (or --overwrite-input)")
    pol = load_policy(policy)
    loaded = load_model(src_p, ordered=True)
    where = resolve_target(target, emulate)
    with _collector_paused():
        model = _convert(
            loaded, pol, emulate=emulate, validate=validate, calibrate=calibrate, upgrade_opset=upgrade_opset,
            target=where,
        )
    save_model(model, dst_p)
    if validate and float_weight_bytes(model) >= PROTO_LIMIT:
        # Too large for an in-memory proto: the pipeline checked invariants only; check the file.
        try:
            check_onnx(str(dst_p))
        except MpgraphError:
            dst_p.unlink(missing_ok=True)
            raise
    return model
