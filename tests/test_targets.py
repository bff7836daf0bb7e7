"""Targets: which ops a provider runs low is a probed fact, kept apart from precision policies.

``convert --target cuda`` (the default of a native lowering) must give, on every zoo model and
zoo AdamW step graph, exactly the per-node precisions of the bf16 preset as it was when it
carried the CUDA kernel gaps itself (``OLD_BF16`` below, copied from rules/bf16.yaml at
729ff0d). ``--target cpu`` native output must load and run in ORT CPU for every zoo and light
model, float16 and bfloat16.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import mpgraph
from mpgraph._ir import meta as md
from mpgraph.data import random_feeds
from mpgraph.errors import MpgraphError, UsageError
from mpgraph.policy import parse_policy
from mpgraph.targets import check_runnable, kernel_cell, kernel_gaps, tables
from tests.helpers import mpgraph_cli

ROOT = os.path.join(os.path.dirname(__file__), "..")
ZOO = sorted(glob.glob(os.path.join(ROOT, "models", "onnx", "*.onnx")))
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT = sorted(glob.glob(os.path.join(LIGHT_DIR, "*.onnx")))
FAST_LIGHT = ("light_squeezenet.onnx", "light_inception_v1.onnx", "light_shufflenet.onnx")

_GAP = "no bfloat16 kernel in ONNX Runtime 1.31 CUDA (benchmarks/results/cuda_kernels.log)"
OLD_BF16 = "\n".join(
    [
        "name: bf16-729ff0d",
        "extends: fp16",
        "dtype: bfloat16",
        "loss_scaling: {mode: none}",
        "ops:",
        "  deny:",
        "    ConvTranspose: no bfloat16 kernel in ONNX Runtime 1.31 (CPU or CUDA)",
        *(
            f"    {op}: {_GAP}"
            for op in (
                "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Equal", "PRelu", "LeakyRelu", "Elu", "Selu",
                "GlobalAveragePool", "GlobalMaxPool", "MaxPool", "ReduceMax", "ReduceMin", "Pad", "SpaceToDepth",
                "DepthToSpace", "Dropout",
            )
        ),
    ]
)


def _precisions(model: ir.Model) -> dict[str, str]:
    return {n.name or "": n.metadata_props.get(md.NODE_PRECISION, "") for n in model.graph}


@pytest.mark.parametrize("path", ZOO, ids=os.path.basename)
def test_target_cuda_matches_the_old_bf16_preset(path: str) -> None:
    old = mpgraph.convert(onnx.load(path), parse_policy(OLD_BF16, "bf16-729ff0d.yaml"), target="any")
    new = mpgraph.convert(onnx.load(path), "bf16")
    assert new.metadata_props[md.MODEL_TARGET] == "cuda"
    assert _precisions(new) == _precisions(old)


@pytest.mark.parametrize("name", ["dqn_cnn", "resnet", "tiny_mlp", "gpt"])
def test_target_cuda_matches_the_old_bf16_preset_on_step_graphs(name: str) -> None:
    """The backward adds comparisons (ReLU's mask) and ConvTranspose (a strided Conv's dX)."""
    step = ir.to_proto(mpgraph.build_training_graph(os.path.join(ROOT, "models", "onnx", f"{name}.loss.onnx"), optimizer="adamw"))
    data = step.SerializeToString()
    old = mpgraph.convert(onnx.load_from_string(data), parse_policy(OLD_BF16, "bf16-729ff0d.yaml"), target="any")
    new = mpgraph.convert(onnx.load_from_string(data), "bf16", target="cuda")
    assert _precisions(new) == _precisions(old)
    reasons = {n.op_type: n.metadata_props[md.NODE_REASON] for n in new.graph if " kernel on " in n.metadata_props.get(md.NODE_REASON, "")}
    if name != "gpt":
        assert reasons["Greater"].startswith("no bfloat16 kernel on cuda (ORT 1.31.1")


def _loads_and_runs(model: ir.Model) -> None:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    session.run(None, {k: v for k, v in random_feeds(model).items() if k in names})


def _check_cpu_target(path: str) -> None:
    for policy in ("bf16", "fp16"):
        model = mpgraph.convert(onnx.load(path), policy, target="cpu", calibrate=None)
        assert model.metadata_props[md.MODEL_TARGET] == "cpu"
        notes = check_runnable(model, "cpu")  # no kernel missing, or it would raise
        assert (notes == []) if policy == "bf16" else ("--emulate" in notes[0])
        _loads_and_runs(model)


@pytest.mark.parametrize("path", ZOO + [p for p in LIGHT if os.path.basename(p) in FAST_LIGHT], ids=os.path.basename)
def test_target_cpu_native_loads_in_ort_cpu(path: str) -> None:
    _check_cpu_target(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in LIGHT if os.path.basename(p) not in FAST_LIGHT], ids=os.path.basename)
def test_target_cpu_native_loads_in_ort_cpu_slow(path: str) -> None:
    _check_cpu_target(path)


def _pool_model() -> onnx.ModelProto:
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], name="allow1"),
        h.make_node("MaxPool", ["c"], ["p"], name="clear1", kernel_shape=[2, 2]),
        h.make_node("Conv", ["p", "w2"], ["y"], name="allow2"),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 8, 8])], [h.make_tensor_value_info("y", T.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w"),
         onnx.numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w2")],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])


def test_kernel_gap_keeps_exactly_that_op_with_the_reason() -> None:
    cuda = mpgraph.convert(_pool_model(), "bf16")
    assert cuda.graph.node("clear1").metadata_props[md.NODE_PRECISION] == "float32"
    assert cuda.graph.node("clear1").metadata_props[md.NODE_REASON] == (
        "no bfloat16 kernel on cuda (ORT 1.31.1, benchmarks/cuda_kernel_probe.py)"
    )
    assert cuda.graph.node("allow2").metadata_props[md.NODE_PRECISION] == "bfloat16"
    anywhere = mpgraph.convert(_pool_model(), "bf16", target="any")
    assert anywhere.graph.node("clear1").metadata_props[md.NODE_PRECISION] == "bfloat16"
    assert anywhere.metadata_props[md.MODEL_TARGET] == "any"
    cpu = mpgraph.convert(_pool_model(), "bf16", target="cpu")
    assert all(n.metadata_props[md.NODE_PRECISION] != "bfloat16" for n in cpu.graph)
    # The emulation computes float32 anyway: on cpu it keeps nothing for kernels.
    emulated = mpgraph.convert(_pool_model(), "bf16", emulate=True)
    assert emulated.metadata_props[md.MODEL_TARGET] == "cpu"
    assert emulated.graph.node("clear1").metadata_props[md.NODE_PRECISION] == "bfloat16"


def test_runners_refuse_a_target_mismatch() -> None:
    native = mpgraph.convert(_pool_model(), "bf16")
    with pytest.raises(MpgraphError, match=r"converted for target cuda, and ORT cpu has no bfloat16 kernel for Conv \(node 'allow1'\); convert the float32 model with --target cpu"):
        check_runnable(native, "cpu")
    assert check_runnable(native, "cuda") == []
    with pytest.raises(MpgraphError, match="compare the --emulate conversion"):
        mpgraph.compare(ir.from_proto(_pool_model()), native)
    fp16 = mpgraph.convert(_pool_model(), "fp16", target="cpu")
    assert "--emulate" in check_runnable(fp16, "cpu")[0]


def test_unknown_target_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown target 'tpu'; valid targets: cuda, cpu, any"):
        mpgraph.convert(_pool_model(), "bf16", target="tpu")


def test_lookup_uses_the_highest_probed_opset_not_above_the_model() -> None:
    # Dropout: a CUDA kernel in every dtype up to opset 21, none at 22 (the probe's log).
    assert kernel_cell("cuda", "Dropout", "bfloat16", 21) == "ok"
    assert kernel_cell("cuda", "Dropout", "bfloat16", 24) == "no"
    assert kernel_cell("cuda", "Dropout", "bfloat16", 11) == "ok"  # below the probes: the lowest
    assert kernel_cell("cuda", "Softmax", "bfloat16", 22) is None  # not probed on CUDA
    assert kernel_gaps("cuda", ir.DataType.FLOAT16, 22, ["Softmax", "MatMul"]) == {}
    assert kernel_cell("cpu", "MatMul", "float16", 18) == "fp32"  # runs behind inserted Casts


def test_kernel_table_is_what_the_probe_writes(tmp_path) -> None:
    """mpgraph/kernel_table.py is generated from the committed probe JSONs, not edited."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import cpu_kernel_probe
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "benchmarks", "results", "cpu_kernels.json")) as f:
        cpu = json.load(f)
    out = tmp_path / "kernel_table.py"
    cpu_kernel_probe.write_table(str(out), cpu, os.path.join(ROOT, "benchmarks", "results", "cuda_kernels.json"))
    with open(os.path.join(ROOT, "mpgraph", "kernel_table.py")) as f:
        assert out.read_text() == f.read()
    assert tables()["cpu"]["onnxruntime"] == cpu["onnxruntime"]


def test_cli_targets_json() -> None:
    # In-process, against the entry point's own app (test_cli checks that `python -m mpgraph` runs it).
    result = mpgraph_cli("targets", "--op", "MaxPool", "--op", "MatMul", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ops"]["MaxPool"] == {"cpu/float16": "fp32", "cpu/bfloat16": "no", "cuda/float16": "no", "cuda/bfloat16": "no"}
    assert data["providers"]["cuda"]["onnxruntime"] == "1.31.1"
    result = mpgraph_cli("targets", "--op", "Nope")
    assert result.returncode == 2 and "no probe covered Nope" in result.stderr
