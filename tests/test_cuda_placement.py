"""The CUDA-graph session of a causal LM or BERT has no node that ORT 1.31's CUDA provider puts on CPU.

ORT refuses to capture a session as a CUDA graph when one node is not on the CUDA provider
("all compute graph nodes have not been partitioned to the CUDAExecutionProvider"). The real
GPT-2 (TorchScript) and Llama-style (dynamo) bf16 steps had such nodes on the H200: the int64
Pad of the shifted labels in HF's ``ForCausalLMLoss`` (ORT CUDA's Pad is bool/float/double/half
only), and the ``Shape`` arithmetic that one round of specialisation left unfolded: the pads
of the gradient ``Pad`` of Llama's rotary ``Slice`` nodes and of GPT-2's padded lm_head
(``PadGemmColumnsPass``, 50257 -> 50304 columns). The TorchScript BERT's: its
``token_type_ids`` buffer gathered at the position ids (``GatherElements`` along the sequence)
did not fold from 64 positions on (onnx's reference evaluator), leaving the gradient of the
embeddings' ``Add`` as Shape arithmetic.

``off_cuda`` is what ORT 1.31 CUDA places on CPU, by its registrations: ``Shape``/``Size``
(their outputs are host memory; ORT puts the arithmetic reading them on CPU), a ``Pad`` outside
``CUDA_PAD_TYPES``, a float op the probed kernel table marks ``no``, an integer or bool op
outside ``_CUDA_INT_OPS``, and an input ORT CUDA reads from host memory (a Reshape's shape...)
that is not a constant.

Cost: about 6 CPU-s here (a 1030-token GPT-2 exported for the padded-GEMM case) plus the corpus
exports of GPT-2 (TorchScript) and Llama (dynamo), about 9 CPU-s, shared with the other corpus
tests of a run; about 1 CPU-s for the 64-token BERT.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import mpgraph
from mpgraph.io import as_model
from mpgraph.lowering.match import constant
from mpgraph.lowering.narrow_pad import narrow_before_pad
from mpgraph.lowering.pad_concat import CUDA_PAD_TYPES, pads_as_concat
from mpgraph.lowering.registry import RULES, Target
from mpgraph.lowering.specialize import shape_ops, specialize_shapes
from mpgraph.runtime.program import Program
from mpgraph.targets import kernel_cell
from mpgraph.training import build_training_graph

_FLOATS = {ir.DataType.FLOAT: "float", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}
#: Integer and bool ops known to run on ORT 1.31 CUDA: those of the zoo GPT's step, which the
#: H200 captures as one CUDA graph (the labels' Add/Equal/Less/Not/Cast/Where/Reshape/Unsqueeze,
#: the embedding gradient's ConstantOfShape), and Slice and Concat (registered for every
#: fixed-size type, ``core/providers/cuda/tensor/slice.cc``, ``concat.cc``). Others are flagged
#: until shown.
_CUDA_INT_OPS = frozenset({"Add", "Equal", "Less", "Not", "Cast", "Where", "Reshape", "Unsqueeze", "ConstantOfShape",
                           "Slice", "Concat"})
#: Inputs ORT CUDA reads from host memory (``InputMemoryType(OrtMemTypeCPUInput, i)``).
_HOST_INPUTS = {"Reshape": (1,), "Pad": (1, 2, 3), "Slice": (1, 2, 3, 4), "Split": (1,), "ReduceSum": (1,),
                "ReduceMean": (1,), "ReduceMax": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Expand": (1,),
                "Tile": (1,), "ConstantOfShape": (0,)}


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return constant(value) is not None or (producer is not None and producer.op_type == "Constant")


def off_cuda(model: ir.Model) -> list[str]:
    """``op dtype (node)`` of every node ORT 1.31 CUDA would leave to the CPU provider."""
    opset = model.opset_imports.get("", 0)
    off = []
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type == "Constant":
            continue
        x = node.inputs[0] if node.inputs else None
        dtype = x.dtype if x is not None else None
        why = None
        if node.op_type in ("Shape", "Size"):
            why = "shape op"
        elif node.op_type == "Pad":
            why = None if dtype in CUDA_PAD_TYPES else "no Pad kernel"
        elif dtype in _FLOATS:
            why = "no kernel" if kernel_cell("cuda", node.op_type, _FLOATS[dtype], opset) == "no" else None
        elif dtype is not None and node.op_type not in _CUDA_INT_OPS:
            why = "no integer kernel"
        host = [i for i in _HOST_INPUTS.get(node.op_type, ())
                if i < len(node.inputs) and node.inputs[i] is not None and not _is_constant(node.inputs[i])]
        if why is None and host:
            why = f"computed host input {host}"
        if why is not None:
            off.append(f"{node.op_type} {dtype} ({node.name}: {why})")
    return off


def _wide_gpt2() -> onnx.ModelProto:
    """The corpus GPT-2 with 1030 tokens: its lm_head GEMM gets ``PadGemmColumnsPass``'s
    Pad/Slice, as GPT-2's 50257 do (the gradient Pad's pads were Shape arithmetic)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.corpus import check, models

    cfg = GPT2Config(vocab_size=1030, n_positions=models.SEQ * 2, n_embd=32, n_layer=1, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = models._tokens(1)
    return check.export(models._hf("gpt2", GPT2LMHeadModel(cfg), input_ids=ids, labels=ids), "torchscript").model


def _long_bert() -> onnx.ModelProto:
    """A 64-token BERT masked LM (as real_models.py's, tiny): its TorchScript export gathers the
    ``token_type_ids`` buffer at the position ids (``GatherElements`` along 64), which onnx's
    reference evaluator could not fold from 64 positions on, so the embeddings' ``Add`` gradient
    was Shape arithmetic (Shape, Equal, And, NonZero, a computed Reshape) on ORT's CPU."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from tests.corpus import check, models

    cfg = BertConfig(vocab_size=models.VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg)
    model.set_attn_implementation("eager")  # as real_models.py exports it
    ids = models._tokens(1, (2, 64))
    labels = torch.where(ids % 7 == 0, ids, -100)
    return check.export(models._hf("bert", model, input_ids=ids, labels=labels), "torchscript").model


_BUILT = {"gpt2_wide": _wide_gpt2, "bert_long": _long_bert}


def _graph_session(case: str, exporter: str) -> ir.Model:
    """The bf16 step of a corpus model as the trainer's CUDA-graph session gets it: converted for
    cuda, specialised to the batch, then the CUDA rules (the fused attention included)."""
    from tests.corpus import cache

    proto = _BUILT[case]() if case in _BUILT else cache.exported(case, exporter).model
    step = build_training_graph(proto, optimizer="adamw", target="cuda", canonicalize=True)
    program = Program(mpgraph.convert(step, "bf16", target="cuda", calibrate=None, validate=False))
    shapes = {s.name: tuple(d if isinstance(d, int) else 2 for d in s.shape) for s in program.data_inputs}
    model = specialize_shapes(as_model(program.session_graph), shapes)
    target = Target("cuda", "default", sdpa=True)
    for rule in RULES:
        if rule.runs("cuda", "default"):
            rule.apply(model, target)
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("case", "exporter"), [("gpt2", "torchscript"), ("llama", "dynamo"),
                                               ("gpt2_wide", "torchscript"), ("bert_long", "torchscript")])
def test_graph_session_is_all_cuda(case, exporter):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model = _graph_session(case, exporter)
    assert any(n.op_type == "SdpaForward" for n in model.graph)  # the session the H200 ran
    if case == "gpt2_wide":  # the padded lm_head is there (its bfloat16 weight padded by narrow_pad's Concat)
        assert any(n.op_type in ("Slice", "Pad", "Concat") and n.name.startswith("align/") for n in model.graph)
    assert off_cuda(model) == []


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    proto = ir.to_proto(model)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _pad_model(dtype: int, shape: list, pads: list[int], value: np.ndarray | None, axes: list[int] | None = None):
    inputs = ["x", "pads", "value" if value is not None else "", "axes" if axes is not None else ""]
    inits = [nh.from_array(np.array(pads, np.int64), "pads")]
    if value is not None:
        inits.append(nh.from_array(value, "value"))
    if axes is not None:
        inits.append(nh.from_array(np.array(axes, np.int64), "axes"))
    node = h.make_node("Pad", [i for i in inputs if i] if axes is None else inputs, ["y"], name="pad")
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", dtype, shape)],
                         [h.make_tensor_value_info("y", dtype, None)], inits)
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10))


@pytest.mark.parametrize(("dtype", "pads", "value", "axes"), [
    (TP.INT64, [0, 0, 0, 1], np.array(-100, np.int64), None),  # HF's shifted labels
    (TP.INT64, [1, 0, 2, 3], np.array(7, np.int64), None),
    (TP.INT32, [0, 2], None, [1]),
    (TP.UINT8, [1, 1, 0, 0], np.array(3, np.uint8), None),
])
def test_pad_as_concat_gives_the_same_tensor(dtype, pads, value, axes):
    model = _pad_model(dtype, [3, 4], pads, value, axes)
    x = np.arange(12).reshape(3, 4).astype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    expected = _run(model, {"x": x})[0]
    assert pads_as_concat(model) == 1
    assert [n.op_type for n in model.graph] == ["Concat"] * len([p for p in np.reshape(pads, (2, -1)).T if any(p)])
    got = _run(model, {"x": x})[0]
    assert got.dtype == expected.dtype and np.array_equal(got, expected)
    assert model.graph.outputs[0].name == "y" and off_cuda(model) == []


def test_pad_as_concat_leaves_cuda_pads_and_unknown_shapes():
    floats = _pad_model(TP.FLOAT, [3, 4], [0, 0, 0, 1], np.array(0.5, np.float32))
    bools = _pad_model(TP.BOOL, [3, 4], [1, 1, 0, 0], np.array(True))
    symbolic = _pad_model(TP.INT64, ["n", 4], [0, 0, 0, 1], np.array(-100, np.int64))
    crop = _pad_model(TP.INT64, [3, 4], [0, 0, 0, -1], None)
    assert [pads_as_concat(m) for m in (floats, bools, symbolic, crop)] == [0, 0, 0, 0]
    assert off_cuda(floats) == off_cuda(bools) == [] and off_cuda(symbolic) != []


def _pad_cast_model(to: int, value: np.ndarray | None, mode: str = "constant", readers: int = 1) -> ir.Model:
    """``Cast(Pad(x, [0, 0, 0, 3]), to)``: the padded GEMM columns' gradient, rounded for the
    backward GEMMs (``readers`` > 1: the padded float32 copy has another reader too), widened
    back to float32 for the graph's outputs (ORT's Python side returns no bfloat16)."""
    model = _pad_model(TP.FLOAT, [3, 5], [0, 0, 0, 3], value)
    graph = model.graph
    pad = next(iter(graph))
    pad.attributes["mode"] = ir.AttrString("mode", mode)
    graph.outputs.clear()
    for i in range(readers):
        cast = ir.node("Cast", [pad.outputs[0]], attributes={"to": to}, name=f"cast{i}")
        cast.outputs[0].name, cast.outputs[0].dtype = f"y{i}", ir.DataType(to)
        wide = ir.node("Cast", [cast.outputs[0]], attributes={"to": TP.FLOAT}, name=f"wide{i}")
        wide.outputs[0].name, wide.outputs[0].dtype = f"w{i}", ir.DataType.FLOAT
        graph.extend([cast, wide])
        graph.outputs.append(wide.outputs[0])
    return model


@pytest.mark.parametrize(("to", "value"), [(TP.BFLOAT16, None), (TP.BFLOAT16, np.array(0.0, np.float32)),
                                           (TP.FLOAT16, np.array(0.0, np.float32))])
def test_narrowing_cast_runs_before_a_zero_pad(to, value):
    """The float32 padded copy is gone: the Cast reads x and the Pad pads the 2-byte result, and
    every element has the bits the Cast of the padded copy had (after pad_concat too, which
    writes the narrow Pad as ORT CUDA's Concat)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5)) * np.float32(3.0)).astype(np.float32)
    x[0, 0], x[1, 1] = np.float32(1 + 2.0 ** -9), np.float32(-(1 + 3 * 2.0 ** -12))  # rounding ties and near-ties
    model = _pad_cast_model(to, value)
    (expected,) = _run(model, {"x": x})
    assert narrow_before_pad(model) == 1
    assert [n.op_type for n in model.graph] == ["Cast", "Pad", "Cast"]
    cast, pad, _ = model.graph
    assert cast.inputs[0].name == "x" and pad.outputs[0].name == "y0" and pad.outputs[0].dtype == ir.DataType(to)
    assert pads_as_concat(model) == (1 if to == TP.BFLOAT16 else 0)
    assert off_cuda(model) == []
    if to == TP.FLOAT16:
        return  # ORT CPU runs float16 as float32 behind casts it then drops: no rounding to compare
    (got,) = _run(model, {"x": x})
    assert got.shape == (3, 8) and got.tobytes() == expected.tobytes()
    assert expected.tobytes() == np.pad(x.astype(ml_dtypes.bfloat16), [(0, 0), (0, 3)]).astype(np.float32).tobytes()


def test_narrow_pad_leaves_pads_that_do_not_commute_with_the_cast():
    """A nonzero fill (it would be rounded), a fill of -0.0 (the moved Pad fills +0.0), another
    reader of the float32 copy, a widening Cast and a non-constant mode all keep their order."""
    cases = [_pad_cast_model(TP.BFLOAT16, np.array(0.5, np.float32)), _pad_cast_model(TP.FLOAT16, np.array(-0.0, np.float32)),
             _pad_cast_model(TP.BFLOAT16, None, readers=2),
             _pad_cast_model(TP.DOUBLE, None), _pad_cast_model(TP.FLOAT16, None, mode="edge")]
    assert [narrow_before_pad(m) for m in cases] == [0, 0, 0, 0, 0]
    assert all([n.op_type for n in m.graph][0] == "Pad" for m in cases)


def test_specialising_folds_the_shape_read_behind_a_folded_split():
    """The rotary backward's pattern: a Split whose sizes are Shape arithmetic, and a Shape of its
    output. The first round folds the sizes; only a second round's inference gives the Split's
    outputs static shapes, so that their Shape folds."""
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "one"], ["w"], axis=0),
             h.make_node("Sub", ["w", "two"], ["rest"]), h.make_node("Concat", ["two", "rest"], ["sizes"], axis=0),
             h.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1),
             h.make_node("Shape", ["a"], ["sa"]), h.make_node("Expand", ["c1", "sa"], ["ones"]),
             h.make_node("Add", ["a", "ones"], ["y"])]
    inits = [nh.from_array(np.array(1, np.int64), "one"), nh.from_array(np.array([2], np.int64), "two"),
             nh.from_array(np.array([1.0], np.float32), "c1")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, ["n", 5])],
                         [h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10))
    fixed = specialize_shapes(model, {"x": (3, 5)})
    assert shape_ops(fixed) == 0 and off_cuda(fixed) == []
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(_run(fixed, {"x": x})[0], x[:, :2] + 1)


def test_a_buffer_gathered_along_64_positions_folds():
    """The TorchScript BERT's ``token_type_ids``: a constant buffer gathered at constant position
    ids (``GatherElements``). onnx's reference evaluator failed from 64 positions on, so the pass
    folded nothing; now the gathered value is a Constant equal to ORT's result."""
    from mpgraph.training.fold_constant_subgraphs import FoldConstantSubgraphsPass

    buffer = np.arange(70, dtype=np.int64).reshape(1, 70) * 3
    index = np.arange(70, dtype=np.int64)[::-1].reshape(1, 70).copy()
    index[0, :5] -= 70  # negative indices count from the end
    nodes = [h.make_node("Constant", [], ["b"], value=nh.from_array(buffer)),
             h.make_node("Constant", [], ["i"], value=nh.from_array(index)),
             h.make_node("GatherElements", ["b", "i"], ["g"], axis=1), h.make_node("Add", ["x", "g"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.INT64, [1, 70])],
                         [h.make_tensor_value_info("y", TP.INT64, [1, 70])],
                         value_info=[h.make_tensor_value_info("g", TP.INT64, [1, 70])])
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10))
    x = np.arange(70, dtype=np.int64).reshape(1, 70)
    expected = _run(model, {"x": x})[0]
    assert FoldConstantSubgraphsPass(inputs_mark_params=True)(model).modified
    assert [n.op_type for n in model.graph].count("GatherElements") == 0
    np.testing.assert_array_equal(_run(model, {"x": x})[0], expected)
