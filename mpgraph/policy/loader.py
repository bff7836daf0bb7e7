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
import difflib
import functools
import importlib.resources
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import onnx
import onnx_ir as ir
import yaml

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
            f"unknown preset '{name}'{_suggest(name, list_presets())}; "
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


@functools.lru_cache(maxsize=32)
def _compose(text: str) -> yaml.Node | None:
    """The YAML node tree of ``text``, parsed once per distinct text.

    Parsing is most of a conversion's time on small models: the pure-Python parser took 70 ms
    for the fp16 preset and its ``extends`` base, 36 of the 54 s that converting 128 single-op
    models four ways took. Keyed by the text itself, so an edited file is parsed again; the
    tree is only read afterwards (``_Doc`` builds its own containers from it). A text that
    fails raises each time (``lru_cache`` keeps results only).
    """
    return yaml.compose(text, Loader=yaml.SafeLoader)

#: Nodes a policy may expand to once aliases are resolved; a few hundred in real policies.
_MAX_NODES = 100_000
#: Nesting depth of mappings and lists; real policies nest 4 deep.
_MAX_DEPTH = 64


class _Doc:
    """A parsed YAML document that remembers the line of every key path.

    Aliases are expanded with a budget: a recursive alias (``&a [*a]``) and an alias bomb
    (each level repeating the one below) are refused by line before they are expanded.
    """

    def __init__(self, text: str, path: str) -> None:
        self.path = path
        self.lines: dict[tuple[str, ...], int] = {}
        self._expanded = 0
        self._open: set[int] = set()
        try:
            node = _compose(text)
        except RecursionError:
            raise PolicyError(f"{path}: invalid YAML: nested too deeply") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise PolicyError(f"{path}{line}: invalid YAML: {problem}") from e
        if node is not None:
            self._measure(node, {}, set(), 0)
        self.data = self._build(node, ()) if node is not None else None

    def _measure(self, node: yaml.Node, sizes: dict[int, int], stack: set[int], depth: int) -> int:
        """Nodes ``node`` expands to, counted on the alias graph (each node once), refusing a
        recursive alias, an expansion over ``_MAX_NODES`` or nesting over ``_MAX_DEPTH``."""
        key = id(node)
        if key in sizes:
            return sizes[key]
        line = node.start_mark.line + 1
        if key in stack:
            raise PolicyError(f"{self.path}:{line}: recursive alias (a value that contains itself)")
        if depth > _MAX_DEPTH:
            raise PolicyError(f"{self.path}:{line}: nested deeper than {_MAX_DEPTH} levels")
        total = 1
        if isinstance(node, yaml.CollectionNode):
            stack.add(key)
            children = [v for pair in node.value for v in pair] if isinstance(node, yaml.MappingNode) else node.value
            for child in children:
                total += self._measure(child, sizes, stack, depth + 1)
                if total > _MAX_NODES:
                    raise PolicyError(f"{self.path}:{line}: aliases would expand to more than {_MAX_NODES:,} nodes "
                                      "(an alias bomb?); refused before expanding")
            stack.discard(key)
        sizes[key] = total
        return total

    def _build(self, node: yaml.Node, keypath: tuple[str, ...]) -> Any:
        self.lines.setdefault(keypath, node.start_mark.line + 1)
        self._expanded += 1
        if self._expanded > _MAX_NODES:
            self.fail(keypath, f"aliases expand to more than {_MAX_NODES:,} nodes (an alias bomb?); write the values out")
        if len(keypath) > _MAX_DEPTH:
            self.fail(keypath, f"nested deeper than {_MAX_DEPTH} levels")
        if isinstance(node, yaml.CollectionNode):
            if id(node) in self._open:
                self.fail(keypath, "recursive alias (a value that contains itself)")
            self._open.add(id(node))
            try:
                return self._build_collection(node, keypath)
            finally:
                self._open.discard(id(node))
        return self._build_scalar(node)

    def _build_collection(self, node: yaml.CollectionNode, keypath: tuple[str, ...]) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            for knode, vnode in node.value:
                key = str(knode.value)
                if key in out:
                    self.lines[(*keypath, key)] = knode.start_mark.line + 1
                    self.fail((*keypath, key), "duplicate key")
                self.lines[(*keypath, key)] = knode.start_mark.line + 1
                out[key] = self._build(vnode, (*keypath, key))
            return out
        return [self._build(v, (*keypath, str(i))) for i, v in enumerate(node.value)]

    def _build_scalar(self, node: yaml.Node) -> Any:
        try:
            return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise PolicyError(f"{self.path}:{node.start_mark.line + 1}: invalid YAML: {problem}") from e

    def fail(self, keypath: tuple[str, ...], message: str) -> NoReturn:
        line = ""
        for i in range(len(keypath), -1, -1):
            if keypath[:i] in self.lines:
                line = f":{self.lines[keypath[:i]]}"
                break
        where = ".".join(keypath) or "<top>"
        raise PolicyError(f"{self.path}{line}: {where}: {message}")


def _suggest(bad: str, valid: Iterator[str] | list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(bad, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _choice(doc: _Doc, keypath: tuple[str, ...], value: Any, valid: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in valid:
        doc.fail(
            keypath,
            f"invalid value {value!r}{_suggest(str(value), valid)}; valid: {', '.join(valid)}",
        )
    return value


def _check_keys(doc: _Doc, keypath: tuple[str, ...], mapping: Any, valid: tuple[str, ...]) -> None:
    if not isinstance(mapping, dict):
        doc.fail(keypath, f"expected a mapping with keys {', '.join(valid)}, got {mapping!r}")
    for key in mapping:
        if key not in valid:
            doc.fail((*keypath, key), f"unknown key{_suggest(key, valid)}; valid: {', '.join(valid)}")


@functools.lru_cache(maxsize=1)
def _known_op_types() -> frozenset[str]:
    return frozenset(s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx"))


def _check_op_type(doc: _Doc, keypath: tuple[str, ...], op_type: str) -> None:
    if "." not in op_type and op_type not in _known_op_types():
        doc.fail(
            keypath,
            f"unknown op type '{op_type}'{_suggest(op_type, sorted(_known_op_types()))}"
            "; use 'domain.Op' for ops outside the default ONNX domain",
        )


# YAML 1.2 floats that PyYAML (YAML 1.1) leaves as strings: 1e9 (no dot), 1.5e3 (no exponent sign).
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


#: The largest ``growth_interval``: the graph counts finite steps in float32 (exact to 2**24),
#: and no run reaches 2**31 steps.
_MAX_INTERVAL = 2**31 - 1


def _number(doc: _Doc, keypath: tuple[str, ...], value: Any, *, integer: bool = False) -> float:
    if not integer and isinstance(value, str) and _FLOAT_RE.fullmatch(value):
        value = float(value)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        doc.fail(keypath, f"invalid value {value!r}; expected {kind}")
    if not integer:
        try:
            float(value)
        except OverflowError:  # a YAML integer of hundreds of digits
            text = str(value)
            doc.fail(keypath, f"invalid value {text[:12]}...({len(text)} digits); expected a number below 1.8e308")
    return value


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
    doc = _Doc(text, path)
    data = doc.data
    if not isinstance(data, dict):
        doc.fail((), f"a policy is a YAML mapping with keys {', '.join(_TOP_KEYS)}")
    _check_keys(doc, (), data, _TOP_KEYS)
    base = _parse_extends(doc, data, path, _chain)
    dtype = _parse_dtype(doc, data, base)
    default = base.default_category if base else "deny"
    if "default" in data:
        default = _choice(doc, ("default",), data["default"], CATEGORIES)
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


def _parse_extends(doc: _Doc, data: dict[str, Any], path: str, chain: tuple[str, ...]) -> Policy | None:
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
        f"unknown preset {parent!r}{_suggest(parent, list_presets())}; "
        f"valid: {', '.join(list_presets())} (or a path ending in .yaml)",
    )


def _parse_dtype(doc: _Doc, data: dict[str, Any], base: Policy | None) -> ir.DataType:
    """``dtype`` (required unless the base has one)."""
    if "dtype" in data:
        return DTYPES[_choice(doc, ("dtype",), data["dtype"], tuple(DTYPES))]
    if base is not None:
        return base.dtype
    doc.fail(("dtype",), f"missing required key; valid: {', '.join(DTYPES)}")


def _parse_ops(doc: _Doc, data: dict[str, Any], base: Policy | None) -> dict[str, tuple[str, str]]:
    """``ops``: category -> {op type: reason} or [op type]; each op type listed once."""
    ops: dict[str, tuple[str, str]] = dict(base.ops) if base else {}
    if "ops" not in data:
        return ops
    _check_keys(doc, ("ops",), data["ops"], CATEGORIES)
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
            _check_op_type(doc, okp, op_type)
            if op_type in seen:
                doc.fail(okp, f"op type listed twice (also in ops.{seen[op_type]})")
            seen[op_type] = category
            ops[op_type] = (category, str(reason) if reason is not None else "")
    return ops


def _parse_overrides(doc: _Doc, data: dict[str, Any], base: Policy | None) -> tuple[Override, ...]:
    """``overrides``: this file's, then the base's (first match wins)."""
    overrides: list[Override] = []
    if "overrides" in data:
        if not isinstance(data["overrides"], list):
            doc.fail(("overrides",), "expected a list of {match, precision, reason}")
        for i, entry in enumerate(data["overrides"]):
            kp = ("overrides", str(i))
            _check_keys(doc, kp, entry, ("match", "precision", "reason"))
            if not isinstance(entry.get("match"), str):
                doc.fail((*kp, "match"), "missing or non-string node-name pattern")
            precision = _choice(doc, (*kp, "precision"), entry.get("precision"), ("low", "float32"))
            overrides.append(Override(entry["match"], precision, str(entry.get("reason", ""))))
    # First match wins, so the extending file's overrides go before its parent's.
    overrides += base.overrides if base else ()
    return tuple(overrides)


def _parse_pins(doc: _Doc, data: dict[str, Any], base: Policy | None) -> tuple[Pin, ...]:
    """``pins``: the base's, then this file's; each ``{op, inputs, reason}``."""
    pins = list(base.pins) if base else []
    if "pins" not in data:
        return tuple(pins)
    if not isinstance(data["pins"], list):
        doc.fail(("pins",), "expected a list of {op, inputs, reason}")
    for i, entry in enumerate(data["pins"]):
        kp = ("pins", str(i))
        _check_keys(doc, kp, entry, ("op", "inputs", "reason"))
        op_type = entry.get("op")
        if not isinstance(op_type, str):
            doc.fail((*kp, "op"), "missing or non-string op type")
        _check_op_type(doc, (*kp, "op"), op_type)
        slots = entry.get("inputs")
        if not isinstance(slots, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots
        ):
            doc.fail((*kp, "inputs"), f"invalid value {slots!r}; expected a list of input indices >= 0")
        pins.append(Pin(op_type, tuple(slots), str(entry.get("reason", ""))))
    return tuple(pins)


def _parse_keep_io_types(doc: _Doc, data: dict[str, Any], base: Policy | None) -> bool | tuple[str, ...]:
    """``keep_io_types``: true, false or a list of input/output names."""
    if "keep_io_types" not in data:
        return base.keep_io_types if base else True
    value = data["keep_io_types"]
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    doc.fail(("keep_io_types",), f"invalid value {value!r}; expected true, false or a list of names")


def _parse_initializers(doc: _Doc, data: dict[str, Any], base: Policy | None) -> InitializerRange:
    """``initializers``: what to do with weights beyond the low dtype's range."""
    init_range = base.initializers if base else InitializerRange()
    if "initializers" not in data:
        return init_range
    _check_keys(doc, ("initializers",), data["initializers"], _INIT_KEYS)
    section = data["initializers"]
    return InitializerRange(
        overflow=_choice(doc, ("initializers", "overflow"), section.get("overflow", init_range.overflow), OVERFLOW_ACTIONS),
        underflow=_choice(doc, ("initializers", "underflow"), section.get("underflow", init_range.underflow), UNDERFLOW_ACTIONS),
    )


def _parse_loss_scaling(doc: _Doc, data: dict[str, Any], base: Policy | None) -> LossScaling:
    """``loss_scaling``: the base's settings with this file's keys replaced, then checked."""
    loss = base.loss_scaling if base else LossScaling()
    if "loss_scaling" not in data:
        return loss
    section = data["loss_scaling"]
    _check_keys(doc, ("loss_scaling",), section, _LOSS_KEYS)
    values = dataclasses.asdict(loss)
    for key, value in section.items():
        kp = ("loss_scaling", key)
        if key == "mode":
            values[key] = _choice(doc, kp, value, LOSS_SCALING_MODES)
        elif key == "growth_interval":
            values[key] = int(_number(doc, kp, value, integer=True))
            if not 1 <= values[key] <= _MAX_INTERVAL:
                text = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}...({len(str(value))} digits)"
                doc.fail(kp, f"invalid value {text}; expected an integer >= 1 and at most {_MAX_INTERVAL}")
        else:
            values[key] = float(_number(doc, kp, value))
    loss = LossScaling(**values)
    _validate_loss_scaling(doc, loss)
    return loss


def _validate_loss_scaling(doc: _Doc, loss: LossScaling) -> None:
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
