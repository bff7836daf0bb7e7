"""Checks shared by the policy parsers: a YAML document that knows the line of every key path,
and the validators whose errors name file, line, key path, bad value and valid choices.

The loader (``loader.py``) and the section parsers (``fp8.py``) both read their keys through
these, so no parser reaches into another's helpers.

Example:
    >>> doc = PolicyDoc("dtype: bf16\\nmode: dynamc\\n", "mine.yaml")
    >>> check_choice(doc, ("mode",), doc.data["mode"], ("static", "dynamic"))
    Traceback (most recent call last):
    ...
    mpgraph.errors.PolicyError: mine.yaml:2: mode: invalid value 'dynamc' (did you mean 'dynamic'?); valid: static, dynamic
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterator
from typing import Any, NoReturn

import onnx
import yaml

from mpgraph.errors import PolicyError

__all__ = ["PolicyDoc", "check_choice", "check_keys", "check_number", "check_op_type", "did_you_mean"]


@functools.lru_cache(maxsize=32)
def _compose(text: str) -> yaml.Node | None:
    """The YAML node tree of ``text``, parsed once per distinct text.

    Parsing is most of a conversion's time on small models: the pure-Python parser took 70 ms
    for the fp16 preset and its ``extends`` base, 36 of the 54 s that converting 128 single-op
    models four ways took. Keyed by the text itself, so an edited file is parsed again; the
    tree is only read afterwards (``PolicyDoc`` builds its own containers from it). A text that
    fails raises each time (``lru_cache`` keeps results only).
    """
    return yaml.compose(text, Loader=yaml.SafeLoader)

#: Nodes a policy may expand to once aliases are resolved; a few hundred in real policies.
_MAX_NODES = 100_000
#: Nesting depth of mappings and lists; real policies nest 4 deep.
_MAX_DEPTH = 64


class PolicyDoc:
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


def did_you_mean(bad: str, valid: Iterator[str] | list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``valid``, or nothing."""
    close = difflib.get_close_matches(bad, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_choice(doc: PolicyDoc, keypath: tuple[str, ...], value: Any, valid: tuple[str, ...]) -> str:
    """``value`` if it is one of ``valid``; else fail at ``keypath`` naming the choices."""
    if not isinstance(value, str) or value not in valid:
        doc.fail(
            keypath,
            f"invalid value {value!r}{did_you_mean(str(value), valid)}; valid: {', '.join(valid)}",
        )
    return value


def check_keys(doc: PolicyDoc, keypath: tuple[str, ...], mapping: Any, valid: tuple[str, ...]) -> None:
    """Fail unless ``mapping`` is a mapping whose keys are all in ``valid``."""
    if not isinstance(mapping, dict):
        doc.fail(keypath, f"expected a mapping with keys {', '.join(valid)}, got {mapping!r}")
    for key in mapping:
        if key not in valid:
            doc.fail((*keypath, key), f"unknown key{did_you_mean(key, valid)}; valid: {', '.join(valid)}")


@functools.lru_cache(maxsize=1)
def _known_op_types() -> frozenset[str]:
    return frozenset(s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx"))


def check_op_type(doc: PolicyDoc, keypath: tuple[str, ...], op_type: str) -> None:
    """Fail unless ``op_type`` is a default-domain ONNX op (or written ``domain.Op``)."""
    if "." not in op_type and op_type not in _known_op_types():
        doc.fail(
            keypath,
            f"unknown op type '{op_type}'{did_you_mean(op_type, sorted(_known_op_types()))}"
            "; use 'domain.Op' for ops outside the default ONNX domain",
        )


# YAML 1.2 floats that PyYAML (YAML 1.1) leaves as strings: 1e9 (no dot), 1.5e3 (no exponent sign).
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def check_number(doc: PolicyDoc, keypath: tuple[str, ...], value: Any, *, integer: bool = False) -> float:
    """``value`` as a number (an integer if ``integer``); YAML 1.2 float spellings accepted."""
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
