"""CanonicalizeOpsPass: attention, GELU and norms from both torch exporters as the standard ops.

Tiny HF models (``tests/corpus/models.py``; GPT-2 with two layers) exported by the TorchScript
exporter (``dynamo=False``) and the dynamo exporter (``optimize=False``) with eager attention,
and by the dynamo exporter at opset 23 with HF's default attention (ONNX ``Attention``). After
the pass every attention, GELU and norm site is the standard op (counted), the forward loss
equals the original's within 1e-5 on ORT CPU, the step graph built with ``canonicalize=True``
gives every parameter torch.autograd's gradient within 1e-4 (``test_dynamo_params``'s check),
and the eager and the ``Attention`` exports of one model give the same canonical op sequence.
Hand-written modules cover the forms the HF models do not write (a decomposed LayerNorm, a
boolean ``masked_fill`` mask, ``F.gelu(approximate="tanh")``).

Cost: about 30 CPU-s (28.6 user + 1.4 sys, --runslow, one process, OMP_NUM_THREADS=1), most of
it the 15 exports, each made once for the file.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper as h

from mpgraph.training import build_training_graph, fold_constant_subgraphs
from mpgraph.training.attach_loss import find_logits
from mpgraph.training.canonical_attention import static_dims
from mpgraph.training.canonicalize_ops import CanonicalizeOpsPass
from mpgraph.training.normalize_forward import NormalizeForwardPass, load_forward
from tests.helpers import init, make_model, mpgraph_cli, vi

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests import test_dynamo_params  # noqa: E402 - needs torch
from tests.corpus import models  # noqa: E402 - needs torch

pytestmark = pytest.mark.slow

CANONICAL = ("Attention", "Gelu", "LayerNormalization", "RMSNormalization", "RotaryEmbedding")
#: Ops that may not remain after the pass in these models (their sites are all recognised).
WRITTEN_OUT = ("Softmax", "Erf", "Pow", "ReduceMean", "Sqrt")
FORWARD_TOL = 1e-5
GRAD_TOL = 1e-4


def _gpt2_two_layers() -> models.Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=models.VOCAB, n_positions=models.SEQ * 2, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = models._tokens(1)
    return models._hf("gpt2", GPT2LMHeadModel(cfg), input_ids=ids, labels=ids)


def _case(name: str, attention: str) -> models.Case:
    case = _gpt2_two_layers() if name == "gpt2" else models.build(name)
    case.module.model.set_attn_implementation(attention)
    return case


def _export(module: torch.nn.Module, args: tuple, names: list[str], how: str) -> onnx.ModelProto:
    module = copy.deepcopy(module).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "torchscript":
            buffer = io.BytesIO()
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=18, do_constant_folding=False,
                              input_names=names)
            return onnx.load_from_string(buffer.getvalue())
        opset = 23 if how == "dynamo23" else 18
        return torch.onnx.export(module, args, dynamo=True, opset_version=opset, optimize=False,
                                 input_names=names, verbose=False).model_proto


def _canonical_forward(proto: onnx.ModelProto) -> tuple[ir.Model, CanonicalizeOpsPass]:
    forward = load_forward(proto)
    NormalizeForwardPass(forward.inputs_mark_params)(forward.model)
    canonicalize = CanonicalizeOpsPass()
    canonicalize(forward.model)
    return forward.model, canonicalize


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _sequence(model: ir.Model) -> list[tuple]:
    """The canonical ops in graph order, with what decides their math besides the tensors."""
    out = []
    for node in model.graph:
        if node.op_type not in CANONICAL:
            continue
        attrs = {k: a.value for k, a in node.attributes.items() if k in ("is_causal", "approximate")}
        if node.op_type == "Attention":
            attrs["scale"] = round(float(node.attributes["scale"].value), 6)
            attrs["masked"] = len(node.inputs) > 3 and node.inputs[3] is not None
            attrs["kv_heads"] = node.inputs[1].shape[1]
        out.append((node.op_type, tuple(sorted(attrs.items()))))
    return out


#: (model, exporter, attention): expected canonical op counts after the pass.
CASES = {
    ("gpt2", "torchscript", "eager"): {"Attention": 2, "Gelu": 2, "LayerNormalization": 5},
    ("gpt2", "dynamo18", "eager"): {"Attention": 2, "Gelu": 2, "LayerNormalization": 5},
    ("gpt2", "dynamo23", "sdpa"): {"Attention": 2, "Gelu": 2, "LayerNormalization": 5},
    ("llama", "torchscript", "eager"): {"Attention": 1, "RMSNormalization": 3, "RotaryEmbedding": 2},
    ("llama", "dynamo18", "eager"): {"Attention": 1, "RMSNormalization": 3, "RotaryEmbedding": 2},
    ("llama", "dynamo23", "sdpa"): {"Attention": 1, "RMSNormalization": 3, "RotaryEmbedding": 2},
    ("bert", "torchscript", "eager"): {"Attention": 1, "Gelu": 1, "LayerNormalization": 3},
    # HF's default attention below opset 23: torch's SDPA decomposition (sqrt(scale) on Q and
    # K, Where(IsNaN(p), 0, p)) from the dynamo exporter, torch's symbolic from TorchScript.
    ("bert", "dynamo18", "sdpa"): {"Attention": 1, "Gelu": 1, "LayerNormalization": 3},
    ("vit", "torchscript", "sdpa"): {"Attention": 1, "Gelu": 1, "LayerNormalization": 3},
    # T5 adds its position bias (trained: its gradient flows through the mask) and then the
    # causal or padding mask; no scale.
    ("t5", "dynamo18", "eager"): {"Attention": 3, "RMSNormalization": 7},
    # torch's SDPA symbolic with is_causal: a Trilu mask computed from the scores' shape.
    ("gpt2", "torchscript", "sdpa"): {"Attention": 2, "Gelu": 2, "LayerNormalization": 5},
    ("distilbert", "dynamo18", "eager"): {"Attention": 1, "Gelu": 1, "LayerNormalization": 3},
    ("vit", "torchscript", "eager"): {"Attention": 1, "Gelu": 1, "LayerNormalization": 3},
}


@functools.cache
def _exported(name: str, how: str, attention: str) -> tuple[models.Case, onnx.ModelProto]:
    """One export per case for the whole file (the exports are most of its cost)."""
    case = _case(name, attention)
    return case, _export(case.module, case.inputs, list(case.input_names), how)


@pytest.fixture(scope="module", params=list(CASES), ids=lambda p: "-".join(p))
def exported(request: pytest.FixtureRequest):
    case, proto = _exported(*request.param)
    model, canonicalize = _canonical_forward(proto)
    return request.param, case, proto, model, canonicalize


def test_every_site_is_the_standard_op(exported) -> None:
    key, _, _, model, canonicalize = exported
    counts = {op: sum(n.op_type == op for n in model.graph) for op in CANONICAL}
    assert {op: n for op, n in counts.items() if n} == CASES[key]
    left = [n.op_type for n in model.graph if n.op_type in WRITTEN_OUT]
    assert not left, f"{key}: written-out ops left: {left}"
    assert model.graph.opset_imports[""] == 23
    assert canonicalize.counts["RMSNormalization"] == CASES[key].get("RMSNormalization", 0)
    before = [(n.op_type, n.name) for n in model.graph]
    assert not CanonicalizeOpsPass()(model).modified  # idempotent
    assert [(n.op_type, n.name) for n in model.graph] == before


def test_forward_is_unchanged(exported) -> None:
    """The loss and the logits on ORT CPU, original against canonical. Measured: equal bit
    for bit but Llama's logits (7.5e-9 apart, on values up to 0.36)."""
    _, case, proto, model, _ = exported
    feeds = {n: a.numpy() for n, a in zip(case.input_names, case.inputs, strict=True)}
    logits = find_logits(model.graph)
    assert logits is not None
    original, canonical = onnx.shape_inference.infer_shapes(proto), ir.to_proto(model)
    for graph in (original.graph, canonical.graph):
        graph.output.append(onnx.ValueInfoProto(name=logits))
    (loss_before, logits_before), (loss_after, logits_after) = _run(original, feeds), _run(canonical, feeds)
    assert abs(float(loss_after) - float(loss_before)) <= FORWARD_TOL * max(1.0, abs(float(loss_before)))
    np.testing.assert_allclose(logits_after, logits_before, rtol=0, atol=FORWARD_TOL)


def test_step_gradients_match_torch(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_dynamo_params._check_against_torch`` on the step built with ``canonicalize=True``;
    the step graph differentiates the standard ops (counted). Measured worst: 4.1e-7 (GPT-2;
    3.4e-7 from TorchScript's SDPA, its computed mask read as is_causal),
    3.9e-7 (Llama), 5.4e-7 (T5), 1.3e-6 (BERT), 2.8e-7 (DistilBERT), 4.5e-5 (ViT with torch's SDPA
    symbolic; eager 3.0e-5, 3.5e-5 without the pass: its key bias, whose gradient is zero but
    for rounding)."""
    key, case, proto, _, _ = exported
    steps: list[ir.Model] = []

    def build(*args, **kwargs):
        steps.append(build_training_graph(*args, canonicalize=True, **kwargs))
        return steps[-1]

    monkeypatch.setattr(test_dynamo_params, "build_training_graph", build)
    errors = test_dynamo_params._check_against_torch(case.module, case.inputs, list(case.input_names), proto)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= GRAD_TOL, f"{key}: {worst} {errors[worst]:.2e}"
    forward_ops = [n.op_type for n in steps[0].graph if n.metadata_props.get("mpgraph.role") == "forward"]
    for op, count in CASES[key].items():
        assert forward_ops.count(op) == count, f"{key}: {op}"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_eager_and_attention_exports_agree(name: str) -> None:
    """The eager exports and the opset-23 ``Attention`` export give one canonical sequence
    (causal, no mask, GQA's shared heads read directly); for GPT-2 TorchScript's SDPA too (its
    causal mask computed from shapes; TorchScript refuses SDPA with GQA)."""
    exports = [("dynamo18", "eager"), ("torchscript", "eager"), ("dynamo23", "sdpa")]
    exports += [("torchscript", "sdpa")] if name == "gpt2" else []
    sequences = [_sequence(_canonical_forward(_exported(name, how, attention)[1])[0]) for how, attention in exports]
    assert all(sequence == sequences[0] for sequence in sequences[1:])
    attention = [attrs for op, attrs in sequences[0] if op == "Attention"]
    assert all(dict(a)["is_causal"] == 1 and not dict(a)["masked"] for a in attention)


@pytest.mark.parametrize(("name", "how"), [("bert", "torchscript"), ("llama", "dynamo18")])
def test_padding_mask(name: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an ``attention_mask`` input (the second row padded after 5 tokens) the mask is
    computed while the graph runs: ``Attention`` reads it (TorchScript leaves one of its dims
    symbolic; Llama's is the causal and the padding mask in one). Measured: loss equal bit for
    bit, worst gradient 8.3e-7 (BERT), 3.4e-7 (Llama)."""
    base = _case(name, "eager")
    keep = torch.ones(models.BATCH, models.SEQ, dtype=torch.long)
    keep[1, 5:] = 0
    keys = ("input_ids", "attention_mask", "labels")
    case = models.Case(name, models.LossOnly(base.module.model, keys), (base.inputs[0], keep, base.inputs[1]), keys)
    proto = _export(case.module, case.inputs, list(keys), how)
    model, canonicalize = _canonical_forward(proto)
    attention = [n for n in model.graph if n.op_type == "Attention"]
    assert canonicalize.counts["Attention"] == len(attention) == 1 and _reads(attention[0].inputs[3], "attention_mask")
    feeds = {n: a.numpy() for n, a in zip(keys, case.inputs, strict=True)}
    (before,), (after,) = _run(proto, feeds), _run(ir.to_proto(model), feeds)
    assert abs(float(after) - float(before)) <= FORWARD_TOL * abs(float(before))
    monkeypatch.setattr(test_dynamo_params, "build_training_graph",
                        functools.partial(build_training_graph, canonicalize=True))
    errors = test_dynamo_params._check_against_torch(case.module, case.inputs, list(keys), proto)
    assert max(errors.values()) <= GRAD_TOL, errors


# -- forms the HF models do not write ---------------------------------------------------------


class HandWritten(torch.nn.Module):
    """A written-out LayerNorm, a boolean ``masked_fill`` padding mask, the tanh GELU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)
        self.weight = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        centered = x - mean
        x = centered / torch.sqrt((centered * centered).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias
        q, k, v = (t.reshape(2, 5, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return torch.nn.functional.gelu(y, approximate="tanh").square().mean()


def _reads(value: ir.Value, name: str) -> bool:
    """Whether ``value`` is computed from the graph input ``name``."""
    producer = value.producer()
    if producer is None:
        return value.name == name
    return any(v is not None and _reads(v, name) for v in producer.inputs)


@pytest.mark.parametrize("how", ["torchscript", "dynamo18"])
def test_hand_written_forms(how: str) -> None:
    module = HandWritten()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    proto = _export(module, (x, keep), ["x", "keep"], how)
    model, canonicalize = _canonical_forward(proto)
    assert canonicalize.counts == {"Attention": 1, "Gelu": 1, "LayerNormalization": 1, "RMSNormalization": 0, "RotaryEmbedding": 0}
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert attention.inputs[3] is not None and _reads(attention.inputs[3], "keep")  # the boolean mask, no Where
    assert not [n for n in model.graph if n.op_type == "Where"]
    gelu = next(n for n in model.graph if n.op_type == "Gelu")
    assert gelu.attributes["approximate"].value == "tanh"
    feeds = {"x": x.numpy(), "keep": keep.numpy()}
    (before,), (after,) = _run(proto, feeds), _run(ir.to_proto(model), feeds)
    assert abs(float(after) - float(before)) <= FORWARD_TOL * abs(float(before))
    outs = test_dynamo_params.run_named(build_training_graph(proto, optimizer=None, canonicalize=True, params=["*weight", "*bias"]), feeds)
    module = copy.deepcopy(module)
    module(x, keep).backward()
    for name, p in module.named_parameters():
        got = outs[f"grad/{name}"]
        assert np.linalg.norm(got - p.grad.numpy()) <= GRAD_TOL * np.linalg.norm(p.grad.numpy()), name


class PaddingFill(torch.nn.Module):
    """``masked_fill`` with a mask that is True where a key is padding (no ``Not`` in the graph)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * 0.5
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        return (torch.softmax(scores, -1) @ v).sum()


@pytest.mark.parametrize("how", ["torchscript", "dynamo18"])
def test_padding_fill_mask_is_negated(how: str) -> None:
    """Attention reads ``Not(pad)``, expanded to the query rows first (a value the rewrite
    makes has no shape to tell it by; ORT refuses the [B, 1, 1, S] mask)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    proto = _export(PaddingFill(), (q, k, v, pad), ["q", "k", "v", "pad"], how)
    model, canonicalize = _canonical_forward(proto)
    assert canonicalize.counts["Attention"] == 1
    assert [n.op_type for n in model.graph if n.op_type in ("Expand", "Not", "Attention")] == ["Expand", "Not", "Attention"]
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "pad": pad.numpy()}
    (before,), (after,) = _run(proto, feeds), _run(ir.to_proto(model), feeds)
    assert abs(float(after) - float(before)) <= FORWARD_TOL * abs(float(before))


class ComputedMask(torch.nn.Module):
    """transformers 5.17's eager BERT mask with no ``attention_mask`` (and a causal and a
    windowed kin): a boolean from aranges, ``[1, 1, S, 1]`` for BERT's, expanded to ``[B, -1,
    S, S]`` by a size the graph computes (TorchScript writes the ``-1`` as ``Where(Equal(shape,
    -1), 1, shape)``, so shape inference leaves the dims it cannot read from the boolean
    symbolic: BERT's is ``[?, ?, S, ?]``), then ``where(mask, 0, min)`` added to the scores."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
        allowed = {"none": rows >= 0, "causal": cols <= rows, "window": (cols <= rows) & (cols >= rows - 1)}[self.kind]
        bias = torch.where(allowed[None, None].expand(b, -1, s, s), 0.0, torch.finfo(x.dtype).min)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + bias
        return (torch.softmax(scores, -1) @ v).square().mean()


@pytest.mark.parametrize(("kind", "inputs", "causal"), [("none", 3, 0), ("causal", 3, 1), ("window", 4, 0)])
def test_computed_mask_with_symbolic_dims(kind: str, inputs: int, causal: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask computed from shapes that stays computed (at BERT-base's batch 8, sequence 512 it
    is 2M elements, over the folding limit; here the limit is lowered to keep the tiny one) is
    read by its value, not its symbolic dims: all zeros goes, the causal triangle becomes
    is_causal, any other mask stays Attention's input. BERT's form (``none``) has a symbolic last
    dim, ``[?, ?, S, ?]``: read by its dims, it failed the shape check and left BERT-base's 12
    layers written out (transformers 5.17, batch 8, T 512)."""
    monkeypatch.setattr(fold_constant_subgraphs, "_FOLD_LIMIT", 16)
    module = ComputedMask(kind)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    proto = _export(module, (x,), ["x"], "torchscript")
    forward = load_forward(proto)
    NormalizeForwardPass(forward.inputs_mark_params)(forward.model)
    masked = next(n.outputs[0] for n in forward.model.graph if n.op_type == "Where" and n.outputs[0].dtype == ir.DataType.FLOAT)
    dims = static_dims(masked)
    assert None in dims and (kind != "none" or dims[-1] is None)  # the forms this test is for
    model, canonicalize = _canonical_forward(proto)
    (attention,) = [n for n in model.graph if n.op_type == "Attention"]
    assert canonicalize.counts["Attention"] == 1 and not [n for n in model.graph if n.op_type == "Softmax"]
    assert len(attention.inputs) == inputs and attention.attributes.get_int("is_causal", 0) == causal
    (before,), (after,) = _run(proto, {"x": x.numpy()}), _run(ir.to_proto(model), {"x": x.numpy()})
    assert abs(float(after) - float(before)) <= FORWARD_TOL * abs(float(before))
    outs = test_dynamo_params.run_named(build_training_graph(proto, optimizer=None, canonicalize=True,
                                                             params=["*weight", "*bias"]), {"x": x.numpy()})
    module(x).backward()
    for name, p in module.named_parameters():
        got = outs[f"grad/{name}"]
        assert np.linalg.norm(got - p.grad.numpy()) <= GRAD_TOL * np.linalg.norm(p.grad.numpy()), name


class Rotary(torch.nn.Module):
    """HF's ``apply_rotary_pos_emb`` on Q ``[B, H, S, D]`` with caches from the positions:
    ``cat(freqs, freqs)`` (``hf``), halves that differ (``uneven``), or positions read from an
    input (``input``: not known before the graph runs)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s, d = q.shape[2], q.shape[3]
        rows = positions if self.kind == "input" else torch.arange(s, dtype=torch.float32)
        freqs = rows[:, None] * (10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))[None, :]
        emb = torch.cat((freqs, 2 * freqs if self.kind == "uneven" else freqs), dim=-1)[None, None]
        half = d // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return (q * emb.cos() + rotated * emb.sin()).square().mean()


@pytest.mark.parametrize(("kind", "rotary"), [("hf", 1), ("uneven", 0), ("input", 0)])
def test_rotary_embedding(kind: str, rotary: int, caplog: pytest.LogCaptureFixture) -> None:
    """HF's form becomes ``RotaryEmbedding`` reading the caches' first halves, expanded to the
    batch; a cache whose halves differ, or one computed while the graph runs, stays written out
    (logged)."""
    q = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(5, dtype=torch.float32)
    proto = _export(Rotary(kind), (q, positions), ["q", "positions"], "torchscript")
    with caplog.at_level(logging.WARNING, logger="mpgraph.training.canonicalize_ops"):
        model, canonicalize = _canonical_forward(proto)
    assert canonicalize.counts["RotaryEmbedding"] == rotary
    assert [n.op_type for n in model.graph].count("Neg") == 1 - rotary
    assert ("1 rotary embedding (Neg of a Slice, into a Concat) left as written" in caplog.text) == (not rotary)
    names = {i.name for i in proto.graph.input}  # TorchScript drops an input nothing reads
    feeds = {n: a.numpy() for n, a in (("q", q), ("positions", positions)) if n in names}
    (before,), (after,) = _run(proto, feeds), _run(ir.to_proto(model), feeds)
    assert abs(float(after) - float(before)) <= FORWARD_TOL * abs(float(before))


# -- what is left alone -----------------------------------------------------------------------


def _softmax_model(extra: list[onnx.NodeProto] = (), opset: int = 18) -> onnx.ModelProto:
    """``Softmax(x @ w)``: a Softmax that is no attention."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["s"], name="mm"), h.make_node("Softmax", ["s"], ["y"], name="sm", axis=-1)]
    return make_model(nodes + list(extra), [vi("x", [2, 4])], [vi("y", [2, 4])],
                      [init("w", np.eye(4, dtype=np.float32))], opset=opset)


def test_unrecognised_forms_are_logged_and_left(caplog: pytest.LogCaptureFixture) -> None:
    model = ir.from_proto(_softmax_model())
    with caplog.at_level(logging.WARNING, logger="mpgraph.training.canonicalize_ops"):
        result = CanonicalizeOpsPass()(model)
    assert [n.op_type for n in model.graph] == ["MatMul", "Softmax"]
    assert not result.modified and model.graph.opset_imports[""] == 18
    assert "1 attention (Softmax) left as written, not recognised (first: node 'sm')" in caplog.text


def test_opset_is_not_raised_over_a_changed_op(caplog: pytest.LogCaptureFixture) -> None:
    """GroupNormalization changed meaning at opset 21: the graph stays at 18, and the rules
    whose op needs 23 are skipped (logged); a LayerNorm rule (opset 17) would still run."""
    group = h.make_node("GroupNormalization", ["x4", "gs", "gb"], ["g"], name="gn", num_groups=1)
    proto = _softmax_model()
    proto.graph.node.append(group)
    proto.graph.input.append(vi("x4", [2, 2, 3]))
    proto.graph.initializer.extend([init("gs", np.ones(1, np.float32)), init("gb", np.zeros(1, np.float32))])
    proto.graph.output.append(vi("g", [2, 2, 3]))
    model = ir.from_proto(proto)
    with caplog.at_level(logging.INFO, logger="mpgraph.training.canonicalize_ops"):
        CanonicalizeOpsPass()(model)
    assert model.graph.opset_imports[""] == 18
    assert "GroupNormalization changed meaning" in caplog.text and "Attention forms are left" in caplog.text


def _rms_norm_model(dropout: bool) -> onnx.ModelProto:
    """``scale * x / sqrt(mean(x^2) + eps)`` written out, a train-mode Dropout after it if asked."""
    n = h.make_node
    nodes = [n("Pow", ["x", "two"], ["sq"]), n("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             n("Add", ["ms", "eps"], ["var"]), n("Sqrt", ["var"], ["root"]), n("Reciprocal", ["root"], ["inv"]),
             n("Mul", ["x", "inv"], ["xn"]), n("Mul", ["xn", "scale"], ["y"])]
    if dropout:
        nodes.append(n("Dropout", ["y", "ratio", "train"], ["yd"], name="drop"))
    nodes += [n("MatMul", ["yd" if dropout else "y", "w"], ["z"]), n("Mul", ["z", "z"], ["zz"]),
              n("ReduceMean", ["zz"], ["loss"], keepdims=0)]
    inits = [init("two", np.float32(2.0)), init("axes", np.array([-1], np.int64)), init("eps", np.float32(1e-6)),
             init("scale", np.linspace(0.5, 1.5, 8, dtype=np.float32)), init("w", np.ones((8, 3), np.float32)),
             init("ratio", np.float32(0.1)), init("train", np.array(True))]
    return make_model(nodes, [vi("x", [2, 4, 8])], [vi("loss", [])], inits)


def test_default_keeps_a_norm_whose_opset_costs_dropout_its_cuda_kernel(caplog: pytest.LogCaptureFixture) -> None:
    """RMSNormalization needs opset 23, where ORT 1.31.1 CUDA has no Dropout kernel: by default
    (target unknown or cuda) the norm stays written out at opset 18 and one line says why."""
    for target in (None, "cuda"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mpgraph.training.canonicalize_ops"):
            step = build_training_graph(_rms_norm_model(dropout=True), target=target)
        ops = [node.op_type for node in step.graph]
        assert "RMSNormalization" not in ops and "Dropout" in ops and step.opset_imports[""] == 18
        kept = [r.getMessage() for r in caplog.records if "kept written out" in r.getMessage()]
        assert len(kept) == 1 and "1 RMSNormalization form(s)" in kept[0] and "runs Dropout" in kept[0], kept
        assert "a norm (ReduceMean) left as written" not in caplog.text


@pytest.mark.parametrize("dropout, options", [(False, {}), (True, {"target": "cpu"}), (True, {"canonicalize": True})])
def test_norm_is_rewritten_where_no_kernel_is_lost(dropout: bool, options: dict) -> None:
    """Without a Dropout, on the CPU (ORT CPU runs Dropout at 23) or when asked, it is rewritten."""
    step = build_training_graph(_rms_norm_model(dropout), **options)
    assert "RMSNormalization" in [node.op_type for node in step.graph] and step.opset_imports[""] == 23


def test_cli_flag(tmp_path) -> None:
    """``train-graph --canonical-ops`` writes the standard ops into the step graph."""
    module = HandWritten()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 5, dtype=torch.bool)
    path = tmp_path / "hand.onnx"
    onnx.save(_export(module, (x, keep), ["x", "keep"], "dynamo18"), path)
    result = mpgraph_cli("train-graph", str(path), "--canonical-ops", "--params", "*weight", "--params", "*bias",
                         "-o", str(tmp_path / "step.onnx"))
    assert result.returncode == 0, result.stdout + result.stderr
    ops = {n.op_type for n in onnx.load(tmp_path / "step.onnx").graph.node}
    assert {"Attention", "Gelu", "LayerNormalization"} <= ops and "Softmax" in ops  # Softmax: the backward's


