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
element equal). Marked ``gpu``: skipped without CUDA or onnxruntime-gpu.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

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
