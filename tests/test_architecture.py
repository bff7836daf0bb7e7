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
6. ``mpgraph/lowering/`` imports only the floor (``_ir``, ``dtypes``, ``errors``, ``optypes``,
   ``io``) and itself.
7. The runtime imports the lowering through its entry point only: ``from mpgraph.lowering
   import plan_session`` (with its argument and result types, ``PlanOptions`` and
   ``SessionPlan``), never a lowering module.
8. ``mpgraph/training/`` and ``mpgraph/passes/`` import nothing from ``mpgraph.runtime``:
   building a step graph or compiling a policy runs no model.
9. No import circles among mpgraph's modules (lazy imports count: they only hide a circle).
10. No module imports another module's underscore names, nor reads them through a module it
    imports (``from mpgraph.lowering import fuse`` then ``fuse._readers``).
11. No file over 600 lines, no class over 400.

Rules 9-11 list the debt they found (``KNOWN_DEBT``, ``OVERSIZE``): an entry may only go away
(a stale one fails too), and nothing may join it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpgraph"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES, MAX_CLASS_LINES = 600, 400
#: The floor the lowering may import (rule 6).
FLOOR = ("mpgraph._ir", "mpgraph.dtypes", "mpgraph.errors", "mpgraph.optypes", "mpgraph.io")
#: What the runtime may import from the lowering (rule 7).
LOWERING_ENTRY = ("plan_session", "PlanOptions", "SessionPlan")
#: Circles and underscore imports that existed when rules 9 and 10 came (none left).
KNOWN_DEBT: dict[str, set[tuple[str, str]]] = {"circle": set(), "underscore": set()}
#: Files over MAX_FILE_LINES when rule 11 came, with the size they may not exceed.
OVERSIZE: dict[str, int] = {}


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


# -- rooms: lowering, runtime, training ---------------------------------------------------------


def test_lowering_imports_only_the_floor() -> None:
    bad = _violations("mpgraph.lowering", ("mpgraph",), allowed=(*FLOOR, "mpgraph.lowering"))
    assert not bad, "mpgraph/lowering/ imports above the floor:\n" + "\n".join(bad)


def test_the_runtime_imports_the_lowering_through_its_entry_point() -> None:
    allowed = ("mpgraph.lowering", *(f"mpgraph.lowering.{name}" for name in LOWERING_ENTRY))
    bad = [f"{m.path.relative_to(PACKAGE.parent)}:{line} imports {target}"
           for m in MODULES if _within(m.name, "mpgraph.runtime")
           for line, target in m.imports() if _within(target, "mpgraph.lowering") and target not in allowed]
    assert not bad, "mpgraph/runtime/ reaches into the lowering:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["mpgraph.training", "mpgraph.passes"])
def test_training_and_passes_run_no_model(room: str) -> None:
    bad = _violations(room, ("mpgraph.runtime",))
    assert not bad, f"{room} imports the runtime:\n" + "\n".join(bad)


# -- circles, private names, sizes ----------------------------------------------------------------

NAMES = {m.name for m in MODULES}


def _edges(module: Module) -> set[str]:
    """The mpgraph modules ``module`` imports: ``from a import b`` is ``a.b`` when that is a
    module, else ``a`` (whose ``__init__`` holds ``b``)."""
    found: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in NAMES}
        elif isinstance(node, ast.ImportFrom):
            base = module._resolve(node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found |= {full} if full in NAMES else ({base} if base in NAMES else set())
    return found - {module.name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_circles_are_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    circles = {tuple(c) for c in _circles({m.name: _edges(m) for m in MODULES})}
    assert circles - KNOWN_DEBT["circle"] == set(), f"import circles: {sorted(circles - KNOWN_DEBT['circle'])}"
    assert KNOWN_DEBT["circle"] <= circles, f"gone, remove from KNOWN_DEBT: {KNOWN_DEBT['circle'] - circles}"


def test_no_module_imports_another_modules_private_names() -> None:
    found = set()
    for module in MODULES:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and _within(base := module._resolve(node), "mpgraph"):
                found |= {(module.name, f"{base}.{a.name}") for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and base != module.name}
    assert found - KNOWN_DEBT["underscore"] == set(), f"private names imported: {sorted(found - KNOWN_DEBT['underscore'])}"
    assert KNOWN_DEBT["underscore"] <= found, f"gone, remove from KNOWN_DEBT: {KNOWN_DEBT['underscore'] - found}"


def _attribute_reads(module: Module) -> set[tuple[str, str]]:
    """``(owner, name)`` for each attribute ``module`` reads of another mpgraph module it
    imported (``import mpgraph.x as x`` or ``from mpgraph import x``, then ``x.name``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name: a.name for a in node.names if a.name in NAMES}
        elif isinstance(node, ast.ImportFrom):
            base = module._resolve(node)
            bound |= {a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in NAMES}
    return {(owner, node.attr) for node in ast.walk(module.tree) if isinstance(node, ast.Attribute)
            and (owner := bound.get(ast.unparse(node.value))) is not None and owner != module.name}


def _private_reads(module: Module) -> set[tuple[str, str]]:
    """``(module, owner._name)`` for each underscore name read through an imported module."""
    return {(module.name, f"{owner}.{name}") for owner, name in _attribute_reads(module)
            if name.startswith("_") and not name.startswith("__")}


def test_private_reads_are_found() -> None:
    tree = ast.parse("import mpgraph.io as io\nfrom mpgraph.lowering import match\nfrom mpgraph import convert\n"
                     "match._x(io._y, convert.public, self._z)\n")
    module = Module("mpgraph.audit.report", PACKAGE / "audit" / "report.py", tree)
    assert _private_reads(module) == {("mpgraph.audit.report", "mpgraph.lowering.match._x"),
                                      ("mpgraph.audit.report", "mpgraph.io._y")}


def test_no_module_reads_another_modules_private_names() -> None:
    found = set().union(*(_private_reads(m) for m in MODULES))
    assert not found, f"private names read through a module: {sorted(found)}"


def test_the_runtime_reads_only_the_entry_point_of_the_lowering_package() -> None:
    """Rule 7 for ``from mpgraph import lowering`` then ``lowering.lower(...)``."""
    bad = [f"{m.path.relative_to(PACKAGE.parent)} reads {owner}.{name}" for m in MODULES if _within(m.name, "mpgraph.runtime")
           for owner, name in _attribute_reads(m) if _within(owner, "mpgraph.lowering") and name not in LOWERING_ENTRY]
    assert not bad, "mpgraph/runtime/ reaches into the lowering:\n" + "\n".join(bad)


def test_files_and_classes_are_small() -> None:
    big = []
    for module in MODULES:
        where = str(module.path.relative_to(PACKAGE.parent))
        lines = len(module.path.read_text(encoding="utf-8").splitlines())
        if lines > OVERSIZE.get(where, MAX_FILE_LINES):
            big.append(f"{where}: {lines} lines")
        big += [f"{where}: class {node.name} {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(module.tree)
                if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"over {MAX_FILE_LINES} lines a file or {MAX_CLASS_LINES} a class: {big}"
    sizes = {w: len((PACKAGE.parent / w).read_text(encoding="utf-8").splitlines()) for w in OVERSIZE}
    shrunk = [w for w, n in sizes.items() if n <= MAX_FILE_LINES]
    assert not shrunk, f"within the limit now, remove from OVERSIZE: {shrunk}"
