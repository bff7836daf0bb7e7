"""The layering rules of docs/architecture.md, checked on the source.

Every module under ``mpgraph/`` is parsed (``ast``, nothing is imported) and every import in
it is read, including the lazy ones inside functions:

1. Only ``mpgraph/runtime/`` imports onnxruntime: the compiler and the audit never run a model.
2. ``mpgraph/audit/`` imports nothing from ``mpgraph.passes`` or ``mpgraph.convert``: the
   audit reads what the compiler wrote, it does not call the compiler.
3. ``mpgraph/optim/`` imports nothing from ``mpgraph.autodiff``: optimizers build their nodes
   with the ``_ir`` builder.
4. ``mpgraph/_ir/`` imports nothing from the rest of mpgraph: it is the floor.
5. No function is longer than 60 lines (its body, the docstring excluded), except data: a
   function whose body only returns or assigns one literal table.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpgraph"
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Module:
    name: str  # mpgraph.audit.report
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    def imports(self) -> list[tuple[int, str]]:
        """(line, module) for every import, relative ones resolved; ``from a import b`` gives
        both ``a`` and ``a.b`` (``b`` may be a submodule)."""
        found: list[tuple[int, str]] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = self._resolve(node)
                found.append((node.lineno, base))
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        return found

    def _resolve(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.name.split(".")
        package = parts if self.is_package else parts[:-1]
        base = package[: len(package) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])


def _modules() -> list[Module]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules.append(Module(name, path, ast.parse(path.read_text(encoding="utf-8"), str(path))))
    return modules


MODULES = _modules()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(inside: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = (), *,
                outside: bool = False) -> list[str]:
    """``file:line imports X`` for each module under ``inside`` (or, with ``outside``, not
    under it) that imports a ``forbidden`` prefix and no ``allowed`` one."""
    bad: dict[tuple[str, int], str] = {}
    for module in MODULES:
        if _within(module.name, inside) == outside:
            continue
        where = str(module.path.relative_to(PACKAGE.parent))
        for line, target in module.imports():
            if any(_within(target, f) for f in forbidden) and not any(_within(target, a) for a in allowed):
                bad.setdefault((where, line), target)  # `from a import b` names `a` first
    return [f"{where}:{line} imports {target}" for (where, line), target in sorted(bad.items())]


def test_the_walk_sees_the_package() -> None:
    names = {m.name for m in MODULES}
    assert {"mpgraph", "mpgraph.convert", "mpgraph.runtime.trainer", "mpgraph.audit.report"} <= names


def test_relative_imports_resolve() -> None:
    tree = ast.parse("from . import report\nfrom ..passes import naming\n")
    module = Module("mpgraph.audit.compare", PACKAGE / "audit" / "compare.py", tree)
    assert [t for _, t in module.imports()] == [
        "mpgraph.audit", "mpgraph.audit.report", "mpgraph.passes", "mpgraph.passes.naming"]


def test_only_the_runtime_imports_onnxruntime() -> None:
    bad = _violations("mpgraph.runtime", ("onnxruntime",), outside=True)
    assert not bad, "onnxruntime outside mpgraph/runtime/:\n" + "\n".join(bad)


def test_the_audit_does_not_import_the_compiler() -> None:
    bad = _violations("mpgraph.audit", ("mpgraph.passes", "mpgraph.convert"))
    assert not bad, "mpgraph/audit/ imports the compiler:\n" + "\n".join(bad)


def test_optimizers_do_not_import_autodiff() -> None:
    bad = _violations("mpgraph.optim", ("mpgraph.autodiff",))
    assert not bad, "mpgraph/optim/ imports autodiff:\n" + "\n".join(bad)


def test_the_ir_floor_imports_nothing_above_it() -> None:
    bad = _violations("mpgraph._ir", ("mpgraph",), allowed=("mpgraph._ir",))
    assert not bad, "mpgraph/_ir/ imports the rest of mpgraph:\n" + "\n".join(bad)


def _is_data(body: list[ast.stmt]) -> bool:
    """A body that only returns or assigns one literal table (a dict, list, tuple or set)."""
    literal = (ast.Dict, ast.List, ast.Tuple, ast.Set)
    if len(body) != 1:
        return False
    stmt = body[0]
    value = stmt.value if isinstance(stmt, (ast.Return, ast.Assign, ast.AnnAssign)) else None
    return isinstance(value, literal)


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, list[ast.stmt]]:
    body = fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    if not body:
        return 0, body
    return (fn.end_lineno or body[-1].lineno) - body[0].lineno + 1, body


def test_body_lines_leave_out_the_docstring() -> None:
    fn = ast.parse('def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n').body[0]
    assert _body_lines(fn)[0] == 2  # type: ignore[arg-type]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_functions_are_short(module: Module) -> None:
    long = []
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines, body = _body_lines(node)
            if lines > MAX_FUNCTION_LINES and not _is_data(body):
                long.append(f"{node.name} (line {node.lineno}): {lines} lines")
    assert not long, f"{module.path.relative_to(PACKAGE.parent)}: over {MAX_FUNCTION_LINES} lines: {long}"
