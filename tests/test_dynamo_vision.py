"""Vision models from torch's dynamo exporter: the step trains the user's model, or is refused.

ViT, Swin, HF ResNet (BatchNorm) and a diffusers UNet2D (GroupNorm, timestep embedding,
attention, skip concatenations), random init, exported as a user would:
``torch.onnx.export(module, args, dynamo=True)`` at opsets 18 and 23, with its optimizer (the
default) and without (``optimize=False``). For each export, ``build_training_graph`` either
gives every torch parameter its own gradient within 1e-4 of torch.autograd in ``train()``
mode, trains no constant, and builds an AdamW step that ONNX Runtime's CPU provider runs with
its default graph optimizations; or it refuses in one line that says why and how to export.

The exporter writes a train-mode BatchNorm in eval form (one output, no ``training_mode``):
the step graph rebuilds it with batch statistics and torch's running statistics
(``SetBatchNormModePass`` rule 5); with its optimizer, the exporter folds it into the conv
(``FuseBatchNormIntoConv``) and the graph is refused.

HF Swin's default attention (sdpa) does not export with torch 2.13's dynamo exporter
(``Cannot view a tensor with shape [8, 16, 2, 8] ... as (8, 16, 16)`` in torch's decomposition,
also at the Swin-T config): the Swin case uses eager attention. A Swin written as timm writes
it (``models.windowed_swin``, channels last) is trained too: its step graph is where ONNX
Runtime's transpose optimizer met a Pad with ``axes``. The last tests are minimal reproducers
of the two ONNX Runtime 1.32 bugs the step graphs work around.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper as h

from mpgraph.errors import UnsupportedModelError
from mpgraph.training import build_training_graph
from tests.helpers import run_named

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from tests.corpus import models  # noqa: E402 - needs torch
from tests.test_dynamo_params import GRAD_TOL, _check_against_torch  # noqa: E402

MODELS = ("vit", "swin", "resnet", "unet2d")
OPSETS = (18, 23)
#: The first parameter the exporter's optimizer folds or drops, measured (torch 2.13,
#: onnxscript 0.7.2); such an optimized export is refused. ViT:
#: ``cls_token`` folded into an ``Expand``; Swin: ``RemoveOptionalBiasFromConv`` on the patch
#: embedding; ResNet: ``FuseBatchNormIntoConv``; UNet2D: GroupNorm weights folded into
#: ``val_*`` at opset 18 (58 parameters). At opset 23 (GroupNorm is a ``GroupNormalization``
#: node there) UNet2D's only folds are its 16 pre-transposed attention weights, which
#: ``UntieExportedParametersPass`` rule 0 rebuilds, so that export trains (``None``).
FIRST_FOLDED = {
    "vit": "model.vit.embeddings.cls_token",
    "swin": "model.swin.embeddings.patch_embeddings.projection.bias",
    "resnet": "model.resnet.embedder.embedder.convolution.weight",
    ("unet2d", 18): "model.down_blocks.0.resnets.0.norm1.weight",
    ("unet2d", 23): None,
}
#: Gradients that are zero in exact arithmetic: softmax ignores a shift that is the same for
#: every key, so an attention key bias gets none. torch's float32 and ours are rounding noise
#: (UNet2D: both 3e-10 to 7e-10 against 1e-18 in float64, 1e-9 of the largest gradient's
#: norm), which GRAD_TOL on 1e-6 of the largest norm cannot tell apart: their difference must
#: stay within 1e-8 of the largest norm (an error of 1e-2 in ``_check_against_torch``'s units;
#: measured: ViT 5.4e-5, Swin 6.5e-6, UNet2D 1.1e-3).
ZERO_GRADIENTS = ("*.k_proj.bias", "*.to_k.bias")
ZERO_TOL = 1e-2


@functools.cache
def _case(name: str) -> models.Case:
    torch.manual_seed(0)
    case = getattr(models, name)()
    if name == "swin":
        case.module.model.set_attn_implementation("eager")
    case.module.train()
    return case


@functools.cache
def _exports(name: str, opset: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The module exported as is (train mode) without the exporter's optimizer, then the same
    program optimized: what ``optimize=True``, the default, gives."""
    case = _case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(copy.deepcopy(case.module), case.inputs, dynamo=True, opset_version=opset,
                                    optimize=False, input_names=list(case.input_names), verbose=False)
        plain = copy.deepcopy(program.model_proto)
        program.optimize()
    return plain, program.model_proto


def _feeds(case: models.Case) -> dict[str, np.ndarray]:
    return {n: a.numpy() for n, a in zip(case.input_names, case.inputs, strict=True)}


CASES = [pytest.param(m, o, id=f"{m}-opset{o}") for m in MODELS for o in OPSETS]


@pytest.mark.parametrize(("name", "opset"), CASES)
def test_dynamo_export_trains_the_model_or_is_refused(name: str, opset: int) -> None:
    """One test per export, so that test processes never repeat one (4 s of CPU each): the
    plain export trains, the optimized one is refused, and at opset 18 the AdamW step runs."""
    case = _case(name)
    plain, optimized = _exports(name, opset)
    _check_plain_export(case, plain)
    first = FIRST_FOLDED[name] if name in FIRST_FOLDED else FIRST_FOLDED[name, opset]
    if first is None:
        _check_plain_export(case, optimized)  # every parameter trains, within the same bounds
    else:
        _check_refusal(case, optimized, first)
    if opset == 18:
        _check_adamw_step(case, plain)


def _check_plain_export(case: models.Case, plain: onnx.ModelProto) -> None:
    """Every parameter has its own gradient (buffers, the timestep frequencies, GroupNorm's
    and attention's constants have none), the key biases' within rounding noise. Measured
    worst error of the others, opsets 18/23: ViT 3.3e-7/3.8e-7, Swin 5.5e-7/5.6e-7, ResNet
    2.0e-6 (a BatchNorm weight, both), UNet2D 5.5e-6/5.6e-6 (a downsampling conv bias)."""
    errors = _check_against_torch(case.module, case.inputs, list(case.input_names), plain)
    assert len(errors) == len({id(p) for p in case.module.parameters()})
    noise = {n: errors.pop(n) for n in list(errors) if any(fnmatch.fnmatchcase(n, p) for p in ZERO_GRADIENTS)}
    assert max(noise.values(), default=0.0) <= ZERO_TOL, noise
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= GRAD_TOL, f"{case.name}: {worst} {errors[worst]:.2e}"


def _check_refusal(case: models.Case, optimized: onnx.ModelProto, first: str) -> None:
    """The default export is refused in one line that names the first folded parameter."""
    with pytest.raises(UnsupportedModelError) as info:
        build_training_graph(optimized, optimizer=None)
    message = str(info.value)
    assert "\n" not in message and "optimize=False" in message and "mpgraph export" in message
    assert f"(first: '{first}'" in message and first in dict(case.module.named_parameters())


def _check_adamw_step(case: models.Case, plain: onnx.ModelProto) -> None:
    """The AdamW step in an ORT CPU session with its default graph optimizations: its loss is
    torch's loss in train mode, and the running statistics it outputs are those torch's
    BatchNorm stores after the same forward (ResNet: torch updates the running variance with
    the unbiased batch variance, ONNX with the biased one; before rule 5 the step was off by
    up to 6e-3)."""
    step = build_training_graph(plain, optimizer="adamw")
    outs = run_named(step, _feeds(case))
    module = copy.deepcopy(case.module)
    with torch.no_grad():
        loss = float(module(*case.inputs))
    assert abs(float(outs[step.graph.outputs[0].name]) - loss) <= 1e-5 * max(1.0, abs(loss))
    buffers = {n: b.numpy() for n, b in module.named_buffers() if "running_" in n}
    assert len(buffers) == (16 if case.name == "resnet" else 0)
    for buffer, expected in buffers.items():
        got = outs[f"{buffer}/updated"]
        assert np.linalg.norm(got - expected) <= 1e-6 * np.linalg.norm(expected), buffer


def test_windowed_swin_trains_with_default_optimizations() -> None:
    """A Swin written as timm writes it (channels last, ``torch.roll``, windows and patch
    merging by reshape and permute; ``models.windowed_swin``), the model whose step graph met
    ONNX Runtime's Pad bug below (``Gather node 'Gather_token_73': indices element out of data
    bounds``): at opset 18 without the optimizer, every parameter's gradient (worst 3.9e-7)
    and the AdamW step's loss match torch, in default ORT sessions."""
    case = _case("windowed_swin")
    plain, _ = _exports("windowed_swin", 18)
    errors = _check_against_torch(case.module, case.inputs, list(case.input_names), plain)
    assert len(errors) == len(list(case.module.parameters())) and max(errors.values()) <= GRAD_TOL
    step = build_training_graph(plain, optimizer="adamw")
    with torch.no_grad():
        loss = float(case.module(*case.inputs))
    assert abs(float(run_named(step, _feeds(case))[step.graph.outputs[0].name]) - loss) <= 1e-5 * loss


class _BatchStatisticsNet(torch.nn.Module):
    """A BatchNorm without running statistics (``track_running_stats=False``): batch
    statistics in train and eval mode alike."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)  # a bias here would get no gradient at all
        self.bn = torch.nn.BatchNorm2d(4, track_running_stats=False)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3))).pow(2).mean()


def test_batchnorm_without_running_statistics_trains() -> None:
    """The exporter writes it as ReduceMeans feeding an eval-form BatchNormalization: it stays
    in that form (no state), and the gradient flows through the computed mean and variance.
    It was refused ("its running mean 'val_1' is computed"), and with ``--batchnorm eval`` the
    conv weight gradient was off by 2.0 times its norm (the rule gave the statistics none)."""
    torch.manual_seed(0)
    module, x = _BatchStatisticsNet().train(), torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = torch.onnx.export(copy.deepcopy(module), (x,), dynamo=True, optimize=False, input_names=["x"],
                                  verbose=False).model_proto
    errors = _check_against_torch(module, (x,), ["x"], plain)
    assert len(errors) == 5 and max(errors.values()) <= GRAD_TOL, errors
    step = build_training_graph(plain, optimizer="adamw")
    assert not [n for n in step.graph if n.op_type == "BatchNormalization" and n.attributes.get_int("training_mode", 0)]


def test_ort_batchnorm_training_writes_into_its_running_variance_input() -> None:
    """ONNX Runtime 1.32's CPU ``BatchNormalization(training_mode=1)``, when its updated running
    variance is not a graph output, writes it into the buffer of its running-variance input:
    the caller's numpy feed changes, and a node that reads that input after the
    BatchNormalization ran (here ``late = var + (new_mean - new_mean)``) reads the update
    instead of the input. With every graph optimization off too. mpgraph gives the node its own
    copy of the running variance (``SetBatchNormModePass`` rule 5). When this test fails, ONNX
    Runtime stopped doing it and the copy can go."""
    f = onnx.TensorProto.FLOAT
    nodes = [h.make_node("BatchNormalization", ["x", "s", "b", "mean", "var"], ["y", "new_mean", "new_var"],
                         training_mode=1, momentum=0.9),
             h.make_node("Add", ["new_var", "zero"], ["var_out"]),
             h.make_node("Sub", ["new_mean", "new_mean"], ["after"]),
             h.make_node("Add", ["var", "after"], ["late"])]
    inputs = [h.make_tensor_value_info(n, f, shape) for n, shape in (("x", [2, 3, 4, 4]), ("mean", [3]), ("var", [3]))]
    outputs = [h.make_tensor_value_info(n, f, None) for n in ("y", "new_mean", "var_out", "late")]
    inits = [h.make_tensor("s", f, [3], [1.0] * 3), h.make_tensor("b", f, [3], [0.0] * 3), h.make_tensor("zero", f, [], [0.0])]
    model = h.make_model(h.make_graph(nodes, "bn", inputs, outputs, inits), opset_imports=[h.make_opsetid("", 18)], ir_version=8)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    var = np.ones(3, np.float32)
    _, _, new_var, late = session.run(None, {"x": x, "mean": np.zeros(3, np.float32), "var": var})
    np.testing.assert_allclose(new_var, 0.9 + 0.1 * x.var(axis=(0, 2, 3)), rtol=1e-6)  # the ONNX update
    assert not np.allclose(new_var, 1.0)
    np.testing.assert_array_equal(var, new_var)  # ... written into the caller's feed
    np.testing.assert_array_equal(late, new_var)  # ... and read as the input: should be 1


def _transpose_pad_transpose() -> onnx.ModelProto:
    nodes = [h.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             h.make_node("Pad", ["t", "pads", "", "axes"], ["p"]),
             h.make_node("Transpose", ["p"], ["y"], perm=[0, 3, 1, 2])]
    inits = [onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"),
             onnx.numpy_helper.from_array(np.array([1, 2], np.int64), "pads")]
    graph = h.make_graph(nodes, "pad", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 5])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8)


def test_ort_transpose_optimizer_breaks_a_pad_with_axes() -> None:
    """ONNX Runtime 1.32's transpose optimizer (in its basic level, so in every default
    session) moves the Transposes around ``Pad(pads, axes)`` as if ``pads`` covered every axis:
    it permutes the two pads of axis 1 with a Gather over eight positions, which fails. This
    is how a timm-style Swin's step graph failed (``Gather node 'Gather_token_146': indices
    element out of data bounds, idx=2 must be within the inclusive range [-2,1]``): Slice's
    gradient was a Pad with ``axes``. mpgraph's gradients write pads for every axis
    (``mpgraph.autodiff.rules.shape.full_pads``). When this test fails, ONNX Runtime handles
    ``axes`` and the workaround can go."""
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    model = _transpose_pad_transpose().SerializeToString()
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    expected = np.pad(x, [(0, 0), (0, 0), (1, 2), (0, 0)])
    np.testing.assert_array_equal(ort.InferenceSession(model, plain, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0], expected)
    default = ort.SessionOptions()
    default.log_severity_level = 4
    with pytest.raises(Exception, match=r"Gather.*indices element out of data bounds"):
        ort.InferenceSession(model, default, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_slice_and_strided_conv_gradients_pad_every_axis() -> None:
    """The same pattern in a backward pass: Slice's gradient between two Transposes, and a
    stride-2 Conv over runtime-sized images, whose input gradient (a ConvTranspose) misses a
    row and a column that a Pad adds. The step graph's Pads have no ``axes`` and it runs with
    ORT's default optimizations, with torch's gradients. (Before: the Gather error above.)"""
    f = onnx.TensorProto.FLOAT
    nodes = [h.make_node("Mul", ["x", "a"], ["xa"]),
             h.make_node("Conv", ["xa", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             h.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]),
             h.make_node("Slice", ["t", "starts", "ends", "axes"], ["s"]),
             h.make_node("Transpose", ["s"], ["u"], perm=[0, 3, 1, 2]),
             h.make_node("Mul", ["u", "u"], ["sq"]),
             h.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((1, 3, 1, 1)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(v, n) for n, v in (
        ("a", a), ("w", w), ("starts", np.array([1], np.int64)), ("ends", np.array([3], np.int64)), ("axes", np.array([1], np.int64)))]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", f, [2, 3, "H", "W"])], [h.make_tensor_value_info("loss", f, [])], inits)
    forward = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8)
    step = build_training_graph(forward, optimizer=None, params=["a", "w"])
    pads = [n for n in step.graph if n.op_type == "Pad"]
    assert len(pads) == 2 and not [n.name for n in pads if len(n.inputs) > 3 and n.inputs[3] is not None]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    got = run_named(step, {"x": x})
    at, wt = (torch.from_numpy(v).double().requires_grad_() for v in (a, w))
    c = torch.nn.functional.conv2d(torch.from_numpy(x).double() * at, wt, stride=2, padding=1)
    (c[:, :, 1:3, :] ** 2).sum().backward()
    for name, tensor in (("a", at), ("w", wt)):
        np.testing.assert_allclose(got[f"grad/{name}"], tensor.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
