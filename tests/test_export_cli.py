"""`mpgraph export`: a module file to ONNX from the command line, and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.helpers import Ran, mpgraph_cli

NET = '''
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.fc2 = torch.nn.Linear(16, 3)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
'''


def mpgraph(*args: str) -> Ran:
    """In-process, against mpgraph.cli.main's real app (a new interpreter costs 3-5 s with torch)."""
    return mpgraph_cli(*args)


@pytest.fixture
def net_file(tmp_path: Path) -> Path:
    path = tmp_path / "net.py"
    path.write_text(NET)
    return path


def test_export_then_train_graph(net_file: Path, tmp_path: Path):
    out = tmp_path / "net.onnx"
    result = mpgraph("export", f"{net_file}:Net", "--input", "8x4", "--loss", "cross_entropy", "-o", str(out))
    assert result.returncode == 0, result.stderr
    model = onnx.load(out)
    inits = {t.name for t in model.graph.initializer}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= {i.name for i in model.graph.input} & inits
    assert [o.name for o in model.graph.output] == ["loss", "logits"]
    step = tmp_path / "net.step.onnx"
    assert mpgraph("train-graph", str(out), "-o", str(step)).returncode == 0


@pytest.mark.parametrize(
    "args,expected",
    [
        (["{net}:Nope", "--input", "8x4"], "defines no class 'Nope'"),
        (["{net}:Net", "--input", "8xq"], "expected a shape like 64x4"),
        (["{net}:Net", "--input", "8x4:int8"], "invalid dtype 'int8'"),
        (["{net}:Net", "--input", "8x4", "--loss", "hinge"], "invalid value 'hinge'"),
        (["missing.py:Net", "--input", "8x4"], "no such file"),
        (["{net}", "--input", "8x4"], "expected FILE.py:ClassName"),
    ],
)
def test_export_errors(net_file: Path, tmp_path: Path, args: list[str], expected: str):
    out = tmp_path / "out.onnx"
    result = mpgraph("export", *(a.format(net=net_file) for a in args), "-o", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert not out.exists()
