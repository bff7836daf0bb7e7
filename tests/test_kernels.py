"""mpgraph's fused kernels (``mpgraph.lowering``): the C ABI slots, the AdamW fusion, and
bit-identical training with and without it on ORT's CPU provider (the CUDA kernel is checked
on the GPU machine: benchmarks/results/kernels_cuda.txt)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph import lowering as kernels
from mpgraph.convert import convert
from mpgraph.lowering.fuse import fuse_adamw, fuse_layernorm_grad
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "models/onnx/gpt.loss.onnx"
MLP = ROOT / "models/onnx/tiny_mlp.loss.onnx"
ABI = ROOT / "mpgraph/lowering/csrc/ort_abi.h"


def _slots() -> dict[str, int]:
    return {name: int(index) for name, index in re.findall(r"\bk(\w+) = (\d+),", ABI.read_text())}


def test_abi_slots_are_the_functions_they_name():
    """Call the slots the kernels use through the installed ORT's own table (ctypes), each
    with an effect only the named function has: a wrong index fails here, not in a session."""
    lib = ctypes.CDLL(str(next((Path(ort.__file__).parent / "capi").glob("libonnxruntime.so*"))))
    lib.OrtGetApiBase.restype = ctypes.POINTER(ctypes.c_void_p * 2)
    get_api = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(lib.OrtGetApiBase().contents[0])
    table = ctypes.cast(get_api(17), ctypes.POINTER(ctypes.c_void_p * 300)).contents
    slots = _slots()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t

    def fn(name, restype, *args):
        return ctypes.CFUNCTYPE(restype, *args)(table[slots[name]])

    status = fn("CreateStatus", vp, ctypes.c_int, ctypes.c_char_p)(2, b"slot check")
    assert fn("GetErrorMessage", ctypes.c_char_p, vp)(status) == b"slot check"
    assert fn("GetErrorCode", ctypes.c_int, vp)(status) == 2
    fn("ReleaseStatus", None, vp)(status)

    # A CPU tensor over our own buffer (slots 69 CreateCpuMemoryInfo, 49 CreateTensorWithData).
    info = vp()
    assert ctypes.CFUNCTYPE(vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(vp))(table[69])(1, 0, ctypes.byref(info)) is None
    data = np.arange(6, dtype=np.float32)
    shape = (ctypes.c_int64 * 2)(2, 3)
    value = vp()
    create = ctypes.CFUNCTYPE(vp, vp, vp, sz, ctypes.POINTER(ctypes.c_int64), sz, ctypes.c_int, ctypes.POINTER(vp))(table[49])
    assert create(info, data.ctypes.data, data.nbytes, shape, 2, 1, ctypes.byref(value)) is None

    has = ctypes.c_int()
    assert fn("HasValue", vp, vp, ctypes.POINTER(ctypes.c_int))(value, ctypes.byref(has)) is None and has.value == 1
    ptr = vp()
    assert fn("GetTensorMutableData", vp, vp, ctypes.POINTER(vp))(value, ctypes.byref(ptr)) is None
    assert ptr.value == data.ctypes.data
    tinfo = vp()
    assert fn("GetTensorTypeAndShape", vp, vp, ctypes.POINTER(vp))(value, ctypes.byref(tinfo)) is None
    rank, count, etype = sz(), sz(), ctypes.c_int()
    assert fn("GetDimensionsCount", vp, vp, ctypes.POINTER(sz))(tinfo, ctypes.byref(rank)) is None and rank.value == 2
    dims = (ctypes.c_int64 * 2)()
    assert fn("GetDimensions", vp, vp, ctypes.POINTER(ctypes.c_int64), sz)(tinfo, dims, 2) is None and list(dims) == [2, 3]
    assert fn("GetTensorShapeElementCount", vp, vp, ctypes.POINTER(sz))(tinfo, ctypes.byref(count)) is None and count.value == 6
    assert fn("GetTensorElementType", vp, vp, ctypes.POINTER(ctypes.c_int))(tinfo, ctypes.byref(etype)) is None and etype.value == 1
    fn("ReleaseTensorTypeAndShapeInfo", None, vp)(tinfo)
    ctypes.CFUNCTYPE(None, vp)(table[96])(value)  # ReleaseValue

    # ParallelFor refuses a missing kernel context before it runs anything.
    body = ctypes.CFUNCTYPE(None, vp, sz)(lambda data, i: None)
    status = fn("KernelContext_ParallelFor", vp, vp, type(body), sz, sz, vp)(None, body, 4, 0, None)
    assert fn("GetErrorMessage", ctypes.c_char_p, vp)(status) == b"Invalid context"
    fn("ReleaseStatus", None, vp)(status)
    ctypes.CFUNCTYPE(None, vp)(table[94])(info)  # ReleaseMemoryInfo


def test_kernel_info_attribute_slots_read_the_nodes_attributes():
    """Slots 85 and 86 (KernelInfoGetAttribute_float/_int64) need a kernel's info, which only a
    session makes: SdpaForward's ``scale`` and ``is_causal`` change its output as the attributes
    say, and a node without them gets the defaults (1/sqrt(head dim), not causal)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 2, 4)).astype(np.float32) for _ in range(3))

    def run(**attrs):
        node = helper.make_node("SdpaForward", ["q", "k", "v"], ["y", "stats"], domain=kernels.DOMAIN, **attrs)
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, 2, 4]) for n in "qkv"]
        outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "stats")]
        model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                                  opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(kernels.DOMAIN, 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(kernels.library("cpu")))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(["y"], {"q": q, "k": k, "v": v})[0]

    def want(scale, causal):
        s = q[0, 0].astype(np.float64) @ k[0, 0].T * scale
        s[0, 1] = -np.inf if causal else s[0, 1]
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v[0, 0]

    np.testing.assert_allclose(run()[0, 0], want(0.5, False), rtol=1e-5)
    np.testing.assert_allclose(run(scale=3.0, is_causal=1)[0, 0], want(3.0, True), rtol=1e-5)


def _count(model: ir.Model, op_type: str) -> int:
    return sum(1 for n in model.graph if n.op_type == op_type)


@pytest.mark.parametrize("options, expected", [
    ({}, 1),                               # the zoo GPT's tensors are all small: one packed slot
    ({"pack": False}, None),               # one slot per parameter tensor
    ({"flat": True}, 1),
])
def test_every_adamw_slot_is_fused(options, expected):
    step = build_training_graph(GPT, optimizer="adamw", optimizer_options=options)
    # One slot per first-moment state input (optim/<slot>/m).
    slots = sum(1 for v in step.graph.inputs if re.fullmatch(r"optim/.+/m", v.name or ""))
    assert slots == expected if expected else slots > 20
    before, sqrt = sum(1 for _ in step.graph), _count(step, "Sqrt")
    assert fuse_adamw(step) == slots
    assert _count(step, "AdamWUpdate") == slots and _count(step, "Sqrt") == sqrt - slots
    # 14 ops a slot became one node (13 fewer); no other node went.
    assert sum(1 for _ in step.graph) == before - 13 * slots
    assert step.opset_imports[kernels.DOMAIN] == 1


def test_amsgrad_and_sgd_keep_their_ops():
    for optimizer, options in (("adam", {"amsgrad": True}), ("sgd", {"momentum": 0.9})):
        step = build_training_graph(MLP, optimizer=optimizer, optimizer_options=options)
        assert fuse_adamw(step) == 0


def _train(step: ir.Model, fused: bool, steps: int = 6) -> tuple[list[float], dict[str, np.ndarray], int]:
    # Fused: CPU's default kernels (AdamW, its scalars, ReluGrad: bit-identical rules); scope all
    # adds same-math ones (the cross_entropy rule fuses this MLP's loss).
    trainer = Trainer(step, "cpu", threads=1, kernels=None if fused else False)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else 16 for d in spec.shape]
            if spec.dtype.kind == "i":
                batch[spec.name] = rng.integers(0, 2, shape).astype(spec.dtype)
            else:
                batch[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        losses.append(float(trainer.step(batch, lr=3e-3).loss))
    return losses, trainer.state, trainer.kernels_fused


@pytest.mark.parametrize("optimizer, options", [
    ("adamw", {}),
    ("adamw", {"pack": False, "weight_decay": 0.1}),
    ("adam", {"weight_decay": 0.01}),      # L2: the gradient gains p * wd before the update
    ("adamw", {"flat": True}),
])
def test_fused_training_is_bit_identical(optimizer, options):
    step = build_training_graph(MLP, optimizer=optimizer, optimizer_options=options)
    plain, fused = _train(step, False), _train(step, True)
    assert plain[2] == 0 and fused[2] >= 1
    assert plain[0] == fused[0]
    for name, value in plain[1].items():
        assert np.array_equal(value, fused[1][name]), name


def test_fused_training_with_dynamic_loss_scaling_is_bit_identical():
    """fp16 with dynamic loss scaling gates the coefficients on overflow: the fused node reads
    the gated scalars, so a skipped step still leaves p, m and v unchanged."""
    step = build_training_graph(MLP, optimizer="adamw")
    low = convert(step, "fp16", emulate=True, calibrate=None)
    lowered = ir.from_proto(ir.to_proto(low))
    kernels.lower(lowered)
    assert _count(lowered, "AdamWUpdate") == 1 and _count(lowered, "UnscaleGradients") == 1
    assert _count(lowered, "IsNaN") == 0
    plain, fused = _train(low, False), _train(low, True)
    assert plain[0] == fused[0]
    for name, value in plain[1].items():
        assert np.array_equal(value, fused[1][name], equal_nan=True), name


def _run(model: ir.Model, library: bool) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(str(kernels.library("cpu")))
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 3 for d in i.shape]
        feeds[i.name] = rng.integers(0, 50, shape).astype(np.int64) if "int" in i.type else rng.standard_normal(shape).astype(np.float32)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_layernorm_backward_is_fused_and_agrees():
    """The zoo GPT (a torch export): every LayerNormalization's backward becomes one node, and
    the gradients agree with the rule's 11 ONNX nodes within float32 rounding (summation
    order). More in test_lowering_blocks."""
    grads = build_training_graph(GPT, optimizer=None)
    forward = sum(1 for n in grads.graph if n.op_type == "LayerNormalization" and len(n.outputs) == 3)
    fused = ir.from_proto(ir.to_proto(grads))
    before = sum(1 for _ in fused.graph)
    assert fuse_layernorm_grad(fused) == forward == 5
    assert _count(fused, "LayerNormalization") == forward  # the recomputes are gone
    # the recompute, 10 nodes of dx and dscale, and dbias's ReduceSum: one LayerNormGradBias each
    assert sum(1 for _ in fused.graph) == before - 11 * forward == before - 11 * _count(fused, "LayerNormGradBias")
    plain, low = _run(grads, False), _run(fused, True)
    for name, value in plain.items():
        scale = max(float(np.max(np.abs(value))), 1e-6) if value.size else 1.0
        np.testing.assert_allclose(low[name], value, rtol=0, atol=2e-6 * scale, err_msg=name)


def test_cpu_default_is_the_measured_subset_and_off_says_why():
    """On CPU the Trainer runs ``scope="default"``: AdamW and its scalars, not the LayerNorm,
    GELU or softmax loops; ``kernels=True`` runs all of it, ``kernels=False`` none."""
    step = build_training_graph(GPT, optimizer="adamw")
    lowered = {scope: ir.from_proto(ir.to_proto(step)) for scope in kernels.SCOPES}
    fused = {scope: kernels.lower(model, "cpu", scope) for scope, model in lowered.items()}
    ops = {scope: {n.op_type for n in model.graph} for scope, model in lowered.items()}
    assert {"AdamWUpdate", "AdamScalars"} <= ops["default"] and "ErfGeluGrad" not in ops["default"]
    assert {"ErfGeluGrad", "LayerNormGradBias"} <= ops["all"] and fused["native"] == 0  # the GPT has no convolution
    assert Trainer(step, "cpu").kernels_fused == fused["default"] > 0
    assert Trainer(step, "cpu", kernels=True).kernels_fused == fused["all"] > fused["default"]
    off = Trainer(step, "cpu", kernels=False)
    assert off.kernels_fused == 0 and off.kernels_reason == "kernels=False"
    with pytest.raises(ValueError, match="scope must be one of"):
        kernels.lower(step, "cpu", "some")


def test_a_size_mismatch_fails_loudly():
    """The fusion trusts shape inference where a gradient's dims are symbolic; the kernel
    checks the sizes again and refuses, instead of reading past a buffer."""
    step = build_training_graph(MLP, optimizer="adamw", optimizer_options={"pack": False})
    fuse_adamw(step)
    node = next(n for n in step.graph if n.op_type == "AdamWUpdate")
    size = int(np.prod(list(node.inputs[0].shape)))
    wrong = next(v for v in step.graph.inputs if v.dtype == ir.DataType.FLOAT and v.shape is not None and len(v.shape)
                 and all(isinstance(d, int) for d in v.shape) and int(np.prod(list(v.shape))) != size)
    node.replace_input_with(1, wrong)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels.library("cpu")))
    session = ort.InferenceSession(ir.to_proto(step).SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 4 for d in i.shape]
        feeds[i.name] = np.ones(shape, np.int64 if "int" in i.type else np.float32)
    with pytest.raises(Exception, match="p, g, m and v differ in size"):
        session.run(None, feeds)


def test_the_cuda_build_compiles_and_carries_the_cpu_kernels_too():
    """nvcc builds the CUDA library here (no GPU needed); its CPU op is the same code."""
    path = kernels.library("cuda")
    assert ctypes.CDLL(str(path)).MpgraphKernelsHaveCuda() == 1
    step = build_training_graph(MLP, optimizer="adamw")
    kernels.lower(step)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(path))
    ort.InferenceSession(ir.to_proto(step).SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_a_prebuilt_library_named_by_its_variable_is_used_as_it_is(tmp_path, monkeypatch):
    """$MPGRAPH_CPU_LIBRARY / $MPGRAPH_CUDA_LIBRARY: the named file, nothing compiled (a machine
    without nvcc or cudnn-frontend runs a library built elsewhere); a name of no file is an error
    that says which variable, not a silent build."""
    from mpgraph.lowering import build

    built = build.build_library(cuda=False)
    copy = tmp_path / "prebuilt.so"
    copy.write_bytes(built.read_bytes())
    monkeypatch.setenv("MPGRAPH_CPU_LIBRARY", str(copy))
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: pytest.fail("compiled or probed a compiler"))
    assert build.build_library(cuda=False) == copy
    assert ctypes.CDLL(str(copy)).MpgraphKernelsHaveCuda() == 0
    monkeypatch.setenv("MPGRAPH_CUDA_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(build.KernelBuildError, match=r"\$MPGRAPH_CUDA_LIBRARY names .*missing.so, which is not a file"):
        build.build_library(cuda=True)
    monkeypatch.delenv("MPGRAPH_CPU_LIBRARY")
    with pytest.raises(pytest.fail.Exception, match="compiled or probed"):
        build.build_library(cuda=False)  # unset: the cache lookup runs again (it probes the compiler)


def test_lowered_graph_stays_topologically_sorted():
    step = build_training_graph(GPT, optimizer="adamw", optimizer_options={"pack": False})
    assert kernels.lower(step) > 5
    seen = {v for v in step.graph.inputs} | set(step.graph.initializers.values())
    for node in step.graph:
        for value in node.inputs:
            assert value is None or value in seen or value.producer() is None, (node.name, value.name)
        seen.update(node.outputs)


def test_layernorm_grad_names_the_forward_mean_when_a_pass_dropped_it():
    """After specialize_shapes (the CUDA graph session's copy) the forward node's unused Mean
    output has no name; an unnamed input is an absent one to ORT, so the lowering names it."""
    from mpgraph.lowering.specialize import specialize_shapes

    step = build_training_graph(GPT, optimizer="adamw")
    fixed = specialize_shapes(step, {"tokens": (4, 16), "label": (4, 16)})
    assert fuse_layernorm_grad(fixed) == 5
    for node in fixed.graph:
        if node.op_type.startswith("LayerNormGrad"):
            assert all(v is not None and v.name and v.dtype == ir.DataType.FLOAT for v in node.inputs)
    plain = _run(specialize_shapes(build_training_graph(GPT, optimizer="adamw"), {"tokens": (4, 16), "label": (4, 16)}), False)
    low = _run(fixed, True)
    assert abs(float(plain["loss"]) - float(low["loss"])) < 1e-6


def test_every_lowering_is_a_registered_documented_rule():
    """``registry.RULES``: unique names, a known scope, providers, exactness and a doc each; the
    order per provider and scope is the one the session plans apply (the old if-ladder's)."""
    from mpgraph.lowering.registry import RULES, Exactness

    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    assert all(r.scope in (*kernels.SCOPES, "deterministic") and r.providers <= {"cpu", "cuda"} and r.providers
               and isinstance(r.exactness, Exactness) and r.doc for r in RULES)
    order = {(p, s): [r.name for r in RULES if r.runs(p, s)] for p in ("cpu", "cuda") for s in kernels.SCOPES}
    library = ["sdpa", "sdpa_layout", "rotary", "adamw", "adam_scalars", "multi_adamw", "layernorm_grad", "gelu", "rmsnorm_grad", "swiglu_grad", "swiglu",
               "unscale", "multi_cast", "fold_transposes", "softmax_grad", "cross_entropy", "relu_grad"]
    assert order["cuda", "all"] == order["cuda", "default"] == ["fp8_gemm", "pad_concat", "sdpa", "sdpa_layout", "rotary",
                                                                "attention_expand", *library[3:], "sce_grad", "narrow_pad", "fold_scales", "gemm_bias",
                                                                "matmul_bias", "gemm_bias_gelu", "pointwise", "recompute", "free_early"]
    assert order["cpu", "all"] == [*library, "nchwc", "permute", "fold_scales", "gemm_bias", "matmul_bias", "gemm_bias_gelu", "pointwise", "recompute"]
    assert order["cpu", "default"] == ["adamw", "adam_scalars", "multi_adamw", "relu_grad", "nchwc", "permute"]
    # fp8_gemm (ORT's own GemmFloat8), narrow_pad (a node order), pad_concat (ORT's Concat),
    # attention_expand (Attention's function body as standard ops) and free_early (a node order)
    # are the CUDA rules of scope native: no kernel library.
    native = ["fp8_gemm", "pad_concat", "attention_expand", "narrow_pad", "free_early"]
    assert order["cpu", "native"] == ["nchwc"] and order["cuda", "native"] == native
