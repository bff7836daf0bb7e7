"""The CLI as a user meets it: exit codes, one-line errors, files on disk.

Commands run in-process against ``mpgraph.cli.main``'s real app (``tests.helpers.mpgraph_cli``);
``process`` starts a real ``python -m mpgraph`` where the entry point itself or ORT's native
logging to the stderr file descriptor is what is tested.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from tests.helpers import Ran, mpgraph_cli
from tests.test_passes import mlp_model


def mpgraph(*args: str) -> Ran:
    return mpgraph_cli(*args)


def process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpgraph", *args], capture_output=True, text=True, timeout=120)


def test_entry_point_is_the_app(model_path: Path, tmp_path: Path):
    """``python -m mpgraph`` runs the same app: a conversion, and a foreseen error's one line."""
    ok = process("convert", str(model_path), "--policy", "bf16", "-o", str(tmp_path / "out.onnx"))
    assert ok.returncode == 0 and "4/6 ops in bfloat16" in ok.stdout, ok.stderr
    bad = process("convert", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "x.onnx"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    return path


def test_convert_then_audit_json(model_path: Path, tmp_path: Path):
    out = tmp_path / "mlp.bf16.onnx"
    before = digest(model_path)
    result = mpgraph("convert", str(model_path), "--policy", "bf16", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "4/6 ops in bfloat16" in result.stdout
    assert digest(model_path) == before
    report = json.loads(mpgraph("audit", str(out), "--json").stdout)
    assert report["policy"] == "bf16" and report["casts_inserted"] == 2
    assert report["ops"]["all"]["MatMul"] == {"bfloat16": 2}
    assert report["weight_bytes_before"] == 2 * report["weight_bytes_after"]
    table = mpgraph("audit", str(out))
    assert table.returncode == 0 and "MatMul" in table.stdout and "casts inserted: 2" in table.stdout


def test_convert_no_opset_upgrade(tmp_path: Path):
    import numpy as np
    from onnx import helper as h

    from tests.helpers import init, make_model, vi

    nodes = [h.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    path = tmp_path / "old.onnx"
    onnx.save(make_model(nodes, [vi("x", [2, 4])], [vi("y", [2, 3])], [init("w", np.ones((4, 3), np.float32))],
                         opset=11, ir_version=6), path)
    upgraded, kept = tmp_path / "up.onnx", tmp_path / "kept.onnx"
    assert mpgraph("convert", str(path), "--policy", "bf16", "-o", str(upgraded)).returncode == 0
    result = mpgraph("convert", str(path), "--policy", "bf16", "--no-opset-upgrade", "-o", str(kept))
    assert result.returncode == 0, result.stderr
    assert "0/1 ops in bfloat16" in result.stdout  # MatMul has no bfloat16 before opset 13
    assert onnx.load(upgraded).opset_import[0].version == 13 and onnx.load(kept).opset_import[0].version == 11


def test_policy_show_and_check(tmp_path: Path):
    shown = mpgraph("policy", "show", "bf16")
    assert shown.returncode == 0 and "MatMul" in shown.stdout and "bfloat16" in shown.stdout
    good = tmp_path / "mine.yaml"
    good.write_text("extends: bf16\noverrides:\n  - {match: 'head*', precision: float32}\n")
    assert mpgraph("policy", "check", str(good)).returncode == 0


def _bad_policy(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


BAD_CASES = {
    "truncated": lambda m, t: ("convert", str(_truncated(m, t)), "-o", str(t / "out.onnx")),
    "not_onnx": lambda m, t: ("convert", str(_text_file(t)), "-o", str(t / "out.onnx")),
    "missing": lambda m, t: ("convert", str(t / "nope.onnx"), "-o", str(t / "out.onnx")),
    "invalid_yaml": lambda m, t: ("convert", str(m), "-p", _bad_policy(t, "dtype: [bf16\n"), "-o", str(t / "out.onnx")),
    "unknown_key": lambda m, t: ("convert", str(m), "-p", _bad_policy(t, "dtype: bf16\nlos_scaling: {}\n"), "-o", str(t / "out.onnx")),
    "bad_dtype": lambda m, t: ("convert", str(m), "-p", _bad_policy(t, "dtype: fp8\n"), "-o", str(t / "out.onnx")),
    "unknown_preset": lambda m, t: ("convert", str(m), "-p", "bf17", "-o", str(t / "out.onnx")),
    "unwritable": lambda m, t: ("convert", str(m), "-o", str(t / "no" / "such" / "dir" / "out.onnx")),
    "output_is_input": lambda m, t: ("convert", str(m), "-o", str(m)),
    "audit_not_onnx": lambda m, t: ("audit", str(_text_file(t))),
    "check_bad_policy": lambda m, t: ("policy", "check", _bad_policy(t, "dtype: bf16\nops: {allow: [MatMull]}\n")),
}
EXPECTED = {
    "truncated": "not a valid ONNX model",
    "not_onnx": "not a valid ONNX model",
    "missing": "no such file",
    "invalid_yaml": "invalid YAML",
    "unknown_key": "unknown key (did you mean 'loss_scaling'?)",
    "bad_dtype": "invalid value 'fp8'",
    "unknown_preset": "unknown preset 'bf17' (did you mean 'bf16'?)",
    "unwritable": "cannot write",
    "output_is_input": "output is the input file",
    "audit_not_onnx": "not a valid ONNX model",
    "check_bad_policy": "did you mean 'MatMul'",
}


def _truncated(model: Path, tmp: Path) -> Path:
    data = model.read_bytes()
    path = tmp / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    return path


def _text_file(tmp: Path) -> Path:
    path = tmp / "notes.onnx"
    path.write_text("this is not a model\n")
    return path


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_one_line_exit_2_no_output(case: str, model_path: Path, tmp_path: Path):
    before = digest(model_path)
    listing_before = sorted(p.name for p in tmp_path.iterdir())
    result = mpgraph(*BAD_CASES[case](model_path, tmp_path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and EXPECTED[case] in lines[0], lines[0]
    assert digest(model_path) == before
    created = sorted(p.name for p in tmp_path.iterdir())
    assert "out.onnx" not in created
    assert not [name for name in created if name.startswith(".out.onnx") or name.startswith(".mlp.onnx")]
    assert set(created) - set(listing_before) <= {"bad.yaml", "truncated.onnx", "notes.onnx"}


# -- runtime papercuts (issue 12) ----------------------------------------------------------------

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"


@pytest.fixture(scope="module")
def gpt_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpt") / "gpt.train.onnx"
    result = mpgraph("train-graph", str(ZOO / "gpt.loss.onnx"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_train_step_failing_in_ort_is_one_line_naming_the_node(gpt_step: Path, tmp_path: Path):
    import numpy as np

    data = tmp_path / "bad_tokens.npz"  # token ids beyond the 64-row embedding table
    np.savez(data, tokens=np.full((8, 16), 1000, np.int64), label=np.zeros((8, 16), np.int64))
    # A real process: ORT logs to the stderr file descriptor, which only a process captures.
    result = process("train", str(gpt_step), "--data", str(data), "--steps", "2", "-q")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # ORT's own error log is not repeated
    assert lines[0].startswith("error: onnxruntime failed running step 1")
    assert "at node 'node_embedding' (Gather): indices element out of data bounds" in lines[0]


def test_train_step_graph_that_ort_cannot_load_is_one_line(gpt_step: Path, tmp_path: Path):
    proto = onnx.load(gpt_step)
    node = next(n for n in proto.graph.node if n.op_type == "Erf")
    node.op_type = "Erff"  # no such op: ORT refuses the graph at load
    bad = tmp_path / "bad.train.onnx"
    onnx.save(proto, bad)
    result = mpgraph("train", str(bad), "--data", "sequence", "--steps", "1", "-q")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Erff" in lines[0], result.stderr


def test_train_sequence_data_with_hugging_face_input_names(tmp_path: Path):
    # The zoo GPT with its inputs renamed as a Hugging Face export names them, plus a mask.
    proto = onnx.load(ZOO / "gpt.loss.onnx")
    renames = {"tokens": "input_ids", "label": "labels"}
    for value in proto.graph.input:
        value.name = renames.get(value.name, value.name)
    for node in proto.graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
    proto.graph.input.append(onnx.helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", 16]))
    forward = tmp_path / "hf_gpt.onnx"
    onnx.save(proto, forward)
    step = tmp_path / "hf_gpt.train.onnx"
    assert mpgraph("train-graph", str(forward), "-o", str(step)).returncode == 0
    result = mpgraph("train", str(step), "--data", "sequence", "--steps", "20", "--batch", "16", "-q")
    assert result.returncode == 0, result.stderr
    assert "20 steps" in result.stdout and "loss" in result.stdout


def test_train_kernels_flag_runs_the_fused_kernels_and_says_so(gpt_step: Path):
    """--kernels on CPU (all of them; the default is the CPU subset, --no-kernels none): the
    summary counts the rewrites, and the loss matches the plain ops' to the printed digits."""
    runs = [mpgraph("train", str(gpt_step), "--data", "sequence", "--steps", "10", "-q", *flag, "--no-eval")
            for flag in (["--kernels"], [], ["--no-kernels"])]
    assert all(r.returncode == 0 for r in runs), "".join(r.stderr for r in runs)
    fused = [int(r.stdout.split("fused kernels (")[1].split(" ")[0]) if "fused kernels (" in r.stdout else 0 for r in runs]
    assert fused[0] > fused[1] > fused[2] == 0, fused
    loss = [r.stdout.split("loss ")[1].split(",")[0] for r in runs]
    assert loss[0] == loss[1] == loss[2]


def test_train_deterministic_flag_gives_the_same_loss(gpt_step: Path):
    """--deterministic (the embedding gradient as a one-hot Gemm, ORT's deterministic compute):
    the zoo GPT trains to the printed digits of the plain run, twice alike."""
    runs = [mpgraph("train", str(gpt_step), "--data", "sequence", "--steps", "10", "-q", *flag, "--no-eval")
            for flag in (["--deterministic"], ["--deterministic"], [])]
    assert all(r.returncode == 0 for r in runs), "".join(r.stderr for r in runs)
    loss = [r.stdout.split("loss ")[1].split(",")[0] for r in runs]
    assert loss[0] == loss[1] == loss[2]


def test_train_provider_option_must_be_key_value(tmp_path):
    step = tmp_path / "step.onnx"
    build = mpgraph("train-graph", str(ZOO / "tiny_mlp.loss.onnx"), "-o", str(step))
    assert build.returncode == 0, build.stderr
    r = mpgraph("train", str(step), "--steps", "1", "--provider-option", "oops")
    assert r.returncode == 2
    assert "--provider-option 'oops': expected KEY=VALUE" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr


def test_commands_are_registered_from_one_table():
    """main.COMMANDS names every command once, in --help order; each lives in cli/<name>_cmd.py."""
    import importlib
    import pkgutil

    from typer.main import get_command

    from mpgraph.cli.main import COMMANDS, app

    root = get_command(app)
    listed = root.list_commands(root.context_class(root))  # the --help order
    policy = root.get_command(root.context_class(root), "policy")
    assert listed == [*(name for group, name, _ in COMMANDS if not group), "policy"]
    assert policy.list_commands(policy.context_class(policy)) == [name for group, name, _ in COMMANDS if group == "policy"]
    assert len({(group, name) for group, name, _ in COMMANDS}) == len(COMMANDS)
    assert all(fn.__module__.startswith("mpgraph.cli.") and fn.__module__.endswith("_cmd") for _, _, fn in COMMANDS)
    for info in pkgutil.iter_modules(importlib.import_module("mpgraph.cli").__path__, "mpgraph.cli."):
        assert not hasattr(importlib.import_module(info.name), "register"), f"{info.name}: a second registration style"


def test_policy_check_refuses_a_folder_and_a_missing_file(tmp_path: Path):
    missing = mpgraph("policy", "check", str(tmp_path / "nope.yaml"))
    folder = mpgraph("policy", "check", str(tmp_path))
    assert missing.returncode == 2 and "nope.yaml: policy file not found" in missing.stderr
    assert folder.returncode == 2 and "is a directory, expected a policy .yaml file" in folder.stderr
    good = tmp_path / "mine.yaml"
    good.write_text("extends: bf16\n")
    ok = mpgraph("policy", "check", str(good))
    assert ok.returncode == 0 and "ok (bfloat16" in " ".join(ok.stdout.split())


# -- output papercuts (issue 25) -----------------------------------------------------------------


def test_convert_summary_is_one_line_in_a_pipe(tmp_path: Path):
    """Rich wrapped at 80 columns where stdout is no terminal, mid-phrase; a message is one line."""
    result = mpgraph("convert", str(ZOO / "gpt.onnx"), "--policy", "bf16", "-o", str(tmp_path / "gpt.bf16.onnx"))
    assert result.returncode == 0, result.stderr
    [summary] = [line for line in result.stdout.splitlines() if line.startswith("wrote ")]
    assert "ops in bfloat16" in summary and "casts inserted, weights 427.02 KiB -> 427.01 KiB" in summary


def test_convert_summary_says_which_weights_stay_float32(tmp_path: Path):
    """gpt.onnx's parameters are graph inputs with initializers, defaults a caller may replace:
    they stay float32 (cast at run time), so bf16 shrinks its weights by 10 bytes only."""
    result = mpgraph("convert", str(ZOO / "gpt.onnx"), "--policy", "bf16", "-o", str(tmp_path / "gpt.bf16.onnx"))
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert ("weights 427.02 KiB -> 427.01 KiB (427.00 KiB of them initialize graph inputs: kept float32, "
            "cast at run time)") in text
    plain = tmp_path / "mlp.onnx"  # weights as true constants: stored low, nothing to explain
    onnx.save(mlp_model(), plain)
    result = mpgraph("convert", str(plain), "--policy", "bf16", "-o", str(tmp_path / "mlp.bf16.onnx"))
    assert result.returncode == 0 and "initialize graph inputs" not in result.stdout


def test_library_warnings_print_in_the_cli_style(capsys: pytest.CaptureFixture[str]):
    """What the library logs reads like the CLI's own messages: ``warning: ...``, ``error: ...``."""
    import logging

    from mpgraph.cli.console import MessageHandler

    logger = logging.getLogger("mpgraph.test_cli")
    logger.propagate = False
    logger.addHandler(MessageHandler())
    try:
        logger.info("not shown")
        logger.warning("%s: no such file; using the preset '%s'", "bf16.yaml", "bf16")
        logger.error("[red] stays text")
    finally:
        logger.handlers.clear()
        logger.propagate = True
    assert capsys.readouterr().err.splitlines() == [
        "warning: bf16.yaml: no such file; using the preset 'bf16'", "error: [red] stays text"]


_INTERRUPT_AT_START = r"""
import importlib, re, sys
import typer.main
entry = re.search(r'^mpgraph = "([\w.]+):(\w+)"', open("pyproject.toml").read(), re.M)
if sys.argv[1] == "loading":  # Ctrl-C while the entry point imports the command line
    for name in [m for m in sys.modules if m == "typer" or m.startswith(("typer.", "mpgraph.cli"))]:
        del sys.modules[name]

    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "typer":
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, Interrupt())
else:  # Ctrl-C while typer builds the commands, before their error boundary
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    typer.main.get_command = interrupted
sys.argv = ["mpgraph", "--help"]
getattr(importlib.import_module(entry[1]), entry[2])()
"""


@pytest.mark.parametrize("when", ["loading", "building"])
def test_ctrl_c_while_the_command_line_starts_is_one_line_exit_130(when: str):
    """Ctrl-C in the first half second of `mpgraph train` printed a KeyboardInterrupt traceback:
    the error boundary is installed after the imports. The entry point named in pyproject.toml
    guards them too."""
    root = Path(__file__).resolve().parents[1]
    ran = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_START, when], capture_output=True, text=True,
                         timeout=60, cwd=root)
    assert ran.returncode == 130 and "Traceback" not in ran.stderr, ran.stderr
    assert ran.stderr.strip().splitlines() == ["interrupted"]


def test_kernels_builds_copies_and_reports_a_prebuilt_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mpgraph kernels --cpu --copy-to`: the cached library's path and size, and a copy; that copy
    named by $MPGRAPH_CUDA_LIBRARY is reported as prebuilt, with what it lacks (a CPU build: no
    CUDA kernels, no fused attention, no GemmBias, each "built without it"); a name of no file is
    one error line, exit 2."""
    copy = tmp_path / "lib" / "kernels.so"
    ran = mpgraph_cli("kernels", "--cpu", "--copy-to", str(copy), "--json")
    assert ran.returncode == 0, ran.stderr
    facts = json.loads(ran.stdout)
    assert Path(facts["path"]).is_file() and facts["prebuilt"] is None and facts["cuda_kernels"] is False
    assert copy.read_bytes() == Path(facts["path"]).read_bytes() and facts["copied_to"] == str(copy)
    monkeypatch.setenv("MPGRAPH_CUDA_LIBRARY", str(copy))
    facts = json.loads(mpgraph_cli("kernels", "--json").stdout)
    assert facts["path"] == str(copy) and facts["prebuilt"] == "$MPGRAPH_CUDA_LIBRARY" and facts["cuda_kernels"] is False
    assert (facts["fused_attention"], facts["gemm_bias"], facts["gemm_bias_runs"]) == (False, False, False)
    assert facts["fused_attention_why_not"] == facts["gemm_bias_why_not"] == "built without it"
    text = mpgraph_cli("kernels").stdout
    assert "(prebuilt, from $MPGRAPH_CUDA_LIBRARY)" in text and "fused attention (cuDNN SDPA): not in: built without it" in text
    monkeypatch.setenv("MPGRAPH_CUDA_LIBRARY", str(tmp_path / "none.so"))
    ran = mpgraph_cli("kernels")
    assert ran.returncode == 2 and "$MPGRAPH_CUDA_LIBRARY names" in ran.stderr and "which is not a file" in ran.stderr


def test_train_summary_says_when_attention_runs_unfused_on_cuda() -> None:
    """The closing line of `mpgraph train` on CUDA names the Attentions its plan wrote out and why
    (a library without cuDNN's fused attention doubles GPT-2's step); nothing when none is."""
    from types import SimpleNamespace

    from mpgraph.cli.train_cmd import _summary
    from mpgraph.lowering.plan import SessionPlan

    def line(applied: tuple, reason: str) -> str:
        plan = SessionPlan(b"", "cuda", "lib.so", "default", "", applied, reason)
        trainer = SimpleNamespace(
            metrics=SimpleNamespace(summary=lambda: {"last_loss": None, "first_loss": None, "nonfinite_losses": 0,
                                                     "loss_scale": None, "skipped": 0}),
            provider="cuda", cuda_graph=True, pipeline=True, inplace=(), kernels_fused=3, kernels_reason="",
            executor=SimpleNamespace(plan=plan))
        return _summary(trainer, SimpleNamespace(test=None), "sequence", 1, 1.0, evaluate=False)

    why = "the kernel library has no fused attention (no cudnn-frontend headers)"
    assert f"attention unfused (12: {why})" in line((("attention_expand", 12), ("adamw", 3)), why)
    assert "unfused" not in line((("sdpa", 12),), "")
