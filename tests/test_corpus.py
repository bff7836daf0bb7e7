"""The real-architecture corpus: tiny transformers models (random init, nothing downloaded) and
small torch nets, exported by both torch exporters, trained by mpgraph's step graphs in ORT CPU
and compared with torch (tests/corpus/check.py says how, benchmarks/corpus_report.py prints the
numbers).

Per model x exporter, four tests:
    grad:    every torch parameter's gradient within 1e-4 relative L2 of torch.autograd;
    adamw:   the loss over 5 AdamW steps within 1e-4 of torch.optim.AdamW;
    lowp:    the emulated bf16 and fp16 step graphs' loss after 5 updates within 1e-2 of fp32's;
    kernels: the CUDA Trainer's kernel lowering (``mpgraph.kernels.lower``; here the library's
             float32 CPU kernels) gives the gradient graph's outputs within 1e-5 of each
             output's scale (each fused kernel sums in its own order), or within 10x the
             graph's own float32 noise floor where that is larger (MobileNetV2), with the
             activation masks a rounding difference flips pinned (``check.kernel_errors``).

The full corpus is ``slow`` (``pytest --runslow``: 101 s on two idle cores; the report script 3.5 min, 14 when other
jobs share them). CI runs one text encoder, one decoder, one CNN, one ViT and the LSTM, one
exporter each (``SUBSET``: 53 s on two idle cores, 83 s shared).
Known failures are strict xfails naming their cause, so a fix turns them into failures here
until the entry is removed.
"""

from __future__ import annotations

import functools
import logging
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.corpus import check  # noqa: E402
from tests.corpus.models import BUILDERS, build  # noqa: E402

CHECKS = ("grad", "adamw", "lowp", "kernels")
KERNEL_TOL = 1e-5
#: The kernels check's error may reach this many times the graph's own float32 noise floor
#: (``check.kernel_errors``): the lowering changes the summation order in every conv and matmul,
#: the floor rounds the inputs once.
FLOOR_MARGIN = 10
SUBSET = {("bert", "torchscript"), ("llama", "dynamo"), ("resnet", "torchscript"), ("vit", "dynamo"),
          ("lstm", "torchscript")}

_CHAOTIC = ("ill-conditioned, not an mpgraph bug (benchmarks/results/mobilenet_lowp_study.txt): torch CPU "
            "autocast bf16 moves the 5-step loss by 7.3e-2 vs torch fp32 too (fp16 with GradScaler 1.5e-2), "
            "and fp32 torch from weights perturbed by one fp16 ulp by up to 1.0e-1; step-1 gradients are "
            "~200x fp32 rounding off float64, so one low-precision rounding flips 14% (fp16) to 32% (bf16) "
            "of Adam's first update signs, in torch and mpgraph alike. mpgraph bf16 / fp16: 1.4e-2 "
            "(dynamo 4.5e-3) / 1.8e-1, fp16 skipping 6 steps at GradScaler's initial scale as torch does")

XFAIL: dict[tuple[str, str, str], str] = {
    **{("mobilenet_v2", e, "lowp"): _CHAOTIC for e in check.EXPORTERS},
}


def _params():
    for model in BUILDERS:
        for exporter in check.EXPORTERS:
            for name in CHECKS:
                marks = [] if (model, exporter) in SUBSET else [pytest.mark.slow]
                if (reason := XFAIL.get((model, exporter, name))) is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                yield pytest.param(model, exporter, name, marks=marks, id=f"{model}-{exporter}-{name}")


@functools.cache
def _exported(model: str, exporter: str) -> check.Exported:
    # The exporters' warnings and mpgraph's own would flood the log; silence them for the
    # export only, and restore both (a global level left at ERROR hid later tests' warnings).
    mpgraph_logger = logging.getLogger("mpgraph")
    level = mpgraph_logger.level
    mpgraph_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return check.export(build(model), exporter)
    finally:
        mpgraph_logger.setLevel(level)


@functools.cache
def _adamw(model: str, exporter: str) -> tuple[bytes, check.LossError, list[float]]:
    exported = _exported(model, exporter)
    step = check.adamw_step(exported)
    error, losses = check.adamw_errors(exported, step)
    return step, error, losses


@pytest.mark.parametrize(("model", "exporter", "name"), list(_params()))
def test_corpus(model: str, exporter: str, name: str) -> None:
    try:
        exported = _exported(model, exporter)
    except check.ExportFailed as e:
        pytest.skip(f"torch cannot export {model} with {exporter}: {e}")
    if name == "grad":
        errors = check.gradient_errors(exported)
        assert errors["<loss>"].vs_torch <= check.LOSS_TOL, errors["<loss>"]
        bad = {k: e for k, e in errors.items() if not e.ok}
        assert not bad, f"{len(bad)} of {len(errors) - 1} gradients off: {dict(list(bad.items())[:5])}"
    elif name == "adamw":
        _, error, _ = _adamw(model, exporter)
        assert error.ok, error
    elif name == "kernels":
        made, worst, floor = check.kernel_errors(exported)
        assert worst <= max(KERNEL_TOL, FLOOR_MARGIN * floor), (worst, floor, made)
    else:
        step, _, losses = _adamw(model, exporter)
        deltas, skipped = check.lowp_deltas(step, exported.case, losses)
        assert max(deltas.values()) <= check.LOWP_TOL, (deltas, skipped)


@pytest.mark.parametrize(("model", "exporter"), sorted(SUBSET), ids=[f"{m}-{e}" for m, e in sorted(SUBSET)])
def test_loss_found_without_flag(model: str, exporter: str) -> None:
    """Neither exporter names the loss ``loss`` (``287``, ``cross_entropy_loss``): the one float
    scalar output is taken as the loss."""
    exported = _exported(model, exporter)
    step = check.build_training_graph(exported.model, optimizer=None)
    assert step.graph.outputs[0].name == exported.loss != "loss"


def test_corpus_covers_the_issue_families() -> None:
    """The corpus keeps at least 12 architectures, and the ones issue 12 names."""
    assert len(BUILDERS) >= 12
    assert {"bert", "distilbert", "llama", "gpt2", "t5", "vit", "swin", "resnet", "convnext",
            "efficientnet", "lstm", "segformer"} <= set(BUILDERS)


def test_gradient_check_catches_a_wrong_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker is not vacuous: a step graph whose MatMul gradients are scaled by 1.02 fails."""
    import numpy as np
    import onnx_ir as ir

    exported = _exported("lstm", "torchscript")
    original = check.build_training_graph

    def planted(*args, **kwargs):
        step = original(*args, **kwargs)
        for value in step.graph.outputs[1:]:
            if value.name == "grad/head.weight":
                node = ir.node("Mul", [value, ir.Value(name="planted_scale")], num_outputs=1)
                node.inputs[1].const_value = ir.tensor(np.array(1.02, np.float32))
                step.graph.initializers[node.inputs[1].name] = node.inputs[1]
                step.graph.append(node)
                node.outputs[0].name = "planted_out"
                index = list(step.graph.outputs).index(value)
                step.graph.outputs[index] = node.outputs[0]
                value.name, node.outputs[0].name = "grad/head.weight_raw", "grad/head.weight"
        return step

    monkeypatch.setattr(check, "build_training_graph", planted)
    errors = check.gradient_errors(exported)
    assert not errors["head.weight"].ok and abs(errors["head.weight"].vs_torch - 0.02) < 1e-3
    assert all(e.ok for k, e in errors.items() if k != "head.weight")
