"""The real-architecture corpus: tiny transformers models (random init, nothing downloaded) and
small torch nets, exported by both torch exporters, trained by mpgraph's step graphs in ORT CPU
and compared with torch (tests/corpus/check.py says how, benchmarks/corpus_report.py prints the
numbers).

Per model x exporter, four tests:
    grad:    every torch parameter's gradient within 1e-4 relative L2 of torch.autograd;
    adamw:   the loss over 5 AdamW steps within 1e-4 of torch.optim.AdamW;
    lowp:    the emulated bf16 and fp16 step graphs' loss after 5 updates within 1e-2 of fp32's;
    kernels: the CUDA Trainer's kernel lowering (``mpgraph.lowering.lower``; here the library's
             float32 CPU kernels) gives the gradient graph's outputs within 1e-5 of each
             output's scale (each fused kernel sums in its own order), or within 10x the
             graph's own float32 noise floor where that is larger (the 16-block MobileNetV2
             of e6c2b92), with the activation masks a rounding difference flips pinned
             (``check.kernel_errors``).

Cost: each export is made once per run and shared by the checks and by both xdist processes
(``tests/corpus/cache.py``); the gradient graph and its run once per process for ``grad`` and
``kernels``; the AdamW step graph once for ``adamw`` and ``lowp``.

The full corpus is ``slow`` (``pytest --runslow -n 2``: 100 s, 99 CPU-seconds, on two cores
that other jobs shared at a load of 2 to 4; the report script 1.5 min). CI runs one text
encoder, one decoder, one CNN, one ViT and the LSTM, one exporter each (``SUBSET``: 28 s, same
load).
Known failures are strict xfails naming their cause, so a fix turns them into failures here
until the entry is removed.
"""

from __future__ import annotations

import functools

import onnx_ir as ir
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.corpus import cache, check  # noqa: E402
from tests.corpus.models import BUILDERS  # noqa: E402

CHECKS = ("grad", "adamw", "lowp", "kernels")
KERNEL_TOL = 1e-5
#: The kernels check's error may reach this many times the graph's own float32 noise floor
#: (``check.kernel_errors``): the lowering changes the summation order in every conv and matmul,
#: the floor rounds the inputs once.
FLOOR_MARGIN = 10
SUBSET = {("bert", "torchscript"), ("llama", "dynamo"), ("resnet", "torchscript"), ("vit", "dynamo"),
          ("lstm", "torchscript")}

_CHAOTIC = ("ill-conditioned in low precision, not an mpgraph bug: torch's own CPU autocast bf16 moves the 5-step "
            "loss by 2.2e-2 from torch fp32, and fp32 torch started from the weights rounded to fp16 by 1.4e-2 "
            "(Adam's first update is lr times the sign of each gradient component, and rounding flips signs). "
            "mpgraph bf16 / fp16: 2.2e-2 / 9.6e-4 from both exports, fp16 skipping 3 steps at GradScaler's "
            "initial scale as torch does. The 16-block model of e6c2b92 was further off "
            "(benchmarks/results/mobilenet_lowp_study.txt: autocast bf16 7.3e-2, mpgraph fp16 1.8e-1)")

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


@pytest.fixture(scope="session", autouse=True)
def _share_exports(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache.share(tmp_path_factory.getbasetemp())


@functools.cache
def _adamw(model: str, exporter: str) -> tuple[bytes, check.LossError, list[float]]:
    exported = cache.exported(model, exporter)
    graph = check.adamw_step_graph(exported)
    step = ir.to_proto(graph).SerializeToString()  # for lowp's conversions: the runner writes into graph
    error, losses = check.adamw_errors(exported, graph)
    return step, error, losses


@pytest.mark.parametrize(("model", "exporter", "name"), list(_params()))
def test_corpus(model: str, exporter: str, name: str) -> None:
    try:
        exported = cache.exported(model, exporter)
    except check.ExportFailed as e:
        pytest.skip(f"torch cannot export {model} with {exporter}: {e}")
    if name == "grad":
        errors = check.gradient_errors(exported, cache.gradient_run(model, exporter))
        assert errors["<loss>"].vs_torch <= check.LOSS_TOL, errors["<loss>"]
        bad = {k: e for k, e in errors.items() if not e.ok}
        assert not bad, f"{len(bad)} of {len(errors) - 1} gradients off: {dict(list(bad.items())[:5])}"
    elif name == "adamw":
        _, error, _ = _adamw(model, exporter)
        assert error.ok, error
    elif name == "kernels":
        made, worst, floor = check.kernel_errors(exported, cache.gradient_run(model, exporter), tolerance=KERNEL_TOL)
        assert worst <= KERNEL_TOL or (floor is not None and worst <= FLOOR_MARGIN * floor), (worst, floor, made)
    else:
        step, _, losses = _adamw(model, exporter)
        deltas, skipped = check.lowp_deltas(step, exported.case, losses)
        assert max(deltas.values()) <= check.LOWP_TOL, (deltas, skipped)


@pytest.mark.parametrize(("model", "exporter"), sorted(SUBSET), ids=[f"{m}-{e}" for m, e in sorted(SUBSET)])
def test_loss_found_without_flag(model: str, exporter: str) -> None:
    """Neither exporter names the loss ``loss`` (``287``, ``cross_entropy_loss``): the one float
    scalar output is taken as the loss."""
    exported = cache.exported(model, exporter)
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

    exported = cache.exported("lstm", "torchscript")
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
