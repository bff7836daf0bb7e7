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

__all__ = ["KEYS", "LOSS_OPS", "LR_INPUT", "LossScaleState", "StepContract", "check_recorded"]

#: The ops that compute a loss from logits (both torch exporters emit them for cross-entropy).
LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
#: The learning-rate input of a step graph with an optimizer.
LR_INPUT = "lr"
#: Ops a label may pass through on its way to the loss op (shape-only).
_LABEL_PASSTHROUGH = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast")
#: The metadata key of each recorded field (``training`` is the flag ``write`` sets).
KEYS = {
    "grad_seed": md.MODEL_GRAD_SEED,
    "loss": md.MODEL_LOSS,
    "gradients": md.MODEL_GRADIENTS,
    "state_pairs": md.MODEL_STATE_PAIRS,
    "training": md.MODEL_TRAINING,
    "logits": md.MODEL_LOGITS,
    "forward_outputs": md.MODEL_FORWARD_OUTPUTS,
    "loss_scale": md.MODEL_LOSS_SCALE_STATE,
}


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

    @classmethod
    def recorded(cls, model: ir.Model) -> bool:
        """Whether ``model`` records loss-scale state (``mpgraph.loss_scale_state``): loss
        scaling ran, whether or not the names still resolve (``read`` then gives ``None``)."""
        return KEYS["loss_scale"] in model.metadata_props

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
        return KEYS["state_pairs"] in model.metadata_props

    @classmethod
    def is_training(cls, model: ir.Model) -> bool:
        """Whether ``model`` is marked a training step graph (``mpgraph.training`` is ``true``,
        as ``write`` records it; ``split_step_graph``'s parts and inference models are not)."""
        return model.metadata_props.get(KEYS["training"]) == "true"

    @classmethod
    def missing(cls, model: ir.Model, *fields: str) -> list[str]:
        """The metadata keys of the recorded ``fields`` (``KEYS``' names) that ``model`` lacks,
        in the order asked: what a reader needing them names in its error."""
        return [KEYS[f] for f in fields if KEYS[f] not in model.metadata_props]

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


def check_recorded(props: Mapping[str, str], *, inputs: set[str], outputs: set[str], values: set[str]) -> None:
    """The contract's keys in ``props``, strictly: each well formed and naming a real value.

    ``read`` is lenient on purpose (it fills in what older graphs lack and keeps only names
    that resolve); this is the check at the load boundary (``mpgraph.io.check_metadata``),
    on names alone, so that it runs on the file's proto before anything is built from it.

    Rules:
        1. ``state_pairs`` and ``gradients`` are JSON lists of ``[name, name]`` string pairs;
           a state pair is (graph input, graph output), a gradient pair (graph input, value).
        2. ``loss`` and ``grad_seed`` name values of the graph.
        3. ``training`` is ``true`` or ``false``.
        4. ``loss_scale_state`` is a JSON object whose ``found_inf`` names a graph output and
           whose ``scale`` and ``growth_tracker`` (when present) name graph inputs.

    Args:
        props: The model's metadata.
        inputs, outputs: The graph's input and output names.
        values: Every value name of the graph (inputs, initializers, node outputs).

    Raises:
        ValueError: Naming the key and what is wrong with it (the caller adds the file).

    Example:
        >>> check_recorded({"mpgraph.loss": "nowhere"}, inputs={"x"}, outputs={"y"}, values={"x", "y"})
        Traceback (most recent call last):
        ...
        ValueError: metadata 'mpgraph.loss' names 'nowhere', which is not a value of the graph
    """
    for key, first_in, second_in, what in ((KEYS["state_pairs"], inputs, outputs, "graph output"),
                                           (KEYS["gradients"], inputs, values, "value")):
        if key not in props:
            continue
        pairs = _json(props, key)
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
            raise ValueError(f"metadata '{key}' should be a JSON list of [name, name] pairs")
        for a, b in pairs:
            if a not in first_in:
                raise ValueError(f"metadata '{key}' names '{a}', which is not a graph input")
            if b not in second_in:
                raise ValueError(f"metadata '{key}' names '{b}', which is not a {what} of the graph")
    for key in (KEYS["loss"], KEYS["grad_seed"]):
        if key in props and props[key] not in values:
            raise ValueError(f"metadata '{key}' names '{props[key]}', which is not a value of the graph")
    key = KEYS["training"]
    if key in props and props[key] not in ("true", "false"):
        raise ValueError(f"metadata '{key}' should be true or false, got {props[key][:40]!r}")
    if KEYS["loss_scale"] in props:
        _check_loss_scale(_json(props, KEYS["loss_scale"]), inputs, outputs)


def _json(props: Mapping[str, str], key: str) -> object:
    try:
        return json.loads(props[key])
    except (ValueError, RecursionError) as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]  # errors.first_line's rule
        raise ValueError(f"metadata '{key}' is not valid JSON ({cause})") from e


def _check_loss_scale(state: object, inputs: set[str], outputs: set[str]) -> None:
    key = KEYS["loss_scale"]
    if not isinstance(state, dict) or "found_inf" not in state:
        raise ValueError(f"metadata '{key}' should be a JSON object naming found_inf")
    for role, name in state.items():
        where = outputs if role == "found_inf" else inputs
        if role not in ("found_inf", "scale", "growth_tracker") or not isinstance(name, str) or name not in where:
            raise ValueError(f"metadata '{key}' names {role} {name!r}, which is not a graph "
                             f"{'output' if role == 'found_inf' else 'input'} (roles: found_inf, scale, growth_tracker)")


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
