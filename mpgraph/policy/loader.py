"""Read and validate YAML policies.

Every error names the file, the line, the key path, the bad value and the valid choices::

    policies/mine.yaml:4: ops.allow.MatMull: unknown op type 'MatMull' (did you mean 'MatMul'?)

Schema (all keys optional except ``dtype``)::

    name: my-policy                 # defaults to the file stem
    extends: bf16                   # start from a preset or another file, then override
    description: one paragraph
    dtype: bfloat16                 # float16 | bfloat16 | float32 (aliases fp16, bf16, fp32)
    default: deny                   # category of unlisted ops: allow | infer | clear | deny
    ops:                            # category -> {op type: reason} (or a plain list of op types)
      allow: {MatMul: tensor cores, Gemm: tensor cores}
      infer: [Add, Relu]
      clear: [Reshape]
      deny: {Softmax: exp overflows in fp16}
    overrides:                      # first match wins; an extending file's come first
      - {match: "/head/*", precision: float32, reason: keep the head exact}
    pins:
      - {op: Resize, inputs: [1, 2], reason: roi and scales are coordinates}
    keep_io_types: true             # or a list of input/output names
    initializers: {overflow: keep_fp32, underflow: keep}
    loss_scaling: {mode: dynamic, init: 65536, growth_interval: 2000, growth_factor: 2.0,
                   backoff_factor: 0.5, min: 1.0, max: 16777216}
    fp8: {ops: [MatMul, Gemm], products: all, forward: float8e4m3fn, backward: float8e5m2,
          scaling: {recipe: delayed, history: 1024, amax: max, margin: 0, rounding: pow2}}
                                    # (see mpgraph.policy.fp8)
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import os
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mpgraph.errors import PolicyError
from mpgraph.policy.fp8 import parse_fp8
from mpgraph.policy.schema import (
    CATEGORIES,
    DTYPES,
    LOSS_SCALING_MODES,
    OVERFLOW_ACTIONS,
    UNDERFLOW_ACTIONS,
    InitializerRange,
    LossScaling,
    Override,
    Pin,
    Policy,
)
from mpgraph.policy.validate import (
    PolicyDoc,
    check_choice,
    check_keys,
    check_number,
    check_op_type,
    did_you_mean,
)

__all__ = ["load_policy", "load_policy_file", "list_presets", "preset_path", "parse_policy"]

logger = logging.getLogger(__name__)

_TOP_KEYS = (
    "name",
    "extends",
    "description",
    "dtype",
    "default",
    "ops",
    "overrides",
    "pins",
    "keep_io_types",
    "initializers",
    "loss_scaling",
    "tf32",
    "fp8",
)
_LOSS_KEYS = tuple(f.name for f in dataclasses.fields(LossScaling))
_INIT_KEYS = tuple(f.name for f in dataclasses.fields(InitializerRange))


def _presets_dir() -> Path:
    # A source checkout keeps presets in the top-level rules/; a wheel ships them as mpgraph.rules.
    checkout = Path(__file__).resolve().parents[2] / "rules"
    if checkout.is_dir():
        return checkout
    return Path(str(importlib.resources.files("mpgraph.rules")))


def list_presets() -> list[str]:
    """Names of the presets shipped in ``rules/``."""
    return sorted(p.stem for p in _presets_dir().glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of a preset's YAML file; raises ``PolicyError`` for an unknown name."""
    path = _presets_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PolicyError(
            f"unknown preset '{name}'{did_you_mean(name, list_presets())}; "
            f"valid presets: {', '.join(list_presets())} (or a path to a .yaml file)"
        )
    return path


def load_policy(spec: str | os.PathLike[str] | Policy) -> Policy:
    """Load a policy from a preset name, a YAML path, or pass a ``Policy`` through.

    Example:
        >>> load_policy("bf16").dtype.name
        'BFLOAT16'
    """
    if isinstance(spec, Policy):
        return spec
    text = os.fspath(spec)
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text or Path(text).is_file()
    stem = Path(text).stem
    if text.endswith((".yaml", ".yml")) and os.sep not in text and not Path(text).exists() and stem in list_presets():
        # `--policy bf16.yaml` in a directory without that file means the preset.
        logger.warning(
            "%s: no such file; using the preset '%s' (`mpgraph policy init %s -o %s` writes a copy to edit)",
            text, stem, stem, text,
        )
        return _load_file(str(preset_path(stem)), ())
    path = Path(text) if looks_like_path else preset_path(text)
    return _load_file(str(path.resolve()) if looks_like_path else str(path), ())


def load_policy_file(path: str | os.PathLike[str]) -> Policy:
    """Load a policy from a YAML file, never a preset (``bf16.yaml`` must exist here).

    Raises:
        PolicyError: The file is missing, a directory, or not a valid policy.
    """
    file = Path(path)
    if not file.exists():
        raise PolicyError(f"{file}: policy file not found")
    if file.is_dir():
        raise PolicyError(f"{file}: is a directory, expected a policy .yaml file")
    return _load_file(str(file.resolve()), ())


def _load_file(path: str, chain: tuple[str, ...]) -> Policy:
    if path in chain:
        raise PolicyError(f"{path}: extends: cycle {' -> '.join((*chain, path))}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(f"{path}: policy file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{path}: cannot read policy file ({e})") from e
    return parse_policy(text, path, _chain=(*chain, path))


#: The largest ``growth_interval``: the graph counts finite steps in float32 (exact to 2**24),
#: and no run reaches 2**31 steps.
_MAX_INTERVAL = 2**31 - 1


def parse_policy(text: str, path: str = "<string>", *, _chain: tuple[str, ...] = ()) -> Policy:
    """Parse and validate a policy from YAML text.

    The keys are read one section at a time, in this order (so the first bad key reported
    is the first in this list): ``extends`` (the base every other key starts from), then
    ``dtype``, ``default``, ``ops``, ``overrides``, ``pins``, ``keep_io_types``,
    ``initializers``, ``loss_scaling``, ``tf32``, ``fp8``, ``name`` and ``description``.

    Args:
        text: YAML source.
        path: Shown in errors; also the default ``name`` (its stem).

    Raises:
        PolicyError: Naming file, line, key path, bad value and the valid choices.
    """
    doc = PolicyDoc(text, path)
    data = doc.data
    if not isinstance(data, dict):
        doc.fail((), f"a policy is a YAML mapping with keys {', '.join(_TOP_KEYS)}")
    check_keys(doc, (), data, _TOP_KEYS)
    base = _parse_extends(doc, data, path, _chain)
    dtype = _parse_dtype(doc, data, base)
    default = base.default_category if base else "deny"
    if "default" in data:
        default = check_choice(doc, ("default",), data["default"], CATEGORIES)
    ops = _parse_ops(doc, data, base)
    overrides = _parse_overrides(doc, data, base)
    pins = _parse_pins(doc, data, base)
    keep_io = _parse_keep_io_types(doc, data, base)
    init_range = _parse_initializers(doc, data, base)
    loss = _parse_loss_scaling(doc, data, base)
    tf32 = base.tf32 if base else False
    if "tf32" in data:
        if not isinstance(data["tf32"], bool):
            doc.fail(("tf32",), f"invalid value {data['tf32']!r}; expected true or false")
        tf32 = data["tf32"]
    fp8 = parse_fp8(doc, data, base, dtype)
    name = data.get("name", Path(path).stem)
    description = data.get("description", base.description if base else "")
    return Policy(
        name=str(name),
        dtype=dtype,
        ops=ops,
        default_category=default,
        overrides=overrides,
        pins=pins,
        keep_io_types=keep_io,
        initializers=init_range,
        loss_scaling=loss,
        description=str(description).strip(),
        tf32=tf32,
        fp8=fp8,
    )


def _parse_extends(doc: PolicyDoc, data: dict[str, Any], path: str, chain: tuple[str, ...]) -> Policy | None:
    """The policy ``extends`` names (a preset, or a file relative to ``path``), if any."""
    if "extends" not in data:
        return None
    parent = data["extends"]
    if not isinstance(parent, str):
        doc.fail(("extends",), f"invalid value {parent!r}; expected a preset name or path")
    if parent.endswith((".yaml", ".yml")):
        parent_path = Path(parent)
        if not parent_path.is_absolute():
            parent_path = Path(path).parent / parent_path
        resolved = str(parent_path.resolve())
        if resolved in chain:
            doc.fail(("extends",), f"cycle {' -> '.join((*chain, resolved))}")
        if not Path(resolved).is_file():
            doc.fail(("extends",), f"policy file not found: {resolved}")
        return _load_file(resolved, chain)
    if parent in list_presets():
        return _load_file(str(preset_path(parent)), chain)
    doc.fail(
        ("extends",),
        f"unknown preset {parent!r}{did_you_mean(parent, list_presets())}; "
        f"valid: {', '.join(list_presets())} (or a path ending in .yaml)",
    )


def _parse_dtype(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> ir.DataType:
    """``dtype`` (required unless the base has one)."""
    if "dtype" in data:
        return DTYPES[check_choice(doc, ("dtype",), data["dtype"], tuple(DTYPES))]
    if base is not None:
        return base.dtype
    doc.fail(("dtype",), f"missing required key; valid: {', '.join(DTYPES)}")


def _parse_ops(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> dict[str, tuple[str, str]]:
    """``ops``: category -> {op type: reason} or [op type]; each op type listed once."""
    ops: dict[str, tuple[str, str]] = dict(base.ops) if base else {}
    if "ops" not in data:
        return ops
    check_keys(doc, ("ops",), data["ops"], CATEGORIES)
    seen: dict[str, str] = {}
    for category, entries in data["ops"].items():
        kp = ("ops", category)
        if entries is None:
            continue
        if isinstance(entries, list):
            entries = {str(e): "" for e in entries}
        if not isinstance(entries, dict):
            doc.fail(kp, f"expected a mapping of op type to reason or a list, got {entries!r}")
        for op_type, reason in entries.items():
            okp = (*kp, op_type)
            check_op_type(doc, okp, op_type)
            if op_type in seen:
                doc.fail(okp, f"op type listed twice (also in ops.{seen[op_type]})")
            seen[op_type] = category
            ops[op_type] = (category, str(reason) if reason is not None else "")
    return ops


def _parse_overrides(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> tuple[Override, ...]:
    """``overrides``: this file's, then the base's (first match wins)."""
    overrides: list[Override] = []
    if "overrides" in data:
        if not isinstance(data["overrides"], list):
            doc.fail(("overrides",), "expected a list of {match, precision, reason}")
        for i, entry in enumerate(data["overrides"]):
            kp = ("overrides", str(i))
            check_keys(doc, kp, entry, ("match", "precision", "reason"))
            if not isinstance(entry.get("match"), str):
                doc.fail((*kp, "match"), "missing or non-string node-name pattern")
            precision = check_choice(doc, (*kp, "precision"), entry.get("precision"), ("low", "float32"))
            overrides.append(Override(entry["match"], precision, str(entry.get("reason", ""))))
    # First match wins, so the extending file's overrides go before its parent's.
    overrides += base.overrides if base else ()
    return tuple(overrides)


def _parse_pins(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> tuple[Pin, ...]:
    """``pins``: the base's, then this file's; each ``{op, inputs, reason}``."""
    pins = list(base.pins) if base else []
    if "pins" not in data:
        return tuple(pins)
    if not isinstance(data["pins"], list):
        doc.fail(("pins",), "expected a list of {op, inputs, reason}")
    for i, entry in enumerate(data["pins"]):
        kp = ("pins", str(i))
        check_keys(doc, kp, entry, ("op", "inputs", "reason"))
        op_type = entry.get("op")
        if not isinstance(op_type, str):
            doc.fail((*kp, "op"), "missing or non-string op type")
        check_op_type(doc, (*kp, "op"), op_type)
        slots = entry.get("inputs")
        if not isinstance(slots, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots
        ):
            doc.fail((*kp, "inputs"), f"invalid value {slots!r}; expected a list of input indices >= 0")
        pins.append(Pin(op_type, tuple(slots), str(entry.get("reason", ""))))
    return tuple(pins)


def _parse_keep_io_types(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> bool | tuple[str, ...]:
    """``keep_io_types``: true, false or a list of input/output names."""
    if "keep_io_types" not in data:
        return base.keep_io_types if base else True
    value = data["keep_io_types"]
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    doc.fail(("keep_io_types",), f"invalid value {value!r}; expected true, false or a list of names")


def _parse_initializers(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> InitializerRange:
    """``initializers``: what to do with weights beyond the low dtype's range."""
    init_range = base.initializers if base else InitializerRange()
    if "initializers" not in data:
        return init_range
    check_keys(doc, ("initializers",), data["initializers"], _INIT_KEYS)
    section = data["initializers"]
    return InitializerRange(
        overflow=check_choice(doc, ("initializers", "overflow"), section.get("overflow", init_range.overflow), OVERFLOW_ACTIONS),
        underflow=check_choice(doc, ("initializers", "underflow"), section.get("underflow", init_range.underflow), UNDERFLOW_ACTIONS),
    )


def _parse_loss_scaling(doc: PolicyDoc, data: dict[str, Any], base: Policy | None) -> LossScaling:
    """``loss_scaling``: the base's settings with this file's keys replaced, then checked."""
    loss = base.loss_scaling if base else LossScaling()
    if "loss_scaling" not in data:
        return loss
    section = data["loss_scaling"]
    check_keys(doc, ("loss_scaling",), section, _LOSS_KEYS)
    values = dataclasses.asdict(loss)
    for key, value in section.items():
        kp = ("loss_scaling", key)
        if key == "mode":
            values[key] = check_choice(doc, kp, value, LOSS_SCALING_MODES)
        elif key == "growth_interval":
            values[key] = int(check_number(doc, kp, value, integer=True))
            if not 1 <= values[key] <= _MAX_INTERVAL:
                text = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}...({len(str(value))} digits)"
                doc.fail(kp, f"invalid value {text}; expected an integer >= 1 and at most {_MAX_INTERVAL}")
        else:
            values[key] = float(check_number(doc, kp, value))
    loss = LossScaling(**values)
    _validate_loss_scaling(doc, loss)
    return loss


def _validate_loss_scaling(doc: PolicyDoc, loss: LossScaling) -> None:
    kp = ("loss_scaling",)
    if not loss.init > 0:
        doc.fail((*kp, "init"), f"invalid value {loss.init!r}; expected > 0")
    if not loss.growth_factor > 1:
        doc.fail((*kp, "growth_factor"), f"invalid value {loss.growth_factor!r}; expected > 1")
    if not 0 < loss.backoff_factor < 1:
        doc.fail((*kp, "backoff_factor"), f"invalid value {loss.backoff_factor!r}; expected in (0, 1)")
    if not 0 < loss.min <= loss.max:
        doc.fail((*kp, "min"), f"invalid bounds min={loss.min!r}, max={loss.max!r}; expected 0 < min <= max")
    if not loss.min <= loss.init <= loss.max:
        doc.fail((*kp, "init"), f"invalid value {loss.init!r}; expected within [min, max] = [{loss.min}, {loss.max}]")
