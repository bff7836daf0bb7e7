"""``StepContract``: what a training step graph promises its readers, as one typed record.

A step graph (``mpgraph.training.build_training_graph``, maybe converted) carries its contract
in the model's metadata (``_ir.meta``'s keys, Netron shows them). Training writes it once
(``StepContract.write``); the passes that add state (loss scaling, fp8 scaling) write the
record they read back with that state added; the runtime, the audit, the lowering and the
data-parallel split read it (``StepContract.read``) instead of parsing keys each.

What is recorded (the serialized format is the one step graphs have always carried, so
graphs saved before this record still load):

- ``state_pairs`` (``mpgraph.state_pairs``), ``loss`` (``mpgraph.loss``), ``grad_seed``
  (``mpgraph.grad_seed``), ``gradients`` (``mpgraph.gradients``; ``None`` without an
  optimizer), ``logits`` (``mpgraph.logits``), ``forward_outputs``
  (``mpgraph.forward_outputs``), ``loss_scale`` (``mpgraph.loss_scale_state``).

What ``read`` derives from the graph (never written, so nothing can disagree with it):

- ``lr`` (the input named ``lr``), ``data_inputs`` (every other input that is not state),
  ``fp8_state`` (the fp8 scale state inputs ``mpgraph.fp8`` names), ``label_bounds`` (integer
  data inputs that are class labels of a loss op, with the class count and ignore index) and
  ``vocab`` (rows of the embedding table a data input indexes).
- For graphs saved before a key existed, what the key would have said: the loss output
  named ``loss`` (else the first output), the value named ``logits`` (else the loss op's
  scores), the loss-scale state under the names loss scaling gives it.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    >>> y = ir.Value(name="y", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([2]))
    >>> ce = ir.Node("", "SoftmaxCrossEntropyLoss", [x, y], name="ce")
    >>> ce.outputs[0].name = "loss"
    >>> model = ir.Model(ir.Graph([x, y], ce.outputs, nodes=[ce]), ir_version=8)
    >>> StepContract(state_pairs=(), loss="loss").write(model)
    >>> contract = StepContract.read(model)
    >>> contract.logits, contract.data_inputs, dict(contract.label_bounds)
    ('x', ('x', 'y'), {'y': (3, None)})
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import onnx_ir as ir

from mpgraph._ir import meta as md

__all__ = ["LOSS_OPS", "LR_INPUT", "LossScaleState", "StepContract"]

#: The ops that compute a loss from logits (both torch exporters emit them for cross-entropy).
LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
#: The learning-rate input of a step graph with an optimizer.
LR_INPUT = "lr"
#: Ops a label may pass through on its way to the loss op (shape-only).
_LABEL_PASSTHROUGH = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast")


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The loss-scale state ``ScaleLossPass`` added: the ``found_inf`` output, and in dynamic
    mode the ``scale`` and ``growth_tracker`` state inputs (``None`` in static mode)."""

    found_inf: str
    scale: str | None = None
    growth_tracker: str | None = None

    @classmethod
    def read(cls, model: ir.Model) -> LossScaleState | None:
        """The loss-scale state ``model`` records, or ``None``: what ``StepContract.read`` gives
        as ``loss_scale``, for a step graph and for a part of one (``split_step_graph``'s
        apply part keeps the record but no state pairs), ``scale`` and ``growth_tracker``
        kept where they are graph inputs."""
        graph = model.graph
        return _loss_scale(model.metadata_props, {v.name or "" for v in graph.outputs},
                           {v.name or "" for v in graph.inputs})

    def to_json(self) -> str:
        record = {"found_inf": self.found_inf}
        if self.scale is not None:
            record["scale"] = self.scale
        if self.growth_tracker is not None:
            record["growth_tracker"] = self.growth_tracker
        return json.dumps(record)


@dataclasses.dataclass(frozen=True)
class StepContract:
    """The contract of one training step graph (see the module docstring for each field).

    Only the recorded fields are written; the derived ones (``lr``, ``data_inputs``,
    ``fp8_state``, ``label_bounds``, ``vocab``) are filled by ``read`` from the graph.
    """

    state_pairs: tuple[tuple[str, str], ...]
    loss: str | None = None
    grad_seed: str | None = None
    gradients: tuple[tuple[str, str], ...] | None = None
    logits: str | None = None
    forward_outputs: tuple[str, ...] | None = None
    loss_scale: LossScaleState | None = None
    lr: str | None = None
    data_inputs: tuple[str, ...] = ()
    fp8_state: tuple[str, ...] = ()
    label_bounds: Mapping[str, tuple[int, int | None]] = dataclasses.field(default_factory=dict)
    vocab: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def state_inputs(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.state_pairs)

    @property
    def state_outputs(self) -> tuple[str, ...]:
        return tuple(b for _, b in self.state_pairs)

    def write(self, model: ir.Model) -> None:
        """Record the contract in ``model``'s metadata (a step graph from now on).

        Keys are set in a fixed order, and a key present already keeps its place, so a step
        graph's bytes do not depend on who wrote the record. ``None`` fields are left out.
        """
        props = model.metadata_props
        recorded = {
            md.MODEL_GRAD_SEED: self.grad_seed,
            md.MODEL_LOSS: self.loss,
            md.MODEL_GRADIENTS: None if self.gradients is None else json.dumps([list(p) for p in self.gradients]),
            md.MODEL_STATE_PAIRS: json.dumps([list(p) for p in self.state_pairs]),
            md.MODEL_TRAINING: "true",
            md.MODEL_LOGITS: self.logits,
            md.MODEL_FORWARD_OUTPUTS: None if self.forward_outputs is None else json.dumps(list(self.forward_outputs)),
            md.MODEL_LOSS_SCALE_STATE: None if self.loss_scale is None else self.loss_scale.to_json(),
        }
        for key, text in recorded.items():
            if text is not None:
                props[key] = text

    def record_state(self, model: ir.Model) -> None:
        """Record only the state fields (``state_pairs``, and ``loss_scale`` unless ``None``):
        what a pass that adds state inputs (loss scaling, fp8 scaling) writes, leaving every
        other key as the graph had it (``read``'s guesses for older graphs are not written)."""
        props = model.metadata_props
        props[md.MODEL_STATE_PAIRS] = json.dumps([list(p) for p in self.state_pairs])
        if self.loss_scale is not None:
            props[md.MODEL_LOSS_SCALE_STATE] = self.loss_scale.to_json()

    @classmethod
    def recorded(cls, model: ir.Model) -> bool:
        """Whether ``model`` is a step graph (it records state pairs)."""
        return md.MODEL_STATE_PAIRS in model.metadata_props

    @classmethod
    def read(cls, model: ir.Model) -> StepContract:
        """The contract ``model`` records, with the derived fields filled from its graph.

        Raises:
            ValueError: ``model`` is not a step graph (no ``mpgraph.state_pairs``); callers
                turn it into their own error, naming what they needed.
        """
        props, graph = model.metadata_props, model.graph
        if md.MODEL_STATE_PAIRS not in props:
            raise ValueError(f"not a training step graph (no '{md.MODEL_STATE_PAIRS}' metadata)")
        pairs = tuple((str(a), str(b)) for a, b in json.loads(props[md.MODEL_STATE_PAIRS]))
        outputs = [v.name or "" for v in graph.outputs]
        state = {a for a, _ in pairs}
        gradients = props.get(md.MODEL_GRADIENTS)
        forward = props.get(md.MODEL_FORWARD_OUTPUTS)
        data = tuple(v.name for v in graph.inputs if v.name and v.name not in state and v.name != LR_INPUT)
        return cls(
            state_pairs=pairs,
            loss=props.get(md.MODEL_LOSS) or ("loss" if "loss" in outputs else (outputs[0] if outputs else None)),
            grad_seed=props.get(md.MODEL_GRAD_SEED),
            gradients=None if gradients is None else tuple((str(p), str(g)) for p, g in json.loads(gradients)),
            logits=props.get(md.MODEL_LOGITS) or _guess_logits(graph),
            forward_outputs=None if forward is None else tuple(json.loads(forward)),
            loss_scale=_loss_scale(props, set(outputs), state),
            lr=LR_INPUT if any(v.name == LR_INPUT for v in graph.inputs) else None,
            data_inputs=data,
            fp8_state=_fp8_state(props, state),
            label_bounds=_label_bounds(graph, data),
            vocab=_vocab(graph, data),
        )


def _guess_logits(graph: ir.Graph) -> str | None:
    """For graphs saved before ``mpgraph.logits``: the value named ``logits``, else the scores
    input of the loss op (what training records), else ``None``."""
    if any(v.name == "logits" for node in graph for v in node.outputs):
        return "logits"
    for node in graph:
        if node.op_type in LOSS_OPS and node.inputs and node.inputs[0] is not None and node.inputs[0].name:
            return node.inputs[0].name
    return None


def _loss_scale(props: Mapping[str, str], outputs: set[str], state: set[str]) -> LossScaleState | None:
    """The recorded loss-scale state, each name kept only where the graph has it; for graphs
    saved before the record, the names loss scaling gives its state."""
    raw = props.get(md.MODEL_LOSS_SCALE_STATE)
    if raw is None:
        found, scale, tracker = md.FOUND_INF, md.LOSS_SCALE, md.GROWTH_TRACKER
    else:
        record = json.loads(raw)
        found, scale, tracker = record.get("found_inf"), record.get("scale"), record.get("growth_tracker")
    if found not in outputs:
        return None
    return LossScaleState(found, scale if scale in state else None, tracker if tracker in state else None)


def _fp8_state(props: Mapping[str, str], state: set[str]) -> tuple[str, ...]:
    """The fp8 scale state inputs (delayed scaling's scales and amax history) ``mpgraph.fp8``
    names, in its order; empty without fp8 or with current scaling."""
    raw = props.get(md.MODEL_FP8)
    if raw is None:
        return ()
    names: dict[str, None] = {}
    for tensor in json.loads(raw).get("tensors", []):
        for key in ("scale", "history"):
            if tensor.get(key) in state:
                names[tensor[key]] = None
    return tuple(names)


def _label_bounds(graph: ir.Graph, data: tuple[str, ...]) -> dict[str, tuple[int, int | None]]:
    """Integer data inputs that are class labels of a loss op: (classes, ignore_index).

    The label may reach the loss through shape-only ops (``Reshape``, ``Flatten``, ...). The
    class count is the loss's score input's dimension 1 when it is static
    (``SoftmaxCrossEntropyLoss``/``NegativeLogLikelihoodLoss`` take ``[N, C, ...]``).
    """
    inputs = {v.name: v for v in graph.inputs}
    origin = {name: name for name in data
              if inputs[name].dtype is not None and inputs[name].dtype.is_integer()}
    out: dict[str, tuple[int, int | None]] = {}
    for node in graph:  # topological order: a label's reshapes come first
        first = node.inputs[0] if node.inputs else None
        if node.op_type in _LABEL_PASSTHROUGH and first is not None and first.name in origin:
            for o in node.outputs:
                origin[o.name or ""] = origin[first.name]
            continue
        if node.op_type not in LOSS_OPS or len(node.inputs) < 2:
            continue
        scores, labels = node.inputs[0], node.inputs[1]
        if labels is None or labels.name not in origin or scores is None or scores.shape is None:
            continue
        if len(scores.shape) < 2 or not isinstance(scores.shape[1], int):
            continue
        attr = node.attributes.get("ignore_index")
        out[origin[labels.name]] = (int(scores.shape[1]), int(attr.as_int()) if attr is not None else None)
    return out


def _vocab(graph: ir.Graph, data: tuple[str, ...]) -> dict[str, int]:
    """Rows of the embedding table each data input indexes (the first Gather on it)."""
    wanted, out = set(data), {}
    for node in graph:
        if node.op_type != "Gather" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        name, table = node.inputs[1].name, node.inputs[0]
        if name in wanted and name not in out and table is not None and table.shape is not None \
                and isinstance(table.shape[0], int):
            out[name] = int(table.shape[0])
    return out
