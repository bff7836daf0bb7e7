"""The backward lowerings over canonical ops (``layernorm_grad``, ``gelu``, ``softmax_grad``):
each finds its backward by the forward node's gradient block, never by the nodes its gradient
rule emitted, and the lowered step agrees with the unlowered one on ORT CPU.

Graphs: the zoo GPT (a torch export whose erf GELU ``build_training_graph`` canonicalises into
``Gelu``), and a hand-written block with a written-out LayerNorm and erf GELU (the forms
``CanonicalizeOpsPass`` rewrites before differentiating). About 6 CPU-s.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper as h

from mpgraph.convert import convert
from mpgraph.lowering import PlanOptions, plan_session
from mpgraph.lowering.fuse import fuse_layernorm_grad
from mpgraph.lowering.gelu import fuse_gelu
from mpgraph.lowering.softmax import fuse_softmax_grad
from mpgraph.training import build_training_graph
from tests.helpers import init, make_model, run_named, vi

GPT = Path(__file__).resolve().parents[1] / "models/onnx/gpt.loss.onnx"
FUSED = ("ErfGeluGrad", "LayerNormGrad", "LayerNormGradBias", "SoftmaxGradDot")


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def _feeds(model: ir.Model, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        if value.const_value is not None:
            continue
        shape = [d if isinstance(d, int) else 3 for d in value.shape]
        feeds[value.name] = (rng.integers(0, 50, shape).astype(np.int64) if value.dtype == ir.DataType.INT64
                             else rng.standard_normal(shape).astype(np.float32))
    return feeds


def _agree(plain: ir.Model, lowered: ir.Model, tol: float) -> None:
    feeds = _feeds(plain)
    want, got = run_named(plain, feeds), run_named(lowered, feeds, library=True)
    assert set(got) == set(want)
    for name, value in want.items():
        scale = max(float(np.max(np.abs(value))), 1e-6) if value.size else 1.0
        np.testing.assert_allclose(got[name], value, rtol=0, atol=tol * scale, err_msg=name)


# -- the zoo GPT ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_grads() -> ir.Model:
    return build_training_graph(GPT, optimizer=None)


def test_the_zoo_gpt_reaches_the_lowering_as_canonical_ops(gpt_grads):
    """Its two erf GELUs (five exporter ops each) are one ``Gelu`` before differentiating; the
    Mul rule recognises no GELU any more (``canonicalize=False`` keeps the exporter's ops, and
    nothing fuses their backward)."""
    ops = _ops(gpt_grads)
    assert ops["Gelu"] == 2 and gpt_grads.opset_imports[""] == 20
    raw = build_training_graph(GPT, optimizer=None, canonicalize=False)
    assert _ops(raw)["Gelu"] == 0 and fuse_gelu(_copy(raw)) == 0


def test_every_backward_is_fused_from_its_block_and_agrees(gpt_grads):
    """All five LayerNorms, both GELUs and both attention softmaxes; the gradient rules' nodes
    go (no Erf, recomputing LayerNorm or ReduceMean is left), the forward ops stay."""
    lowered = _copy(gpt_grads)
    assert (fuse_layernorm_grad(lowered), fuse_gelu(lowered), fuse_softmax_grad(lowered)) == (5, 2, 2)
    ops = _ops(lowered)
    assert ops["LayerNormGradBias"] == 5 and ops["ErfGeluGrad"] == 2 and ops["SoftmaxGradDot"] == 2
    assert ops["LayerNormalization"] == 5 and ops["Gelu"] == 2 and ops["Softmax"] == 2
    assert ops["Erf"] == ops["ReduceMean"] == 0 and ops["ErfGelu"] == 0
    assert not [n for n, v in lowered.graph.initializers.items() if not v.uses() and not v.is_graph_input()
                and n not in gpt_grads.graph.initializers]
    _agree(gpt_grads, lowered, 2e-6)
    assert (fuse_layernorm_grad(lowered), fuse_gelu(lowered), fuse_softmax_grad(lowered)) == (0, 0, 0)


def test_a_value_inside_a_backward_read_elsewhere_stays_computed(gpt_grads):
    """The fusion does not depend on the rule's nodes: one of them also a graph output keeps
    the nodes it needs, and both the output and the gradients are right."""
    grads = _copy(gpt_grads)
    xhat = next(n for n in grads.graph if n.op_type == "LayerNormalization" and len(n.inputs) == 2)
    grads.graph.outputs.append(xhat.outputs[0])
    lowered = _copy(grads)
    assert fuse_layernorm_grad(lowered) == 5
    assert _ops(lowered)["LayerNormalization"] == 6
    _agree(grads, lowered, 2e-6)


def test_a_softmax_read_twice_in_the_forward_keeps_its_backward(gpt_grads):
    """``sum_j dP P = dO . O`` needs ``O = P V`` to be P's only forward reader."""
    from onnx import TensorProto

    graph = _copy(gpt_grads).graph
    softmax = next(n for n in graph if n.op_type == "Softmax")
    extra = ir.node("ReduceMax", [softmax.outputs[0]], attributes={"keepdims": 0},
                    metadata_props={"mpgraph.role": "forward"})
    extra.outputs[0].name, extra.outputs[0].dtype = "p_max", ir.DataType(TensorProto.FLOAT)
    graph.insert_after(softmax, extra)
    graph.outputs.append(extra.outputs[0])
    assert fuse_softmax_grad(ir.Model(graph, ir_version=9)) == 1  # the other layer's


def test_bf16_step_lowers_for_cuda_in_bf16():
    """The bf16 step (the bench's form): GELU's backward fuses in bfloat16 (the Gelu op is on
    ORT CUDA's bfloat16 kernel list at opset 20), the LayerNorms read the bfloat16 dy."""
    step = convert(build_training_graph(GPT, optimizer="adamw"), "bf16", emulate=False, validate=False, calibrate=None)
    gelu = next(n for n in step.graph if n.op_type == "Gelu")
    assert gelu.inputs[0].dtype == ir.DataType.BFLOAT16
    plan = plan_session(step, "cuda", PlanOptions(scope="all"))
    lowered = ir.from_proto(__import__("onnx").load_from_string(plan.graph))
    ops = _ops(lowered)
    assert {k: ops[k] for k in FUSED} == {"ErfGeluGrad": 2, "LayerNormGrad": 0, "LayerNormGradBias": 5,
                                          "SoftmaxGradDot": 2}
    types = {n.op_type: n.inputs[0].dtype for n in lowered.graph if n.op_type in FUSED}
    assert types == dict.fromkeys(("ErfGeluGrad", "LayerNormGradBias", "SoftmaxGradDot"), ir.DataType.BFLOAT16)


def test_an_emulated_low_precision_block_keeps_its_roundings():
    """``convert --emulate``: float32 ops that round to bfloat16 between them. Fusing the GELU's
    or the softmax's backward into a float32 kernel would drop those roundings, so both keep
    their ops; the float32 LayerNorms fuse as in the native step."""
    step = convert(build_training_graph(GPT, optimizer="adamw"), "bf16", emulate=True, validate=False, calibrate=None)
    plan = plan_session(step, "cpu", PlanOptions(scope="all"))
    applied = dict(plan.applied)
    assert (applied["gelu"], applied["softmax_grad"], applied["layernorm_grad"]) == (0, 0, 5)


def test_a_gelu_backward_partly_in_another_precision_keeps_its_ops():
    """``ErfGeluGrad`` rounds every step to x's type: where a policy computes one node of the
    rule's backward in float32 (its recorded decision), that GELU is left alone."""
    from mpgraph._ir.links import gradient_blocks
    from mpgraph._ir.meta import NODE_PRECISION
    from mpgraph.lowering.match import interior

    step = convert(build_training_graph(GPT, optimizer=None), "bf16", emulate=False, validate=False, calibrate=None)
    gelu, block = next((n, b) for n, b in gradient_blocks(step.graph).items() if n.op_type == "Gelu")
    inner = interior(block.dxs, [*block.dys, *gelu.inputs, *gelu.outputs])
    assert {n.op_type for n in inner} >= {"Erf", "Exp", "Div", "Mul", "Add"}
    next(n for n in inner if n.op_type == "Exp").metadata_props[NODE_PRECISION] = "float32"
    assert fuse_gelu(_copy(step)) == 1


# -- written-out forms, canonicalised before differentiating --------------------------------


def _written_out_block(approximate: str = "none") -> ir.Model:
    """``loss = sum(c * (gelu(LayerNorm(x w + b)) v))``, the LayerNorm written out as the
    torchscript exporter does and the GELU as its erf (or tanh) formula."""
    rng = np.random.default_rng(0)
    n = h.make_node
    nodes = [n("MatMul", ["x", "w"], ["xw"]), n("Add", ["xw", "b"], ["a"]),
             n("ReduceMean", ["a", "axes"], ["mu"], keepdims=1), n("Sub", ["a", "mu"], ["d"]),
             n("Pow", ["d", "two"], ["d2"]), n("ReduceMean", ["d2", "axes"], ["var"], keepdims=1),
             n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["sd"]), n("Div", ["d", "sd"], ["nrm"]),
             n("Mul", ["nrm", "gamma"], ["sc"]), n("Add", ["sc", "beta"], ["ln"])]
    if approximate == "none":
        nodes += [n("Div", ["ln", "sqrt2"], ["s"]), n("Erf", ["s"], ["e"]), n("Add", ["e", "one"], ["e1"]),
                  n("Mul", ["ln", "e1"], ["t"]), n("Mul", ["t", "half"], ["g"])]
    else:
        nodes += [n("Pow", ["ln", "three"], ["cube"]), n("Mul", ["cube", "k"], ["kc"]), n("Add", ["ln", "kc"], ["in"]),
                  n("Mul", ["in", "c"], ["ic"]), n("Tanh", ["ic"], ["th"]), n("Add", ["th", "one"], ["t1"]),
                  n("Mul", ["ln", "half"], ["hx"]), n("Mul", ["hx", "t1"], ["g"])]
    nodes += [n("MatMul", ["g", "v"], ["o"]), n("Mul", ["o", "cw"], ["oc"]), n("ReduceSum", ["oc"], ["loss"], keepdims=0)]
    scalars = {"two": 2.0, "eps": 1e-5, "sqrt2": np.sqrt(2.0), "one": 1.0, "half": 0.5, "three": 3.0,
               "k": 0.044715, "c": np.sqrt(2.0 / np.pi)}
    inits = [init(k, np.float32(v)) for k, v in scalars.items()]
    inits += [init("axes", np.array([-1], np.int64)), init("w", rng.standard_normal((6, 16)).astype(np.float32)),
              init("b", rng.standard_normal(16).astype(np.float32)),
              init("gamma", 1 + 0.1 * rng.standard_normal(16).astype(np.float32)),
              init("beta", 0.1 * rng.standard_normal(16).astype(np.float32)),
              init("v", rng.standard_normal((16, 4)).astype(np.float32)),
              init("cw", rng.standard_normal((5, 4)).astype(np.float32))]
    proto = make_model(nodes, [vi("x", [5, 6])], [vi("loss", [])], inits)
    return ir.from_proto(proto)


def test_written_out_layernorm_and_gelu_fuse_after_canonicalisation():
    """The written-out LayerNorm and erf GELU become ``LayerNormalization`` and ``Gelu`` by
    default, and their backwards lower as the zoo GPT's do; the lowered and unlowered steps
    agree on ORT CPU."""
    grads = build_training_graph(_written_out_block(), optimizer=None, params=["w", "b", "gamma", "beta", "v"])
    ops = _ops(grads)
    assert ops["LayerNormalization"] >= 1 and ops["Gelu"] == 1 and ops["Pow"] == 0
    plan = plan_session(grads, "cpu", PlanOptions(scope="all"))
    applied = dict(plan.applied)
    assert applied["layernorm_grad"] == 1 and applied["gelu"] == 1
    lowered = ir.from_proto(__import__("onnx").load_from_string(plan.graph))
    _agree(grads, lowered, 2e-6)


def test_a_layernorm_over_two_axes_keeps_its_backward():
    """The kernel normalises the last axis only."""
    rng = np.random.default_rng(0)
    nodes = [h.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-2),
             h.make_node("Mul", ["y", "c"], ["z"]), h.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    inits = [init("s", rng.standard_normal((3, 4)).astype(np.float32)), init("b", np.zeros((3, 4), np.float32)),
             init("c", rng.standard_normal((2, 3, 4)).astype(np.float32))]
    grads = build_training_graph(ir.from_proto(make_model(nodes, [vi("x", [2, 3, 4])], [vi("loss", [])], inits)),
                                 optimizer=None, params=["s", "b"], trainable_inputs=["x"])
    assert fuse_layernorm_grad(grads) == 0


def test_swap_backward_casts_moves_names_and_removes_what_is_dead():
    """``match.swap_backward`` on a hand-made block: the fused float32 output reaches a float16
    contribution's readers through a Cast, which takes the old value's name and graph-output
    slot; the old chain and the constant only it read go; a reader that comes before the fused
    node's inputs exist refuses the swap and leaves the graph as it was."""
    from mpgraph.lowering.match import swap_backward

    f32, f16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
    x = ir.Value(name="x", type=ir.TensorType(f32), shape=ir.Shape([4]))
    dy = ir.Value(name="dy", type=ir.TensorType(f32), shape=ir.Shape([4]))
    two = ir.Value(name="two", type=ir.TensorType(f32), shape=ir.Shape([]), const_value=ir.tensor(np.float32(2.0)))
    mul = ir.node("Mul", [dy, two], name="rule/mul")
    old = ir.node("Cast", [mul.outputs[0]], attributes={"to": f16.value}, name="rule/cast")
    old.outputs[0].name, old.outputs[0].dtype = "dx", f16
    reader = ir.node("Neg", [old.outputs[0]], name="reader")
    reader.outputs[0].name = "out"
    graph = ir.Graph([x, dy], [old.outputs[0], reader.outputs[0]], nodes=[mul, old, reader], initializers=[two],
                     opset_imports={"": 20})
    fused = ir.node("Relu", [dy], name="fused")
    fused.outputs[0].dtype = f32
    assert swap_backward(graph, fused, [old.outputs[0]])
    assert [n.op_type for n in graph] == ["Relu", "Cast", "Neg"] and "two" not in graph.initializers
    cast = graph.outputs[0].producer()
    assert graph.outputs[0].name == "dx" and cast.op_type == "Cast" and cast.inputs[0] is fused.outputs[0]
    assert reader.inputs[0] is graph.outputs[0] and graph.outputs[0].dtype == f16
    # A reader of the old value before the fused node's input exists: no place for it.
    v = ir.node("Neg", [x], name="v")
    v.outputs[0].dtype = f32
    early = ir.node("Abs", [reader.outputs[0]], name="early")
    graph.append(early)
    graph.append(v)  # made after the old value's reader ``early``
    names = [n.name for n in graph]
    late = ir.node("Relu", [v.outputs[0]], name="late")
    late.outputs[0].dtype = f32
    assert not swap_backward(graph, late, [reader.outputs[0]]) and [n.name for n in graph] == names


def test_train_graph_cli_canonical_ops_flag(tmp_path):
    """``train-graph``: GELU is canonical by default, ``--no-canonical-ops`` keeps the exporter's
    ops, ``--canonical-ops`` also rewrites the attention."""
    import onnx

    from tests.helpers import mpgraph_cli

    ops = {}
    for flag in (None, "--no-canonical-ops", "--canonical-ops"):
        out = tmp_path / f"{flag}.onnx"
        args = ["train-graph", str(GPT), "-o", str(out)] + ([flag] if flag else [])
        assert mpgraph_cli(*args).returncode == 0
        ops[flag] = Counter(n.op_type for n in onnx.load(out).graph.node)
    assert ops[None]["Gelu"] == 2 and ops[None]["Attention"] == 0
    assert ops["--no-canonical-ops"]["Gelu"] == 0 and ops["--no-canonical-ops"]["Erf"] > 0
    assert ops["--canonical-ops"]["Gelu"] == 2 and ops["--canonical-ops"]["Attention"] == 2


def test_a_specialised_graph_read_back_from_its_proto_lowers_alike():
    """Shape specialisation writes its folded shapes as ``Constant(value_ints)``; a copy of the
    graph through its proto keeps them only as that attribute (no ``const_value``), and
    ``match.constant`` reads it, so ``sce_grad`` (which checks OneHot's depth) still fuses."""
    from mpgraph.lowering.grads import fuse_sce_grad
    from mpgraph.lowering.specialize import specialize_shapes

    step = build_training_graph(GPT, optimizer="adamw", target="cuda")
    step = specialize_shapes(convert(step, "bf16", calibrate=None, validate=False), {"tokens": [2, 16], "label": [2, 16]})
    copy = ir.from_proto(ir.to_proto(step))
    assert fuse_sce_grad(step) == fuse_sce_grad(copy) == 1
