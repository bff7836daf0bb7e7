"""The fused Llama backwards on CUDA (``csrc/rmsnorm.cu``, ``csrc/swiglu.cu``) against the ops
they replace, on ORT CUDA.

The bf16 step of one Llama MLP sub-layer (``benchmarks/llama_ab.block``: RMSNorm in float32,
the SwiGLU and the matmuls in bfloat16), planned for CUDA with every default rule and with
every rule but ``rmsnorm_grad`` and ``swiglu_grad``. SwiGluGrad rounds each step to bfloat16 in
the ops' order as ORT's elementwise kernels do (compute in float, round to nearest even), so
the weight gradients it alone feeds are the same bits; RmsNormGrad sums in another order, so x's
and gamma's gradients agree to float32 rounding. The forward SwiGlu computes s by ORT's Sigmoid
formula; it is compared within a bfloat16 rounding. ``benchmarks/llama_kernels_torch.py`` checked
both kernels against torch's op sequence on an H200 (SwiGluGrad bfloat16/float16/float32: every
element equal). Then RmsNormGrad alone on CUDA against its CPU kernel, on shapes its one-pass and
three-pass CUDA paths each take. Marked ``gpu``: skipped without CUDA or onnxruntime-gpu.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import assert_outputs_close, load_benchmark

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
SHAPE = (4, 256, 768, 2048)


@pytest.fixture(scope="module")
def library() -> str:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu's CUDAExecutionProvider")
    from mpgraph.lowering.plan import library as build

    return str(build("cuda"))


def _outputs(plan, feeds) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if plan.custom_ops:
        options.register_custom_ops_library(plan.custom_ops)
    session = ort.InferenceSession(plan.graph, options, providers=["CUDAExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def test_fused_llama_mlp_step_matches_the_unfused_ops_on_cuda(library: str) -> None:
    """The backward fusions against the ops (the forward SwiGlu left out): the weight gradients
    SwiGluGrad alone feeds bit for bit, the rest to float32 rounding. Then with the forward
    SwiGlu too, whose s follows ORT's Sigmoid formula step by step in bfloat16 (written from
    ORT's source, not checked bit for bit on ORT): within a bfloat16 rounding of s."""
    from mpgraph.lowering.plan import PlanOptions, plan_session

    ab = load_benchmark("llama_ab")
    step = ab.block_step(SHAPE, low=True)
    with ab.without(("swiglu",)):
        backward = plan_session(step, "cuda", PlanOptions())
    fused = plan_session(step, "cuda", PlanOptions())
    with ab.without(ab.RULES):
        plain = plan_session(step, "cuda", PlanOptions())
    assert dict(backward.applied)["rmsnorm_grad"] == 1 and dict(backward.applied)["swiglu_grad"] == 1
    ops = [n.op_type for n in onnx.load_from_string(fused.graph).graph.node]
    assert "RmsNormGradAdd" in ops and "SwiGluGrad" in ops and "SwiGlu" in ops and "ReduceMean" not in ops
    assert "Sigmoid" not in ops
    feeds = ab.block_feeds(SHAPE)
    got, want = _outputs(backward, feeds), _outputs(plain, feeds)
    for name in ("grad/wg", "grad/wu", "grad/wd"):
        assert np.array_equal(got[name], want[name]), (name, float(np.abs(got[name] - want[name]).max()))
    assert_outputs_close(got, want, 1e-5)
    assert_outputs_close(_outputs(fused, feeds), want, 1e-2)


#: RmsNormGrad cases: x's shape, dy's parts' types, an addend (RmsNormGradAdd) or not. The
#: one-pass CUDA kernel (float32 x, D <= 768 a multiple of 8): one 256-column chunk, three, a
#: last chunk with one lane busy, rows not a multiple of its 32, a 3-D x; then shapes the
#: three-pass path takes (D not a multiple of 8, D > 768).
RMS_CASES = [
    ((70, 96), ["float"], False),
    ((40, 768), ["bfloat16"] * 3, True),
    ((33, 520), ["float16", "bfloat16"], True),
    ((300, 768), ["bfloat16", "bfloat16", "float", "float16"], False),
    ((4, 3, 256), ["bfloat16"], False),
    ((5, 100), ["bfloat16"] * 2, False),
    ((3, 1024), ["float"], True),
]


def _rmsnorm_grad_model(shape: tuple[int, ...], parts: list[str], add: bool) -> bytes:
    """One RmsNormGrad (RmsNormGradAdd when ``add``) reading float32 feeds cast to the parts'
    types (ORT's Python API takes no bfloat16 arrays)."""
    from mpgraph.lowering import DOMAIN

    f32 = TensorProto.FLOAT
    casts = [helper.make_node("Cast", [f"p{k}"], [f"d{k}"], to=getattr(TensorProto, t.upper()))
             for k, t in enumerate(parts)]
    eps = helper.make_tensor("eps", f32, [], [1e-6])
    inputs = ["x", "scale", "eps", *(["addend"] if add else []), *(f"d{k}" for k in range(len(parts)))]
    node = helper.make_node("RmsNormGradAdd" if add else "RmsNormGrad", inputs, ["dx", "dscale", "work"], domain=DOMAIN)
    feeds = ["x", *(["addend"] if add else []), *(f"p{k}" for k in range(len(parts)))]
    graph = helper.make_graph(casts + [node], "rmsnorm_grad",
                              [helper.make_tensor_value_info(n, f32, list(shape)) for n in feeds]
                              + [helper.make_tensor_value_info("scale", f32, [shape[-1]])],
                              [helper.make_tensor_value_info(n, f32, None) for n in ("dx", "dscale")], [eps])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)], ir_version=10)
    return model.SerializeToString()


def _rmsnorm_grad_run(model: bytes, library: str, provider: str, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model, options, providers=[provider]).run(None, feeds)


def _rmsnorm_grad_feeds(shape: tuple[int, ...], parts: list[str], add: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(shape) + len(parts))
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "scale": (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)}
    feeds.update({f"p{k}": rng.standard_normal(shape).astype(np.float32) for k in range(len(parts))})
    if add:
        feeds["addend"] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("shape, parts, add", RMS_CASES)
def test_rmsnorm_grad_cuda_matches_the_cpu_kernel(library: str, shape, parts, add) -> None:
    """RmsNormGrad's CUDA kernels against its CPU kernel (kernels.cc, one row at a time): dx and
    dscale within float32 summation-order rounding, and the same bits on a second CUDA run."""
    from mpgraph.lowering.plan import library as build

    model, feeds = _rmsnorm_grad_model(shape, parts, add), _rmsnorm_grad_feeds(shape, parts, add)
    got = _rmsnorm_grad_run(model, library, "CUDAExecutionProvider", feeds)
    again = _rmsnorm_grad_run(model, library, "CUDAExecutionProvider", feeds)
    want = _rmsnorm_grad_run(model, str(build("cpu")), "CPUExecutionProvider", feeds)
    for name, g, a, w in zip(("dx", "dscale"), got, again, want, strict=True):
        assert np.array_equal(g, a), name
        assert g.shape == w.shape and float(np.abs(g - w).max()) <= 1e-5 * float(np.abs(w).max()), \
            (name, float(np.abs(g - w).max()), float(np.abs(w).max()))
