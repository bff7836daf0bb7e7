"""Load a forward model and put it in the form the other training passes expect."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mpgraph._ir.contract import StepContract
from mpgraph._ir.names import NameScope
from mpgraph.dtypes import FLOAT_TYPES
from mpgraph.errors import UnsupportedModelError, first_line
from mpgraph.io import ModelLike, as_proto
from mpgraph.training.fold_constant_subgraphs import FoldConstantSubgraphsPass
from mpgraph.training.untie_exported_parameters import TORCH_INPUT_KIND, UntieExportedParametersPass

__all__ = ["MIN_OPSET", "ForwardModel", "NormalizeForwardPass", "load_forward", "refuse_step_graph"]

logger = logging.getLogger(__name__)

#: The opset every step graph is built at; older models are upgraded to it.
MIN_OPSET = 18


@dataclasses.dataclass(frozen=True)
class ForwardModel:
    """A loaded forward model and what loading learned about it.

    Attributes:
        model: The model as onnx-ir, at opset >= ``MIN_OPSET``, with inferred shapes.
        inputs_mark_params: Whether graph inputs can mark parameters (IR < 4 lists every
            initializer as an input, so they cannot).
        opset: The model's own opset (errors name it, not the one it was upgraded to).
    """

    model: ir.Model
    inputs_mark_params: bool
    opset: int


def load_forward(model: ModelLike) -> ForwardModel:
    """Load ``model`` (a copy: the caller's object is never changed) and upgrade its opset.

    Raises:
        ModelLoadError: A path that ``mpgraph.io.load_proto`` refuses.
        UnsupportedModelError: Control flow, or an opset the converter cannot upgrade.
    """
    proto = as_proto(model)
    if any(n.op_type in ("If", "Loop", "Scan") for n in proto.graph.node):
        raise UnsupportedModelError("control flow (If/Loop/Scan) is not supported by train-graph")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET)
    inputs_mark_params = proto.ir_version >= 4
    if opset < 7:
        _legacy_prelu_slopes(proto)
    if opset < MIN_OPSET:
        proto.ir_version = max(proto.ir_version, 8)
        added = _inputs_for_initializers(proto)
        try:
            proto = onnx.version_converter.convert_version(proto, MIN_OPSET)
        except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors
            raise UnsupportedModelError(f"cannot upgrade opset {opset} to {MIN_OPSET}: {first_line(e)}") from None
        # The inputs were the converter's requirement, not the model's: a float graph input
        # with an initializer marks a parameter (SelectParametersPass), so left in place they
        # made every constant initializer (a 0.5, a LayerNorm epsilon) a trained parameter.
        _drop_inputs(proto, added)
    try:
        proto = _infer_shapes(proto)
    except Exception as e:  # noqa: BLE001
        logger.warning("shape inference failed (%s); continuing with partial shapes", e)
    return ForwardModel(ir.from_proto(proto), inputs_mark_params, opset)


def _infer_shapes(proto: onnx.ModelProto, keep: int = 4096) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(proto, data_prop=True)``, at any size: over
    ``CHECK_WITHOUT_WEIGHTS_BYTES`` of float initializers (protobuf cannot serialise 2 GiB for it:
    a 540M-parameter export) it infers without their bytes, which inference does not read, and
    puts them back after; ``proto`` then gets the inferred value types."""
    from mpgraph.io import CHECK_WITHOUT_WEIGHTS_BYTES

    big = [t for t in proto.graph.initializer if t.data_type in FLOAT_TYPES and len(t.raw_data) > keep]
    if sum(len(t.raw_data) for t in big) < CHECK_WITHOUT_WEIGHTS_BYTES:
        return onnx.shape_inference.infer_shapes(proto, data_prop=True)
    saved = [t.raw_data for t in big]
    for tensor in big:
        tensor.ClearField("raw_data")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    finally:
        for tensor, data in zip(big, saved, strict=True):
            tensor.raw_data = data
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(inferred.graph.value_info)
    return proto


def refuse_step_graph(model: ir.Model, source: object) -> None:
    """Refuse a training step graph where a forward model belongs (``source`` names it).

    Raises:
        UnsupportedModelError: ``model`` was built by ``train-graph``.
    """
    if StepContract.recorded(model) or StepContract.is_training(model):
        raise UnsupportedModelError(f"{source}: is already a training step graph (built by `mpgraph train-graph`); "
                                    "give the forward model")


def _legacy_prelu_slopes(proto: onnx.ModelProto) -> None:
    """Before opset 7 a 1-D PRelu slope applied per channel; make that explicit ([C, 1, ...])."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in list(inferred.graph.input) + list(inferred.graph.value_info)}
    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "PRelu" or node.input[1] not in inits:
            continue
        slope, rank = inits[node.input[1]], ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            new_dims = [slope.dims[0]] + [1] * (rank - 2)
            del slope.dims[:]
            slope.dims.extend(new_dims)
            for value in proto.graph.input:
                if value.name == slope.name:
                    _set_dims(value.type.tensor_type.shape, new_dims)


def _inputs_for_initializers(proto: onnx.ModelProto) -> set[str]:
    """Old IR versions list initializers as inputs; newer converters reject the mismatch. The
    names of the inputs added."""
    names = {i.name for i in proto.graph.input}
    added = set()
    for init in proto.graph.initializer:
        if init.name not in names:
            value = proto.graph.input.add(name=init.name)
            value.type.tensor_type.elem_type = init.data_type
            _set_dims(value.type.tensor_type.shape, list(init.dims))
            added.add(init.name)
    return added


def _drop_inputs(proto: onnx.ModelProto, names: set[str]) -> None:
    """Remove the graph inputs named ``names`` (their initializers stay)."""
    kept = [i for i in proto.graph.input if i.name not in names]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)


def _set_dims(shape: onnx.TensorShapeProto, dims: list[int]) -> None:
    """Make ``shape`` exactly ``dims`` (present even when empty: a scalar, not an unknown rank)."""
    shape.SetInParent()
    del shape.dim[:]
    for d in dims:
        shape.dim.add(dim_value=d)


class NormalizeForwardPass(ir.passes.InPlacePass):
    """Put a loaded forward model (``load_forward``) in the form the training passes expect.

    Rules, in order:

    1. The default opset is recorded as at least ``MIN_OPSET`` (``load_forward`` upgraded
       the ops).
    2. BatchNorm layers the exporter folded into convolutions are named in a warning (the
       graph trains a model without them); nothing changes.
    3. Unnamed nodes are named ``<op_type>_<index>``, unnamed outputs ``<node>/output_<k>``
       (with ``_1``, ``_2``... when the name is taken).
    4. Parameters torch's dynamo exporter merged are untied, and a graph where it folded
       parameters into constants is refused (``UntieExportedParametersPass``), unless
       ``params`` names the parameters.
    5. A ``ConstantOfShape`` with a constant shape and a float fill (as in compressed "light"
       model files) becomes an initializer: a weight.
    6. Float initializers the TorchScript exporter deduplicated behind ``Identity`` nodes are
       untied: each Identity-named value becomes an initializer of its own.
    7. A ``SplitToSequence`` read only by ``SequenceAt`` nodes with constant positions (the
       dynamo exporter's ``torch.split`` without its optimizer) becomes one ``Split``.
    8. Constant-only subgraphs are folded (``FoldConstantSubgraphsPass``; ``params`` as in
       ``SelectParametersPass``).
    9. A ``RotaryEmbedding`` without ``position_ids`` whose cos/sin caches may have another
       batch size than its input (HF's ``(1, S, d)`` caches) reads them expanded to it.

    Example:
        >>> import numpy as np
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
        >>> dims = ir.Value(name="dims", const_value=ir.tensor(np.int64([2]), name="dims"))
        >>> half = ir.AttrTensor("value", ir.tensor(np.float32([0.5])))
        >>> fill = ir.Node("", "ConstantOfShape", [dims], [half], name="fill")
        >>> fill.outputs[0].name = "w"
        >>> mul = ir.Node("", "Mul", [x, fill.outputs[0]], name="mul")
        >>> graph = ir.Graph([x], mul.outputs, nodes=[fill, mul], initializers=[dims], opset_imports={"": 18})
        >>> NormalizeForwardPass(inputs_mark_params=True)(ir.Model(graph, ir_version=8)).modified
        True
        >>> [n.name for n in graph], graph.initializers["w"].const_value.numpy().tolist()
        (['mul'], [0.5, 0.5])
    """

    def __init__(self, inputs_mark_params: bool, params: Sequence[str] = ()) -> None:
        super().__init__()
        self.inputs_mark_params = inputs_mark_params
        self.params = tuple(params)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = max(graph.opset_imports.get("", MIN_OPSET), MIN_OPSET)
        modified = graph.opset_imports.get("") != opset
        graph.opset_imports[""] = opset
        _warn_folded_batchnorm(graph)
        modified = _name_nodes(graph) > 0 or modified
        modified = UntieExportedParametersPass(refuse=not self.params)(model).modified or modified
        modified = _materialize_constant_weights(graph) > 0 or modified
        modified = _untie_identity_initializers(graph) > 0 or modified
        modified = _split_sequences(graph) > 0 or modified
        modified = FoldConstantSubgraphsPass(self.inputs_mark_params, self.params)(model).modified or modified
        modified = _expand_rotary_caches(graph) > 0 or modified
        return ir.passes.PassResult(model, modified)


def _warn_folded_batchnorm(graph: ir.Graph) -> list[str]:
    """Warn when the exporter folded BatchNorm layers into convolutions (and name them).

    torch's dynamo exporter runs onnxscript's ``FuseBatchNormIntoConv`` even on a module in
    train mode (``training=TrainingMode.TRAINING`` changes nothing): the running statistics
    are baked into the conv weights and the BatchNorm is gone, so training the graph trains a
    different model. The rewriter stamps the rule name on the fused node; the conv also keeps
    the BatchNorm's torch class in its provenance metadata.
    """
    fused = [n.name or n.op_type for n in graph
             if "FuseBatchNorm" in n.metadata_props.get("pkg.onnxscript.rewriter.rule_name", "")
             or (n.op_type in ("Conv", "ConvTranspose", "Gemm")
                 and "torch.nn.modules.batchnorm" in n.metadata_props.get("pkg.torch.onnx.class_hierarchy", ""))]
    if fused:
        logger.warning(
            "%d BatchNorm layers were folded into the preceding convolution by the exporter (first: node '%s'); "
            "training this graph trains a model without them. Export with torch.onnx.export(dynamo=False), or "
            "dynamo=True with optimize=False", len(fused), fused[0],
        )
    return fused


def _name_nodes(graph: ir.Graph) -> int:
    """Rule 3; returns how many names were given (fresh ones: ``_1``, ``_2``... on a clash)."""
    names = NameScope(graph)
    named = 0
    for i, node in enumerate(graph):
        if not node.name:
            node.name = names.fresh(f"{node.op_type}_{i}")
            named += 1
        for k, out in enumerate(node.outputs):
            if not out.name:
                out.name = names.fresh(f"{node.name}/output_{k}")
                named += 1
    return named


def _materialize_constant_weights(graph: ir.Graph) -> int:
    """Rule 5; returns how many ``ConstantOfShape`` nodes became initializers."""
    count = 0
    for node in list(graph):
        if node.op_type != "ConstantOfShape" or node.outputs[0].is_graph_output():
            continue
        dims = ir.convenience.get_const_tensor(node.inputs[0]) if node.inputs[0] is not None else None
        if dims is None:
            continue
        attr = node.attributes.get("value")
        fill = attr.value.numpy().reshape(-1) if attr is not None else np.zeros(1, np.float32)
        if fill.dtype.kind != "f" or dims.numpy().size == 0:
            continue
        out = node.outputs[0]
        array = np.full([int(d) for d in dims.numpy()], fill[0], dtype=fill.dtype)
        value = ir.Value(name=out.name, const_value=ir.tensor(array, name=out.name),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=ir.Shape(array.shape))
        out.name = None
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        graph.register_initializer(value)
        count += 1
    return count


def _untie_identity_initializers(graph: ir.Graph) -> int:
    """Give every float initializer reached through an ``Identity`` its own initializer.

    The TorchScript exporter deduplicates equal-valued initializers (all LayerNorm weights, all
    zero biases, BatchNorm scales and running variances) and brings each dropped one back as an
    ``Identity`` named after it. torch trains those tensors apart, so each Identity-named value
    becomes a separate initializer (a parameter, or BatchNorm state) with the same value.
    Truly tied weights (GPT-2's lm_head and wte) are one initializer used directly, with no
    Identity, and stay tied. Returns the number of untied values.
    """
    untied = 0
    for node in list(graph):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        source, out = node.inputs[0], node.outputs[0]
        if (source is None or not source.is_initializer() or source.const_value is None
                or source.dtype not in FLOAT_TYPES or out.is_graph_output() or not out.name):
            continue
        if TORCH_INPUT_KIND in source.metadata_props:
            continue  # the dynamo exporter's Identity is torch's clone or alias: the same tensor
        name = out.name
        tensor = ir.tensor(source.const_value.numpy(), name=name)
        value = ir.Value(name=None, type=source.type, shape=source.shape, const_value=tensor)
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        out.name = None
        value.name = name
        graph.register_initializer(value)
        if source.is_graph_input():  # parameters marked as graph inputs: the copy is one too
            graph.inputs.insert(graph.inputs.index(source) + 1, value)
        untied += 1
    if untied:
        logger.info("untied %d initializers that the exporter had deduplicated behind Identity nodes", untied)
    return untied


def _split_sequences(graph: ir.Graph) -> int:
    """Rule 7; returns how many ``SplitToSequence`` nodes became ``Split``.

    Without its optimizer the dynamo exporter writes ``torch.split`` (GPT-2's q/k/v) as
    ``SplitToSequence`` then one ``SequenceAt`` per piece; sequences have no gradient rules,
    and the same pieces as plain outputs of a ``Split`` do.
    """
    splits = [n for n in graph if n.op_type == "SplitToSequence" and n.domain in ("", "ai.onnx")]
    names = NameScope(graph) if splits else None
    count = 0
    for node in splits:
        assert names is not None
        readers = [use.node for use in node.outputs[0].uses()]
        sizes = _split_sizes(node)
        if (sizes is None or not readers or node.outputs[0].is_graph_output()
                or any(r.op_type != "SequenceAt" or r.domain not in ("", "ai.onnx") for r in readers)):
            continue
        positions = [_const_int(r.inputs[1]) for r in readers]
        if any(p is None or not -len(sizes) <= p < len(sizes) for p in positions):
            continue
        axis = node.attributes.get_int("axis", 0)
        split_sizes = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(sizes, np.int64)))],
                              name=names.fresh(f"{node.name}/sizes"))
        split_sizes.outputs[0].name = split_sizes.name
        split = ir.Node("", "Split", [node.inputs[0], split_sizes.outputs[0]], [ir.AttrInt64("axis", axis)],
                        num_outputs=len(sizes), name=names.fresh(f"{node.name}/split"))
        pieces = list(split.outputs)
        for k, piece in enumerate(pieces):
            piece.name = names.fresh(f"{split.name}/output_{k}")
        graph.insert_before(node, [split_sizes, split])
        if len(node.inputs) < 2 and node.attributes.get_int("keepdims", 1) == 0:
            axes = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array([axis], np.int64)))],
                           name=names.fresh(f"{node.name}/axes"))
            axes.outputs[0].name = axes.name
            squeezes = [ir.Node("", "Squeeze", [p, axes.outputs[0]], name=names.fresh(f"{node.name}/squeeze"))
                        for p in pieces]
            graph.insert_before(node, [axes, *squeezes])
            pieces = [s.outputs[0] for s in squeezes]
            for squeeze, piece in zip(squeezes, pieces, strict=True):
                piece.name = names.fresh(f"{squeeze.name}/output_0")
        renamed: set[ir.Value] = set()
        for reader, position in zip(readers, positions, strict=True):
            out, piece = reader.outputs[0], pieces[position % len(sizes)]
            name = out.name
            out.replace_all_uses_with(piece, replace_graph_outputs=True)
            out.name = None
            if name is not None and piece not in renamed:  # the first reader's name stays
                piece.name = name
                renamed.add(piece)
            graph.remove(reader, safe=True)
        graph.remove(node, safe=True)
        count += 1
    return count


def _split_sizes(node: ir.Node) -> list[int] | None:
    """The piece sizes of a ``SplitToSequence``, when its ``split`` and the split dimension
    allow knowing them before it runs."""
    x = node.inputs[0]
    axis = node.attributes.get_int("axis", 0)
    split = ir.convenience.get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if len(node.inputs) > 1 and node.inputs[1] is not None and split is None:
        return None
    if split is not None and split.shape is not None and len(split.shape) == 1:
        return [int(s) for s in split.numpy()]
    rank = len(x.shape) if x is not None and x.shape is not None else None
    dim = x.shape[axis % rank] if x is not None and x.shape is not None and rank else None
    if not isinstance(dim, int):
        return None
    if split is None:
        return [1] * dim
    size = int(split.numpy())
    if size <= 0:
        return None
    return [size] * (dim // size) + ([dim % size] if dim % size else [])


def _const_int(value: ir.Value | None) -> int | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None or tensor.numpy().size != 1 else int(tensor.numpy().reshape(-1)[0])


def _expand_rotary_caches(graph: ir.Graph) -> int:
    """Rule 9; returns how many ``RotaryEmbedding`` nodes now read expanded caches.

    Without ``position_ids`` the spec gives the caches the shape ``(batch, sequence,
    rotary_dim / 2)``, and ONNX Runtime (CPU and CUDA: ``rotary_embedding_helper::
    CheckInputs``) requires that batch to be the input's. Caches computed for one row of
    positions, ``(1, S, d)`` as HF's ``cos``/``sin`` (torch broadcasts them), are refused:
    "Inputs 'cos_cache' and 'sin_cache' are expected to have the same shape as input 'x',
    got 1 and S". So both are expanded to ``(B, 1, 1)``, B the input's first dimension,
    before the node; the backward rule (``RotaryEmbedding(dy, cos, -sin)``) reads them too.
    Left alone: nodes with ``position_ids`` (2-D caches), caches of another rank, and caches
    whose first dimension is statically the input's.
    """
    nodes = [n for n in graph if n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx")
             and (len(n.inputs) < 4 or n.inputs[3] is None)]
    names = NameScope(graph) if nodes else None
    count = 0
    for node in nodes:
        assert names is not None
        x, cos, sin = node.inputs[:3]
        if x is None or cos is None or sin is None or not all(_rank_may_be(v, 3) for v in (cos, sin)):
            continue
        batch = x.shape[0] if x.shape is not None and len(x.shape) > 0 else None
        if isinstance(batch, int) and all(v.shape is not None and v.shape[0] == batch for v in (cos, sin)):
            continue
        first = ir.Node("", "Shape", [x], [ir.AttrInt64("start", 0), ir.AttrInt64("end", 1)],
                        name=names.fresh(f"{node.name}/batch"))
        ones = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.ones(2, np.int64)))],
                       name=names.fresh(f"{node.name}/ones"))
        shape = ir.Node("", "Concat", [first.outputs[0], ones.outputs[0]], [ir.AttrInt64("axis", 0)],
                        name=names.fresh(f"{node.name}/cache_shape"))
        expands = [ir.Node("", "Expand", [cache, shape.outputs[0]], name=names.fresh(f"{node.name}/{part}"))
                   for cache, part in ((cos, "cos"), (sin, "sin"))]
        for new in (first, ones, shape, *expands):
            new.outputs[0].name = new.name
        graph.insert_before(node, [first, ones, shape, *expands])
        node.replace_input_with(1, expands[0].outputs[0])
        node.replace_input_with(2, expands[1].outputs[0])
        count += 1
    return count


def _rank_may_be(value: ir.Value, rank: int) -> bool:
    return value.shape is None or len(value.shape) == rank
