"""Parameters of graphs from torch's dynamo exporter: which values train, what its optimizer did.

``torch.onnx.export(module, args, dynamo=True)`` with ``optimize=False`` keeps every torch
parameter as an initializer named by its module path and marks buffers and constants as such;
the step graph must train exactly the parameters, each with its own gradient (within 1e-4 of
torch.autograd, relative to its norm, or to 1e-6 of the largest one's for a gradient that is
zero but for rounding). With the exporter's default ``optimize=True``, merged parameters are
untied where the graph shows whose each input was, and a graph where parameters were folded
into constants is refused with one line that gives the recipe.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper as h

from mpgraph.errors import GradientError, UnsupportedModelError
from mpgraph.training import build_training_graph
from mpgraph.training.normalize_forward import NormalizeForwardPass
from mpgraph.training.untie_exported_parameters import (
    TORCH_INPUT_KIND,
    TORCH_SIGNATURE,
    UntieExportedParametersPass,
)
from tests.helpers import init, make_model, mpgraph_cli, run_named, vi

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.corpus import models  # noqa: E402 - needs torch

GRAD_TOL = 1e-4
GRAD_FLOOR = 1e-6


def _export(module: torch.nn.Module, args: tuple, names: list[str]) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The dynamo export without its optimizer, then the same program optimized (what
    ``optimize=True``, the default, runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(copy.deepcopy(module).eval(), args, dynamo=True, opset_version=18,
                                    optimize=False, input_names=names, verbose=False)
        plain = program.model_proto
        program.optimize()
    return plain, program.model_proto


def _check_against_torch(module: torch.nn.Module, args: tuple, names: list[str], proto: onnx.ModelProto) -> dict[str, float]:
    """Every torch parameter's gradient error; fails if the step trains anything else.

    A tied parameter (GPT-2's ``wte`` and ``lm_head``) is one tensor under several names: the
    graph has it once, under one of them."""
    outs = run_named(build_training_graph(proto, optimizer=None), {n: a.numpy() for n, a in zip(names, args, strict=True)})
    module = copy.deepcopy(module).train()
    module(*args).backward()
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        tensors.setdefault(id(p), (p, []))[1].append(name)
    trained = {o.removeprefix("grad/") for o in outs if o.startswith("grad/")}
    assert trained <= {n for _, ns in tensors.values() for n in ns}, f"not torch parameters: {trained}"
    top = max(float(p.grad.norm()) for p, _ in tensors.values() if p.grad is not None)
    errors = {}
    for p, aliases in tensors.values():
        got = [outs[f"grad/{n}"] for n in aliases if n in trained]
        assert len(got) == 1, f"{aliases}: {len(got)} gradients"
        # No torch gradient (a parameter the loss does not reach): the graph's must be zero.
        expected = p.grad.numpy().astype(np.float64) if p.grad is not None else np.zeros(p.shape)
        errors[aliases[0]] = float(np.linalg.norm(got[0] - expected) / max(np.linalg.norm(expected), GRAD_FLOOR * top))
    return errors


# GPT-2 and DistilBERT as the corpus builds them (HF's default attention) are exported the
# same way in tests/test_dynamo_text.py, with the other text models, at opsets 18 and 23.
@pytest.fixture(scope="module", params=["qwen2"])
def exported(request: pytest.FixtureRequest):
    case = getattr(models, request.param)()
    return case, *_export(case.module, case.inputs, list(case.input_names))


@pytest.mark.slow
def test_unoptimized_export_trains_every_parameter_alone(exported) -> None:
    """Qwen2 with eager attention (rotary ``inv_freq`` buffer and caches, GQA written out with
    ``repeat_kv``, q/k/v biases): every parameter has its own gradient, no buffer or constant
    has one. Measured: worst 7e-7."""
    case, plain, _ = exported
    errors = _check_against_torch(case.module, case.inputs, list(case.input_names), plain)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= GRAD_TOL, f"{case.name}: {worst} {errors[worst]:.2e}"


@pytest.mark.slow
def test_optimized_export_trains_every_parameter_alone(exported) -> None:
    """The default export pre-transposes every ``nn.Linear`` weight into a ``val_*`` constant
    and drops the weight; ``UntieExportedParametersPass`` rule 0 rebuilds each as
    ``Transpose(weight)`` and unties the merged biases and norm weights, so every parameter
    has its own gradient, as in the plain export."""
    case, _, optimized = exported
    errors = _check_against_torch(case.module, case.inputs, list(case.input_names), optimized)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= GRAD_TOL, f"{case.name}: {worst} {errors[worst]:.2e}"


# -- a module whose parameters the optimizer merges but does not fold ------------------------


class TwoNorms(torch.nn.Module):
    """Two fresh LayerNorms (equal weights, equal zero biases), a zero bias added by hand (the
    same value again), a matrix used as is (not transposed, so not folded) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(8)
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.b = torch.nn.Parameter(torch.zeros(8))
        self.norm2 = torch.nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x) @ self.w + self.b
        return (self.norm2(torch.tanh(h)) * self.scale * h).mean()


@pytest.fixture(scope="module")
def two_norms():
    torch.manual_seed(0)
    module, x = TwoNorms(), torch.randn(4, 8)
    return module, (x,), *_export(module, (x,), ["x"])


def test_merged_parameters_are_untied(two_norms) -> None:
    """``b``, ``norm1.bias`` and ``norm2.bias`` became one initializer, ``norm1.weight`` and
    ``norm2.weight`` another; each FX node names the parameters it read, so each comes back
    with its own gradient. The buffer is not trained."""
    module, args, _, optimized = two_norms
    graph = ir.from_proto(optimized).graph
    assert {"norm2.weight", "norm2.bias", "norm1.bias"}.isdisjoint(graph.initializers), "nothing merged: test is moot"
    errors = _check_against_torch(module, args, ["x"], optimized)
    assert set(errors) == {"norm1.weight", "norm1.bias", "w", "b", "norm2.weight", "norm2.bias"}
    assert max(errors.values()) <= GRAD_TOL


def test_buffers_are_not_trained_and_params_patterns_choose(two_norms) -> None:
    """Without marks, the exporter's roles decide; ``params`` patterns name the parameters
    instead (nothing inferred), and ``freeze`` removes from them."""
    _, _, plain, _ = two_norms
    default = build_training_graph(plain, optimizer=None)
    grads = {o.name for o in default.graph.outputs if o.name.startswith("grad/")}
    assert "grad/scale" not in grads and len(grads) == 6
    chosen = build_training_graph(plain, optimizer=None, params=["norm*", "scale"], freeze=["norm1.*"])
    assert sorted(o.name for o in chosen.graph.outputs[1:]) == ["grad/norm2.bias", "grad/norm2.weight", "grad/scale"]
    with pytest.raises(GradientError, match="params pattern 'nope' matches no float initializer"):
        build_training_graph(plain, optimizer=None, params=["nope"])


def test_cli_refuses_an_optimized_export(two_norms, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """What a user sees: exit 2, one line, nothing written, unless ``--params`` names what
    trains; ``--params`` on a plain export."""
    module, _, plain, optimized = two_norms
    model = ir.from_proto(optimized)
    # Fold one parameter into a constant that is not its transpose (which rule 0 would rebuild).
    model.graph.initializers["val_9"] = folded = ir.Value(
        name="val_9", const_value=ir.tensor(2 * model.graph.initializers["w"].const_value.numpy().T, name="val_9"))
    folded.metadata_props["pkg.onnxscript.optimizer.folded_from"] = "['w']"
    onnx.save(ir.to_proto(model), tmp_path / "opt.onnx")
    bad = mpgraph_cli("train-graph", str(tmp_path / "opt.onnx"), "-o", str(tmp_path / "x.onnx"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "folded or merged 1 torch parameters" in bad.stderr and "(first: 'w', folded into 'val_9')" in bad.stderr
    assert not (tmp_path / "x.onnx").exists()
    # Naming the parameters takes the graph as it is: 'w' stays folded, and a warning says so.
    with caplog.at_level("WARNING", logger="mpgraph.training"):
        chosen = mpgraph_cli("train-graph", str(tmp_path / "opt.onnx"), "-o", str(tmp_path / "n.onnx"), "--params", "norm*")
    assert chosen.returncode == 0, chosen.stderr
    assert any("folded or merged 1 torch parameters" in r.getMessage() for r in caplog.records)
    onnx.save(plain, tmp_path / "plain.onnx")
    ok = mpgraph_cli("train-graph", str(tmp_path / "plain.onnx"), "-o", str(tmp_path / "s.onnx"), "--params", "norm2.*")
    assert ok.returncode == 0, ok.stderr
    state = {i.name for i in onnx.load(tmp_path / "s.onnx").graph.input}
    assert {"norm2.weight", "norm2.bias"} <= state and not {"w", "b", "scale"} & state


# -- the rules on hand-made graphs -----------------------------------------------------------


def _signed(nodes, fx: dict[str, str], params: dict[str, np.ndarray], signature: list[str]) -> ir.Model:
    """A graph shaped like a dynamo export: a signature, roles on initializers, FX nodes."""
    inits = [init(n, a) for n, a in params.items()]
    model = ir.from_proto(make_model(nodes, [vi("x", [4])], [vi("y", [4])], inits))
    model.graph.metadata_props[TORCH_SIGNATURE] = "\n".join(
        f"p_{t.replace('.', '_')}: PARAMETER target='{t}'" for t in signature)
    for value in model.graph.initializers.values():
        value.metadata_props[TORCH_INPUT_KIND] = "PARAMETER"
    for node in model.graph:
        node.metadata_props["pkg.torch.onnx.fx_node"] = fx[node.name]
    return model


def test_merged_inputs_of_one_node_that_cannot_be_told_apart_are_refused() -> None:
    """``Add(a.weight, a.weight)`` where the FX node read ``p.w`` and ``q.w``: both equal
    values, same last name part, no way to know which input was which."""
    one = np.ones(4, np.float32)
    nodes = [h.make_node("Add", ["a.weight", "a.weight"], ["s"], name="add"), h.make_node("Mul", ["x", "s"], ["y"], name="mul")]
    fx = {"add": "%add = call_function[target=aten.add](args = (%p_p_w, %p_q_w))", "mul": "%mul = aten.mul(%x, %add)"}
    model = _signed(nodes, fx, {"a.weight": one}, ["a.weight", "p.w", "q.w"])
    with pytest.raises(UnsupportedModelError, match=r"merged 2 torch parameters .*first: 'p\.w', merged at node 'add' with no way"):
        UntieExportedParametersPass()(model)


def test_a_tied_or_unused_parameter_is_no_loss() -> None:
    """torch.export gives a tied parameter one placeholder: its other name (``wte``) is in the
    signature, in no FX node and no folded value. Nothing changes."""
    nodes = [h.make_node("Mul", ["x", "lm_head.weight"], ["y"], name="mul")]
    model = _signed(nodes, {"mul": "%mul = aten.mul(%x, %p_lm_head_weight)"},
                    {"lm_head.weight": np.ones(4, np.float32)}, ["wte.weight", "lm_head.weight"])
    assert not UntieExportedParametersPass()(model).modified


@pytest.mark.parametrize(("split", "keepdims", "positions", "sizes"), [
    (np.int64(4), 1, [0, 2, -2], [4, 4, 2]),  # a scalar split: the last piece is the rest
    (np.array([3, 7], np.int64), 1, [1, 0], [3, 7]),
    (None, 0, [5, 0], [1] * 10),  # no split, keepdims=0: pieces of one, squeezed
])
def test_split_to_sequence_with_constant_positions_becomes_split(split, keepdims, positions, sizes) -> None:
    """The dynamo exporter's ``torch.split`` without its optimizer (GPT-2's q/k/v): the same
    pieces from one ``Split``, checked in ONNX Runtime against the original."""
    x = np.arange(20, dtype=np.float32).reshape(2, 10)
    inits = [init(f"i{k}", np.int64(p)) for k, p in enumerate(positions)] + ([init("split", split)] if split is not None else [])
    nodes = [h.make_node("SplitToSequence", ["x", "split"] if split is not None else ["x"], ["seq"], axis=1, keepdims=keepdims)]
    nodes += [h.make_node("SequenceAt", ["seq", f"i{k}"], [f"y{k}"]) for k in range(len(positions))]
    outputs = [h.make_tensor_value_info(f"y{k}", onnx.TensorProto.FLOAT, None) for k in range(len(positions))]
    proto = make_model(nodes, [vi("x", [2, 10])], outputs, inits)
    model = ir.from_proto(proto)
    NormalizeForwardPass(inputs_mark_params=True)(model)
    assert [n.op_type for n in model.graph if n.op_type != "Constant"] == ["Split"] + ["Squeeze"] * (len(sizes) if keepdims == 0 else 0)
    assert [v.name for v in model.graph.outputs] == [f"y{k}" for k in range(len(positions))]
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
           for m in (proto, ir.to_proto(model))]
    for before, after in zip(*run, strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("x_shape", [(2, 3, 5, 8), (2, 5, 24)], ids=["4d", "3d"])
def test_rotary_caches_of_one_row_are_expanded_to_the_batch(x_shape) -> None:
    """``RotaryEmbedding`` without ``position_ids`` reading ``(1, S, d)`` caches, as HF
    computes ``cos``/``sin`` for one row of positions: ONNX Runtime refuses them ("expected to
    have the same shape as input 'x', got 1 and 5", CPU and CUDA). The step graph reads them
    expanded to the batch, and its gradient equals that of the model given ``(B, S, d)``
    caches."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(x_shape).astype(np.float32)
    angles = rng.standard_normal((1, 5, 4)).astype(np.float32)
    attrs = {"num_heads": 3} if len(x_shape) == 3 else {}

    def forward(cos: np.ndarray, sin: np.ndarray) -> onnx.ModelProto:
        nodes = [h.make_node("Mul", ["x", "w"], ["h"], name="scale"),
                 h.make_node("RotaryEmbedding", ["h", "cos", "sin"], ["y"], name="rope", **attrs),
                 h.make_node("Mul", ["y", "y"], ["sq"], name="square"),
                 h.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0)]
        inits = [init("w", w), init("cos", cos), init("sin", sin)]
        return make_model(nodes, [vi("x", list(x_shape))], [vi("loss", [])], inits, opset=23, ir_version=11)

    one_row = forward(np.cos(angles), np.sin(angles))
    with pytest.raises(Exception, match="expected to have the same shape as input 'x', got 1 and 5"):
        run_named(ir.from_proto(one_row), {"x": x})
    got = run_named(build_training_graph(one_row, optimizer=None, params=["w"]), {"x": x})
    batched = forward(np.cos(angles).repeat(2, axis=0), np.sin(angles).repeat(2, axis=0))
    want = run_named(build_training_graph(batched, optimizer=None, params=["w"]), {"x": x})
    np.testing.assert_allclose(got["grad/w"], want["grad/w"], rtol=1e-6, atol=1e-6)


_LINEAR = "%linear = call_function[target=torch.ops.aten.linear.default](args = (%x, %p_w), kwargs = {})"
_W = np.arange(16, dtype=np.float32).reshape(4, 4)


def _folded_linear(params: dict[str, np.ndarray], fx: str = _LINEAR) -> ir.Model:
    """``MatMul(x, val_0)`` with ``val_0`` folded from the parameter ``w``, as the optimizer
    folds an ``nn.Linear`` weight's Transpose."""
    nodes = [h.make_node("MatMul", ["x", "val_0"], ["y"], name="mm")]
    model = _signed(nodes, {"mm": fx}, params, ["w"])
    folded = model.graph.initializers["val_0"]
    del folded.metadata_props[TORCH_INPUT_KIND]
    folded.metadata_props["pkg.onnxscript.optimizer.folded_from"] = "['w']"
    return model


@pytest.mark.parametrize("kept", [True, False], ids=["w-kept", "w-dropped"])
def test_a_pre_transposed_weight_is_rebuilt_as_a_transpose_of_the_parameter(kept: bool) -> None:
    """Rule 0: ``val_0 == w.T`` becomes ``Transpose(w)`` with ``w`` a parameter initializer
    (``w`` kept: the values are equal exactly; dropped: ``w`` is ``val_0`` transposed back,
    as the reader lowers ``aten.linear(x, w)``)."""
    model = _folded_linear({"w": _W, "val_0": _W.T} if kept else {"val_0": _W.T})
    assert UntieExportedParametersPass()(model).modified
    graph = model.graph
    assert set(graph.initializers) == {"w"} and graph.initializers["w"].metadata_props[TORCH_INPUT_KIND] == "PARAMETER"
    np.testing.assert_array_equal(graph.initializers["w"].const_value.numpy(), _W)
    transpose = graph.node("mm").inputs[1].producer()
    assert transpose.op_type == "Transpose" and transpose.inputs[0] is graph.initializers["w"]
    assert list(transpose.attributes["perm"].value) == [1, 0]


@pytest.mark.parametrize(("params", "fx"), [
    ({"w": _W, "val_0": 2 * _W.T}, _LINEAR),  # kept, but the folded value is not its transpose
    ({"val_0": _W.T}, "%mm = call_function[target=torch.ops.aten.mm.default](args = (%x, %p_w))"),  # dropped, no linear
], ids=["not-equal", "not-linear"])
def test_a_fold_that_is_not_the_parameters_transpose_stays_refused(params, fx) -> None:
    with pytest.raises(UnsupportedModelError, match=r"folded or merged 1 torch parameters .*first: 'w', folded into 'val_0'"):
        UntieExportedParametersPass()(_folded_linear(params, fx))
