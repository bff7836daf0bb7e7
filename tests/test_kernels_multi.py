"""The session lowerings that cut kernel launches: multi-tensor ops (``mpgraph.lowering.multi``)
and transposes folded into matmuls (``mpgraph.lowering.transpose``), on ORT's CPU provider
(their CUDA kernels are checked on the GPU machine: benchmarks/results/kernels_check_cuda.txt)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from mpgraph import lowering as kernels
from mpgraph.convert import convert
from mpgraph.lowering.fuse import fuse_adamw
from mpgraph.lowering.multi import batch_adamw, batch_casts, fuse_unscale
from mpgraph.lowering.transpose import fold_transposes
from mpgraph.policy.loader import load_policy
from mpgraph.runtime.trainer import Trainer
from mpgraph.training import build_training_graph

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "models/onnx/gpt.loss.onnx"
MLP = ROOT / "models/onnx/tiny_mlp.loss.onnx"


def _count(model: ir.Model, op_type: str) -> int:
    return sum(1 for n in model.graph if n.op_type == op_type)


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels.library("cpu")))
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(model: ir.Model, feeds: dict[str, np.ndarray] | None = None, seed: int = 1) -> dict[str, np.ndarray]:
    session = _session(model)
    if feeds is None:
        rng = np.random.default_rng(seed)
        feeds = {}
        for i in session.get_inputs():
            shape = [d if isinstance(d, int) else 3 for d in i.shape]
            feeds[i.name] = rng.integers(0, 2, shape).astype(np.int64) if "int" in i.type else rng.standard_normal(shape).astype(np.float32)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _train(step: ir.Model, fused: bool | None, steps: int = 6) -> tuple[list[float], dict[str, np.ndarray], list[bool]]:
    trainer = Trainer(step, "cpu", threads=1, kernels=fused)
    rng = np.random.default_rng(0)
    losses, skipped = [], []
    for _ in range(steps):
        batch = {}
        for spec in trainer.data_inputs:
            shape = [d if isinstance(d, int) else 16 for d in spec.shape]
            batch[spec.name] = (rng.integers(0, 2, shape) if spec.dtype.kind == "i" else rng.standard_normal(shape)).astype(spec.dtype)
        result = trainer.step(batch, lr=3e-3)
        losses.append(float(result.loss))
        skipped.append(result.skipped)
    return losses, trainer.state, skipped


def _assert_same_training(step: ir.Model, steps: int = 6, kernels: bool | None = True) -> list[bool]:
    plain, fused = _train(step, False, steps), _train(step, kernels, steps)
    assert plain[0] == fused[0] or np.array_equal(plain[0], fused[0], equal_nan=True)
    assert plain[2] == fused[2]
    for name, value in plain[1].items():
        assert np.array_equal(value, fused[1][name], equal_nan=True), name
    return plain[2]


# -- MultiAdamWUpdate ---------------------------------------------------------------------


def test_adamw_updates_sharing_scalars_become_one_node():
    """Unpacked, the MLP's six tensors are six AdamWUpdate nodes: weights (decayed) and biases
    read different decay scalars, so two multi-tensor nodes; training is bit-identical."""
    step = build_training_graph(MLP, optimizer="adamw", optimizer_options={"pack": False, "weight_decay": 0.1})
    lowered = _copy(step)
    assert fuse_adamw(lowered) == 6
    groups = {tuple(id(v) for v in n.inputs[4:]) for n in lowered.graph if n.op_type == "AdamWUpdate"}
    assert batch_adamw(lowered) == 6 - len(groups)
    assert _count(lowered, "AdamWUpdate") == 0 and _count(lowered, "MultiAdamWUpdate") == len(groups)
    node = next(n for n in lowered.graph if n.op_type == "MultiAdamWUpdate")
    assert (len(node.inputs) - 7) % 4 == 0 and len(node.outputs) == 3 * (len(node.inputs) - 7) // 4
    # CPU's default kernels (multi_adamw among them): scope all would also fuse the MLP's loss
    # (cross_entropy, same math: its sums reassociate).
    _assert_same_training(step, kernels=None)


def test_multi_adamw_refuses_mismatched_sizes():
    step = build_training_graph(MLP, optimizer="adamw", optimizer_options={"pack": False})
    fuse_adamw(step)
    batch_adamw(step)
    node = next(n for n in step.graph if n.op_type == "MultiAdamWUpdate")
    node.replace_input_with(8, node.inputs[11])  # tensor 0's g := tensor 1's p
    if node.inputs[7].shape == node.inputs[11].shape:
        pytest.skip("the first two tensors have one shape")
    with pytest.raises(Exception, match="differ in size"):
        _run(step)


# -- CastToBFloat16 / CastToFloat16 -------------------------------------------------------


SPECIALS = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 65504.0, 65519.0, 65520.0, 1e6, 3e38,
                     6.1e-5, 6.0e-8, 2.98e-8, 2.99e-8, 1e-40, 1.00390625, 1.0078125, 1.01171875,
                     1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0000001, -1.00390625], np.float32)
SPECIALS = np.concatenate([SPECIALS, np.array([0xFFC00000, 0x7FA12345, 0x7F812345], np.uint32).view(np.float32)])  # -NaN, payload NaNs


@pytest.mark.parametrize("to", [ir.DataType.BFLOAT16, ir.DataType.FLOAT16])
def test_weight_casts_become_one_node_with_the_same_bits(to):
    """Casts of graph inputs merge into one node whose rounding is ORT's Cast's, bit for bit:
    ties to even, overflow to infinity, float16 subnormals, NaN."""
    rng = np.random.default_rng(0)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 18}, name="casts")
    feeds = {}
    for i, size in enumerate((len(SPECIALS), 1000, 7)):
        x = ir.Value(name=f"x{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([size]))
        graph.inputs.append(x)
        node = ir.Node("", "Cast", [x], attributes=[ir.AttrInt64("to", to)], name=f"cast{i}")
        back = ir.Node("", "Cast", node.outputs, attributes=[ir.AttrInt64("to", ir.DataType.FLOAT)], name=f"back{i}")
        graph.extend([node, back])  # back to float32 (exact), which numpy can hold
        node.outputs[0].type, node.outputs[0].shape = ir.TensorType(to), ir.Shape([size])
        back.outputs[0].name, back.outputs[0].type = f"y{i}", ir.TensorType(ir.DataType.FLOAT)
        graph.outputs.append(back.outputs[0])
        feeds[f"x{i}"] = SPECIALS if i == 0 else (rng.standard_normal(size) * 10.0 ** rng.integers(-9, 6, size)).astype(np.float32)
    model = ir.Model(graph, ir_version=9)
    plain = _run(model, feeds)
    merged = _copy(model)
    assert batch_casts(merged) == 2 and _count(merged, "Cast") == 3  # the casts back remain
    fused = _run(merged, feeds)
    for name, value in plain.items():
        assert fused[name].dtype == value.dtype
        assert np.array_equal(fused[name].view(np.uint32), value.view(np.uint32)), name


def test_casts_of_computed_values_are_left_alone():
    step = convert(build_training_graph(MLP, optimizer="adamw"), "bf16", emulate=False, validate=False, calibrate=None)
    weights = sum(1 for n in step.graph if n.op_type == "Cast" and n.inputs[0].producer() is None
                  and n.attributes["to"].as_int() == ir.DataType.BFLOAT16)
    casts = _count(step, "Cast")
    assert batch_casts(step) == weights - 1 >= 2
    assert _count(step, "Cast") == casts - weights and _count(step, "CastToBFloat16") == 1


# -- UnscaleGradients ---------------------------------------------------------------------


def _fp16(init: float | None = None) -> ir.Model:
    policy = load_policy("fp16")
    if init is not None:
        policy = dataclasses.replace(policy, loss_scaling=dataclasses.replace(policy.loss_scaling, init=init))
    return convert(build_training_graph(MLP, optimizer="adamw", optimizer_options={"pack": False}), policy,
                   emulate=True, calibrate=None)


def test_unscale_and_check_become_one_node():
    step = _fp16()
    lowered = _copy(step)
    grads = sum(1 for n in step.graph if n.name.endswith("/unscaled"))
    assert grads == 6
    replaced = fuse_unscale(lowered)
    assert replaced >= 4 * grads  # per gradient: Mul, ReduceSum, Add (one fewer), Where, and a Cast for float16
    node = next(n for n in lowered.graph if n.op_type == "UnscaleGradients")
    assert len(node.inputs) == 1 + grads and len(node.outputs) == 1 + grads
    assert _count(lowered, "IsNaN") == 0 and not any(n.name.endswith("/finite") for n in lowered.graph)
    assert not any(n.op_type == "Cast" and n.name.endswith("/grad_fp32") for n in lowered.graph)


@pytest.mark.parametrize("init", [65536.0, 2.0 ** 40])
def test_fp16_training_with_the_fused_unscale_is_bit_identical(init):
    """2^40 overflows the float16 backward: the first steps are skipped (the scale backs off)
    in both forms, with the same state after every one of them."""
    skipped = _assert_same_training(_fp16(init), steps=8)
    assert any(skipped) == (init > 1e6)


def test_unscale_finds_a_nan_in_any_input():
    step = _fp16()
    fuse_unscale(step)
    session = _session(step)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 4 for d in i.shape]
        feeds[i.name] = rng.integers(0, 2, shape).astype(np.int64) if "int" in i.type else rng.standard_normal(shape).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    clean = dict(zip(names, session.run(None, feeds)))
    assert not clean["found_inf"]
    feeds["x"] = feeds["x"].copy()
    feeds["x"][0, 0] = np.inf
    dirty = dict(zip(names, session.run(None, feeds)))
    assert dirty["found_inf"]
    assert all(not np.any(dirty[n]) for n in names if n.endswith("/unscaled"))


# -- FusedMatMul --------------------------------------------------------------------------


def test_transposes_fold_into_matmuls_with_the_same_gradients():
    """The zoo GPT's gradients (a torch export): weight transposes, the attention backward's
    and the weight gradients' transposes fold away; MLAS gives the same bits."""
    grads = build_training_graph(GPT, optimizer=None)
    folded = _copy(grads)
    before = _count(grads, "Transpose")
    removed = fold_transposes(folded, "cpu")
    assert removed >= before // 2 and _count(folded, "Transpose") == before - removed
    assert _count(folded, "FusedMatMul") > 0
    plain, low = _run(grads), _run(folded)
    for name, value in plain.items():
        np.testing.assert_allclose(low[name], value, rtol=0, atol=1e-6 * max(float(np.max(np.abs(value))), 1e-6), err_msg=name)


def test_low_precision_matmuls_fold_only_for_cuda():
    """ORT's CPU provider has no bfloat16 FusedMatMul."""
    step = convert(build_training_graph(GPT, optimizer=None), "bf16", emulate=False, validate=False, calibrate=None)
    assert fold_transposes(_copy(step), "cpu") < fold_transposes(_copy(step), "cuda")


def test_full_lowering_keeps_the_graph_sorted_and_valid():
    step = convert(build_training_graph(GPT, optimizer="adamw", optimizer_options={"pack": False}), "bf16",
                   emulate=False, validate=False, calibrate=None)
    assert kernels.lower(step, "cuda") > 50
    seen = set(step.graph.inputs) | set(step.graph.initializers.values())
    for node in step.graph:
        for value in node.inputs:
            assert value is None or value in seen or value.producer() is None, (node.name, value.name)
        seen.update(node.outputs)
    for op in ("MultiAdamWUpdate", "CastToBFloat16", "LayerNormGradBias", "ErfGeluGrad", "FusedMatMul"):
        assert _count(step, op) >= 1, op


# -- LayerNormGradBias with a low-precision dy --------------------------------------------


def _layernorm_f16_model() -> ir.Model:
    """loss = sum(float(float16(LayerNorm(x, w, b)) * r)): the LayerNorm's dy arrives as float16
    and is cast to float32 for its backward, as in a float16-converted transformer."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), n) for n in ("w", "b")]
    inits.append(numpy_helper.from_array(rng.standard_normal(24).astype(np.float16), "r"))
    inits.append(numpy_helper.from_array(rng.standard_normal((2, 5, 24)).astype(np.float32), "x"))
    nodes = [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("Cast", ["y"], ["y16"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["y16", "r"], ["z16"]),
             helper.make_node("Cast", ["z16"], ["z"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "ln16", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8))


def test_layernorm_grad_reads_a_float16_dy_and_makes_the_bias_gradient():
    grads = build_training_graph(_layernorm_f16_model(), optimizer=None)
    lowered = _copy(grads)
    kernels.lower(lowered)
    node = next(n for n in lowered.graph if n.op_type == "LayerNormGradBias")
    assert node.inputs[0].dtype == ir.DataType.FLOAT16  # the cast to float32 is folded into the kernel
    assert _count(lowered, "ReduceSum") == _count(grads, "ReduceSum") - 2  # dscale and dbias
    plain, low = _run(grads), _run(lowered)
    for name, value in plain.items():
        np.testing.assert_allclose(low[name], value, rtol=0, atol=2e-6 * max(float(np.max(np.abs(value))), 1e-6), err_msg=name)


# -- ErfGeluGrad, SoftmaxGradDot, fold_scales -------------------------------------------------


def _agree(plain: dict[str, np.ndarray], low: dict[str, np.ndarray], tol: float) -> None:
    for name, value in plain.items():
        np.testing.assert_allclose(low[name], value, rtol=0, atol=tol * max(float(np.max(np.abs(value))), 1e-6), err_msg=name)


def test_gelu_backward_becomes_one_node():
    """The zoo GPT's two GELUs reach the lowering as ``Gelu`` (canonicalised before
    differentiating): each one's backward (the rule's 10 ops) becomes one ErfGeluGrad, the
    forward stays ORT's Gelu; gradients agree (the CPU kernel's erf is libm's, ORT CPU's is
    MLAS's own)."""
    from mpgraph.lowering.gelu import fuse_gelu

    grads = build_training_graph(GPT, optimizer=None)
    fused = _copy(grads)
    assert fuse_gelu(fused) == 2
    assert _count(fused, "Erf") == _count(fused, "Exp") - _count(grads, "Exp") + 2 == 0
    assert _count(fused, "Gelu") == 2 and len(list(fused.graph)) == len(list(grads.graph)) - 2 * (10 - 1)
    _agree(_run(grads), _run(fused), 1e-6)


def test_attention_softmax_backward_becomes_one_node():
    from mpgraph.lowering.softmax import fuse_softmax_grad

    grads = build_training_graph(GPT, optimizer=None)
    fused = _copy(grads)
    assert fuse_softmax_grad(fused) == 2
    node = next(n for n in fused.graph if n.op_type == "SoftmaxGradDot")
    assert node.inputs[1].producer().op_type == "Softmax"
    _agree(_run(grads), _run(fused), 1e-6)


def test_power_of_two_scales_fold_into_matmul_alpha_exactly():
    """The attention's 1/sqrt(16) = 0.25 forward and backward: folded, same bits on CPU; a
    scale of 0.3 would round differently and stays a Mul."""
    from mpgraph.lowering.transpose import fold_scales

    grads = build_training_graph(GPT, optimizer=None)
    folded = _copy(grads)
    fold_transposes(folded, "cpu")
    muls = _count(folded, "Mul")
    assert fold_scales(folded, "cpu") == 4 and _count(folded, "Mul") == muls - 4
    alphas = {n.attributes["alpha"].as_float() for n in folded.graph if n.op_type == "FusedMatMul"}
    assert 0.25 in alphas
    plain, low = _run(grads), _run(folded)
    for name, value in plain.items():
        assert np.array_equal(value, low[name]), name
    odd = _copy(grads)
    for node in odd.graph:
        if node.op_type == "Mul" and any(v is not None and v.const_value is not None and v.const_value.numpy().size == 1
                                         and float(v.const_value.numpy()) == 0.25 for v in node.inputs):
            const = next(v for v in node.inputs if v.const_value is not None)
            const.const_value = ir.tensor(np.array(0.3, np.float32), name=const.name)
    assert fold_scales(odd, "cpu") == 0


# -- ReluGrad, SoftmaxCrossEntropyGrad ----------------------------------------------------


def test_relu_backward_becomes_one_node_with_the_same_bits():
    from mpgraph.lowering.grads import fuse_relu_grad

    grads = build_training_graph(MLP, optimizer=None)
    fused = _copy(grads)
    assert fuse_relu_grad(fused) == 2
    assert _count(fused, "Greater") == 0 and len(list(fused.graph)) == len(list(grads.graph)) - 4
    plain, low = _run(grads), _run(fused)
    for name, value in plain.items():
        assert np.array_equal(value, low[name]), name


def test_cross_entropy_gradient_becomes_one_node():
    """Four passes over the logits (Exp, OneHot, Sub, Mul) into one; on CPU the kernel's exp is
    libm's and ORT's is MLAS's (so the CUDA lowering alone uses it), agreeing within 1e-6."""
    from mpgraph.lowering.grads import fuse_sce_grad

    for model, expected in ((MLP, 1), (GPT, 1)):
        grads = build_training_graph(model, optimizer=None)
        fused = _copy(grads)
        assert fuse_sce_grad(fused) == expected
        assert _count(fused, "OneHot") == 0
        _agree(_run(grads), _run(fused), 1e-6)
    assert fuse_sce_grad(_copy(grads)) == 1 and kernels.lower(_copy(grads), "cpu") > 0
    cpu = _copy(grads)
    kernels.lower(cpu, "cpu")
    assert _count(cpu, "SoftmaxCrossEntropyGrad") == 0  # CPU keeps ORT's Exp


# -- the matchers refuse look-alikes ------------------------------------------------------


def test_a_scale_read_twice_by_one_matmul_folds_squared():
    """``MatMul(0.5 a, 0.5 a)`` is ``0.25 (a a)``: alpha takes the scale once per operand."""
    from onnx import TensorProto, helper

    from mpgraph.lowering.transpose import fold_scales

    nodes = [helper.make_node("Mul", ["a", "half"], ["s"]), helper.make_node("MatMul", ["s", "s"], ["y"])]
    graph = helper.make_graph(nodes, "sq", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    feeds = {"a": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
    plain = _run(model, feeds)
    assert fold_scales(model, "cpu") == 1
    node = next(n for n in model.graph if n.op_type == "FusedMatMul")
    assert node.attributes["alpha"].as_float() == 0.25
    assert np.array_equal(_run(model, feeds)["y"], plain["y"])


def test_cross_entropy_gradient_with_another_depth_is_not_fused():
    from mpgraph.lowering.grads import fuse_sce_grad

    grads = build_training_graph(MLP, optimizer=None)
    one_hot = next(n for n in grads.graph if n.op_type == "OneHot")
    depth = ir.Value(name="depth3", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]),
                     const_value=ir.tensor(np.array([3], np.int64)))
    grads.graph.register_initializer(depth)
    one_hot.replace_input_with(1, depth)
    assert fuse_sce_grad(grads) == 0


def test_the_captured_sessions_graph_is_lowered_alike():
    """The CUDA-graph session runs a copy specialised to the batch's shapes
    (``specialize_shapes``), where Shape nodes fold into constants: the lowering makes the same
    fused ops there (SoftmaxGradDot once missed all of them: its Reshape checks wanted the Shape
    node)."""
    from collections import Counter

    from mpgraph.lowering.specialize import specialize_shapes

    step = convert(build_training_graph(GPT, optimizer="adamw"), "bf16", emulate=False, validate=False, calibrate=None)
    fixed = specialize_shapes(_copy(step), {"tokens": (4, 16), "label": (4, 16)})
    made = []
    for model in (step, fixed):
        kernels.lower(model, "cuda")
        made.append(Counter(n.op_type for n in model.graph if n.domain in ("ai.mpgraph", "com.microsoft")))
    # Pointwise needs static shapes: the specialised graph has more of them (8 against 1).
    assert made[1].pop("Pointwise") > made[0].pop("Pointwise")
    assert made[0] == made[1] and made[0]["SoftmaxGradDot"] == 2, made


def test_adam_scalar_block_becomes_one_node_with_the_same_bits():
    """The ten float64 scalar ops of the bias corrections: one AdamScalars node; the step size
    and sqrt(1 - beta2^t) keep their bits (float64 Pow, Sub, Div, Sqrt as ORT's), so training
    stays bit-identical (the fp16 form gates the step size on overflow after it)."""
    from mpgraph.lowering.scalars import fuse_adam_scalars

    for step in (build_training_graph(MLP, optimizer="adamw"), _fp16()):
        lowered = _copy(step)
        before = len(list(lowered.graph))
        assert fuse_adam_scalars(lowered) == 1
        assert len(list(lowered.graph)) == before - 9 and _count(lowered, "Pow") == 0
    _assert_same_training(_fp16(2.0 ** 40), steps=8)


def test_lowering_twice_changes_nothing_more():
    """A lowered graph has nothing left to lower: every matcher leaves fused nodes alone."""
    step = convert(build_training_graph(GPT, optimizer="adamw", optimizer_options={"pack": False}), "fp16",
                   emulate=False, validate=False, calibrate=None)
    assert kernels.lower(step, "cuda") > 50
    before = [(n.op_type, n.name) for n in step.graph]
    assert kernels.lower(step, "cuda") == 0
    assert [(n.op_type, n.name) for n in step.graph] == before
