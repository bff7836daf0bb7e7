"""Policies a user can start from: `--policy bf16.yaml` and `mpgraph policy init`."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpgraph.policy import list_presets, load_policy, parse_policy
from mpgraph.policy.writer import policy_yaml
from tests.helpers import mpgraph_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "onnx" / "tiny_mlp.onnx"


def _mpgraph(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpgraph", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_round_trips_through_its_commented_copy(name: str) -> None:
    preset = load_policy(name)
    text = policy_yaml(preset, name="mine", source=f"preset {name}")
    assert text.startswith("# Precision policy 'mine', a copy of preset")
    assert "extends" not in text  # self-contained: what a user reads is what runs
    copy = parse_policy(text, "mine.yaml")
    assert copy.name == "mine"
    assert dataclasses.replace(copy, name=preset.name) == preset


def test_policy_yaml_names_a_missing_file_resolves_to_the_preset(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mpgraph"):
        policy = load_policy("bf16.yaml")
    assert policy == load_policy("bf16")
    [record] = caplog.records
    assert record.getMessage() == (
        "bf16.yaml: no such file; using the preset 'bf16' (`mpgraph policy init bf16 -o bf16.yaml` writes a copy to edit)"
    )
    # A file of that name wins over the preset; other missing files stay an error.
    (tmp_path / "bf16.yaml").write_text("extends: fp16\nname: mine\n")
    assert load_policy("bf16.yaml").name == "mine"
    with pytest.raises(Exception, match="policy file not found"):
        load_policy("bf17.yaml")


def test_the_missions_command_works_in_a_fresh_directory(tmp_path: Path) -> None:
    """`mpgraph convert model.onnx --policy bf16.yaml`, verbatim, with no bf16.yaml around."""
    (tmp_path / "model.onnx").write_bytes(TINY.read_bytes())
    result = _mpgraph("convert", "model.onnx", "--policy", "bf16.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "using the preset 'bf16'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("warning: bf16.yaml: no such file")  # the CLI's style, not logging's
    assert (tmp_path / "model.bf16.onnx").is_file()


def test_policy_init_writes_a_copy_to_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process (the entry point and its message style are the test above's): relative paths
    # resolve against the working directory, as in a shell.
    monkeypatch.chdir(tmp_path)
    result = mpgraph_cli("policy", "init", "bf16", "-o", "my.yaml")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "my.yaml").read_text()
    assert "# deny: stay float32" in text and "MatMul: tensor-core matrix product" in text
    assert dataclasses.replace(load_policy(str(tmp_path / "my.yaml")), name="bf16") == load_policy("bf16")
    # Edit it: keep MatMul float32, and convert with it.
    (tmp_path / "my.yaml").write_text(text.replace("    MatMul: tensor-core", "    MatMulX: tensor-core"))
    result = mpgraph_cli("policy", "check", "my.yaml")
    assert result.returncode == 2 and "unknown op type 'MatMulX' (did you mean 'MatMul'?)" in result.stderr
    result = mpgraph_cli("policy", "init", "bf16", "-o", "my.yaml")
    assert result.returncode == 2 and "exists; pass --force" in result.stderr
    assert mpgraph_cli("policy", "init", "fp16", "-o", "my.yaml", "--force").returncode == 0
    assert load_policy(str(tmp_path / "my.yaml")).dtype == load_policy("fp16").dtype
