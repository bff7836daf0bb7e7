"""The docs' numbers point at files that exist, and the counts they state are the code's.

Every measured number in README.md and docs/ names the committed output it comes from
(`benchmarks/results/docs_numbers_audit.md` lists them). These checks catch the two ways such a
reference rots: the file it names is gone or renamed, or a count that the code itself knows
(the gradient rules of docs/train-graph.md) no longer matches.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mpgraph.autodiff import registry
from mpgraph.autodiff import rules as _rules  # noqa: F401  (registers the rules)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A backquoted file name of the kinds results are written as, with or without a folder.
CITED = re.compile(r"`([A-Za-z0-9_./-]+\.(?:txt|log|json|md|png|diff))`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_file_exists(doc: Path) -> None:
    """A cited name resolves from the repository root, or (bare) in benchmarks/results/."""
    cited = set(CITED.findall(doc.read_text()))
    missing = sorted(name for name in cited
                     if not (ROOT / name).exists() and not (ROOT / "benchmarks/results" / name).exists())
    assert not missing, f"{doc.name} cites files that do not exist: {missing}"


def _rule_list(text: str) -> tuple[int, list[str]]:
    """The count in ``**Rules (N ops)**:`` and the op types listed after it, remarks in
    parentheses dropped."""
    match = re.search(r"\*\*Rules \((\d+) ops\)\*\*: (.*?) \(the list", text, re.DOTALL)
    assert match, "docs/train-graph.md has no '**Rules (N ops)**: ... (the list' paragraph"
    names = re.sub(r"\([^)]*\)", "", " ".join(match.group(2).split()))
    return int(match.group(1)), [n.strip() for n in names.split(",")]


def test_train_graph_doc_lists_the_registered_rules() -> None:
    text = (ROOT / "docs/train-graph.md").read_text()
    count, names = _rule_list(text)
    registered = sorted({rule.op_type for rule in registry.registered_rules()})
    assert (count, names) == (len(registered), registered)
    declared = re.search(r"\*\*Declared non-differentiable \((\d+)\)\*\*", text)
    assert declared and int(declared.group(1)) == len(registry._NON_DIFF)


#: A run named by a sequence number instead of what it measures and when ("... run 23").
_NUMBERED_RUN = r"session[_ -]?[0-9]"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if done.returncode not in (0, 1) or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return done.stdout


def test_results_are_named_by_what_they_measure_and_dated() -> None:
    """No tracked path says "session", and no tracked text names a run by a session number:
    results are named by what they measure and the date and hour of their set of runs."""
    paths = [p for p in _git("ls-files").splitlines() if "session" in p.lower()]
    assert not paths, f"rename these (what they hold, not 'session'): {paths}"
    hits = _git("grep", "-nIiE", _NUMBERED_RUN).splitlines()
    assert not hits, "name these runs by date and commit:\n" + "\n".join(hits)
