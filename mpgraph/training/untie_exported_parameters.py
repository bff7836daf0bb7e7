"""Give back the parameters torch's dynamo exporter merged, and refuse graphs where it folded some.

``torch.onnx.export(..., dynamo=True)`` runs onnxscript's optimizer by default
(``optimize=True``), which treats parameters as constants:

- ``DeduplicateInitializersPass`` keeps one initializer per distinct value of up to 1024
  elements: every unit LayerNorm weight and every zero bias of a fresh model become one
  tensor, named after the first, and the other names vanish.
- Constant folding turns ``Transpose(weight)`` (every ``nn.Linear``) and ``Gather(wpe,
  arange)`` (learned positions) into anonymous initializers (``val_28``, ``embedding_1``).
- ``RemoveOptionalBias*`` drops an all-zero bias input from Gemm and Conv.

Measured on transformers models at opset 18 (tiny configs, random init): of the parameters
the export signature lists, 11 of a 2-layer GPT-2's 29 keep an initializer of their own,
6 of DistilBERT's 40, 4 of Qwen2's 27. With ``optimize=False`` every parameter keeps its own
initializer, named by its module path.

What the graph still says: the exporter records the ``torch.export`` graph signature on the
graph (every parameter, by placeholder and module path), each initializer's role and
placeholder, the FX node each ONNX node lowers (``%layer_norm_1 = aten.layer_norm(%add_4,
[32], %p_..._ln_2_weight, %p_..._ln_2_bias, ...)``, which names the parameters that node
read before they were merged), and, on a folded initializer, the values it was folded from.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from mpgraph.errors import UnsupportedModelError

__all__ = [
    "TORCH_INPUT_KIND",
    "TORCH_SIGNATURE",
    "UntieExportedParametersPass",
    "torch_parameter_names",
    "torch_signature_parameters",
]

logger = logging.getLogger(__name__)

# Keys torch's dynamo exporter and onnxscript's optimizer write; mpgraph only reads them.
#: On the graph: ``str(ExportedProgram.graph_signature)``, one ``<placeholder>: <KIND>
#: target='<module path>'`` line per input.
TORCH_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
#: On an initializer: ``PARAMETER``, ``BUFFER`` or ``CONSTANT_TENSOR``.
TORCH_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
#: On an initializer: the FX placeholder it was (``p_model_lm_head_weight``).
_TORCH_PLACEHOLDER = "pkg.torch.onnx.original_node_name"
#: On a node: the FX node it lowers, with its arguments by placeholder name.
_TORCH_FX_NODE = "pkg.torch.onnx.fx_node"
#: On a folded initializer: the names of the values constant folding consumed.
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
_REWRITE_RULE = "pkg.onnxscript.rewriter.rule_name"

_SIGNATURE_PARAMETER = re.compile(r"^(\w+): PARAMETER target='([^']*)'", re.MULTILINE)
_FX_ARGUMENT = re.compile(r"%(\w+)")
_QUOTED = re.compile(r"'([^']*)'")

RECIPE = "torch.onnx.export(..., dynamo=True, optimize=False), or with `mpgraph export`"


def torch_signature_parameters(graph: ir.Graph) -> dict[str, str]:
    """``{placeholder: module path}`` of every parameter the export signature lists (empty
    when the graph carries none)."""
    return dict(_SIGNATURE_PARAMETER.findall(graph.metadata_props.get(TORCH_SIGNATURE, "")))


def torch_parameter_names(graph: ir.Graph) -> set[str] | None:
    """Names of the initializers torch's dynamo exporter marks as parameters, or ``None`` when
    the graph does not come from it (no role on any initializer and no signature)."""
    kinds = {name: v.metadata_props.get(TORCH_INPUT_KIND) for name, v in graph.initializers.items()}
    if any(kind is not None for kind in kinds.values()):
        return {name for name, kind in kinds.items() if kind == "PARAMETER"}
    if TORCH_SIGNATURE in graph.metadata_props:
        return set(torch_signature_parameters(graph).values()) & set(graph.initializers)
    return None


class UntieExportedParametersPass(ir.passes.InPlacePass):
    """Untie the parameters the exporter's optimizer merged; refuse the graph if it folded any.

    Applies to graphs that carry torch's export signature; any other graph is left alone.

    Rules:

    1. A parameter is *merged* when a node reads another parameter's initializer while the
       FX node it lowers names the parameter, which is no initializer any more. Example:
       ``node_layer_norm_1`` reads ``h.0.ln_1.weight`` but lowers ``aten.layer_norm(...,
       %p_h_0_ln_2_weight, %p_h_0_ln_2_bias, ...)``: it gets an initializer
       ``h.0.ln_2.weight`` of its own (same value, marked a parameter).
    2. The owner of such an input must be certain: the only missing parameter the FX node
       names, or the only one with the read initializer's last name part (``weight``,
       ``bias``), once the node's other inputs have taken theirs. Otherwise the input stays
       as it is and the parameter counts as lost.
    3. A parameter is *folded* when a folded initializer names it in its ``folded_from``
       (``embedding_1`` from ``wpe.weight``; a pre-transposed ``nn.Linear`` weight), when
       an FX node names it and, after rule 1, no node reads it (an all-zero bias dropped by
       ``RemoveOptionalBiasFromGemm``), or when its initializer lost its role, being a
       rewrite's new tensor under the old name (``FuseBatchNormIntoConv``'s conv weight).
       Nodes a rewrite made are never untied: a fused node carries the FX node of one of
       its sources, which need not name what its inputs are.
    4. Any folded, or merged and not untied, parameter refuses the graph with one line that
       counts them, names the first and gives the export recipe that keeps them (unless
       ``refuse`` is off: the user named the parameters with ``params`` and takes the
       graph as it is).
    0. First, a *pre-transposed* parameter is rebuilt (``_rebuild_transposed``): a folded
       initializer that names exactly one parameter ``P``, is 2-D and is ``P`` transposed
       becomes ``Transpose(P)`` reading an initializer ``P`` (marked a parameter), so ``P``
       trains. It is ``P`` transposed when ``P`` is still an initializer and the values are
       equal exactly, or, when the exporter dropped ``P``, when every node reading it is a
       ``MatMul`` reading it second that lowers ``aten.linear`` with ``P`` as the weight
       (``x @ P.T``); ``P`` is then the folded value transposed back. Rules 1-5 see the
       rebuilt graph, so only what is still folded counts.
    5. A parameter that no node and no folded value names is fine: torch.export passes a
       tied parameter through one placeholder (GPT-2's ``lm_head.weight`` serves ``wte``
       too), and a parameter the forward never uses has no gradient in torch either.

    Args:
        refuse: Rule 4 refuses; ``False`` (the caller names the parameters itself) logs a
            warning instead and trains the graph as it is.

    Raises:
        UnsupportedModelError: Rule 4.
    """

    def __init__(self, refuse: bool = True) -> None:
        super().__init__()
        self.refuse = refuse

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        by_placeholder = torch_signature_parameters(graph)
        if not by_placeholder:
            return ir.passes.PassResult(model, False)
        order = list(dict.fromkeys(by_placeholder.values()))
        rebuilt = _rebuild_transposed(graph, by_placeholder)
        present = {name for name in order if name in graph.initializers}
        missing = set(order) - present
        folded = _folded(graph, set(order))
        untied: dict[str, ir.Value] = {}
        named: dict[str, ir.Node] = {}
        for node in graph:
            refs = {by_placeholder[p] for p in _FX_ARGUMENT.findall(node.metadata_props.get(_TORCH_FX_NODE, ""))
                    if p in by_placeholder}
            for name in sorted(refs & missing):
                named.setdefault(name, node)
            if _REWRITE_RULE in node.metadata_props:
                continue  # a fused node carries one of its sources' FX node, not every input's
            foreign = [v.name for v in dict.fromkeys(node.inputs)
                       if v is not None and v.name in present and v.name not in refs]
            owners = _owners(foreign, refs & missing) if foreign else {}
            for slot, value in enumerate(node.inputs):
                owner = owners.get(value.name) if value is not None else None
                if value is None or owner is None:
                    continue
                if owner not in untied:
                    untied[owner] = _copy(graph, value, owner, by_placeholder)
                node.replace_input_with(slot, untied[owner])
        lost = {name: f"folded into '{folded[name]}'" for name in order if name in folded}
        if any(TORCH_INPUT_KIND in v.metadata_props for v in graph.initializers.values()):
            for name in sorted(present - set(lost)):
                value = graph.initializers[name]
                if TORCH_INPUT_KIND not in value.metadata_props:  # a rewrite replaced the tensor
                    lost[name] = _how_lost(next((use.node for use in value.uses()), None))
        for name, node in named.items():
            if name not in untied and name not in lost:
                lost[name] = _how_lost(node)
        if lost:
            first = next(name for name in order if name in lost)
            what = (f"the exporter's optimizer folded or merged {len(lost)} torch parameters into constants "
                    f"(first: '{first}', {lost[first]})")
            if self.refuse:
                raise UnsupportedModelError(f"{what}, so training this graph would train a different model; "
                                            f"re-export with {RECIPE} (or choose what trains with --params)")
            logger.warning("%s; they stay constants: the parameters are the ones --params names", what)
        if untied:
            logger.info("untied %d parameters the exporter had merged with equal-valued ones", len(untied))
        if rebuilt:
            logger.info("rebuilt %d parameters the exporter had folded into transposed constants", rebuilt)
        return ir.passes.PassResult(model, bool(untied) or rebuilt > 0)


def _rebuild_transposed(graph: ir.Graph, by_placeholder: dict[str, str]) -> int:
    """Rule 0: replace every folded ``P.T`` by ``Transpose(P)``; returns how many."""
    placeholders = {target: p for p, target in by_placeholder.items()}
    rebuilt = 0
    for name, value in list(graph.initializers.items()):
        sources = _QUOTED.findall(value.metadata_props.get(_FOLDED_FROM, ""))
        if len(sources) != 1 or sources[0] not in placeholders or value.const_value is None:
            continue
        source = sources[0]
        if value in graph.inputs or value in graph.outputs or len(value.const_value.shape) != 2:
            continue
        folded = value.const_value.numpy()
        original = graph.initializers.get(source)
        if original is not None:
            if original.const_value is None or not _equal(original.const_value.numpy(), folded.T):
                continue
        elif _reads_as_linear_weight(value, placeholders[source]):
            original = _copy(graph, value, source, by_placeholder, np.ascontiguousarray(folded.T))
        else:
            continue
        node = ir.node("Transpose", [original], {"perm": [1, 0]}, name=f"rebuild_{name}")
        graph.insert_before(next(iter(graph)), node)
        graph.initializers.pop(name)
        value.replace_all_uses_with(node.outputs[0])
        node.outputs[0].name = name
        node.outputs[0].type, node.outputs[0].shape = value.type, value.shape
        rebuilt += 1
    return rebuilt


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _reads_as_linear_weight(value: ir.Value, placeholder: str) -> bool:
    """Rule 0 without ``P``: every reader is ``MatMul(x, value)`` lowering ``aten.linear(x, P, ...)``."""
    uses = list(value.uses())
    for use in uses:
        fx = use.node.metadata_props.get(_TORCH_FX_NODE, "")
        args = _FX_ARGUMENT.findall(fx.split("args = (", 1)[-1]) if "args = (" in fx else []
        if (use.node.op_type != "MatMul" or use.node.domain not in ("", "ai.onnx") or use.idx != 1
                or "aten.linear" not in fx or len(args) < 2 or args[1] != placeholder):
            return False
    return bool(uses)


def _folded(graph: ir.Graph, parameters: set[str]) -> dict[str, str]:
    """Rule 3, first half: ``{parameter: the folded initializer}``."""
    folded: dict[str, str] = {}
    for name, value in graph.initializers.items():
        for source in _QUOTED.findall(value.metadata_props.get(_FOLDED_FROM, "")):
            if source in parameters:
                folded.setdefault(source, name)
    return folded


def _owners(reads: list[str], candidates: set[str]) -> dict[str, str]:
    """Rule 2: ``{read initializer: the missing parameter it stands for}`` where certain.

    One node's merged inputs belong to distinct parameters, so an owner, once found, is no
    candidate for the others: of ``ln_2.weight`` and ``ln_2.bias``, the bias is what is
    left after the weight went to the input that reads ``ln_1.weight``.
    """
    owners: dict[str, str] = {}
    left = set(candidates)
    found = True
    while found:
        found = False
        for read in reads:
            if read not in owners and (owner := _owner(read, left)) is not None:
                owners[read] = owner
                left.discard(owner)
                found = True
    return owners


def _owner(read: str, candidates: Iterable[str]) -> str | None:
    """The only candidate, or the only one whose last name part is ``read``'s."""
    options = sorted(candidates)
    if len(options) > 1:
        leaf = read.rsplit(".", 1)[-1]
        options = [c for c in options if c.rsplit(".", 1)[-1] == leaf]
    return options[0] if len(options) == 1 else None


def _copy(graph: ir.Graph, source: ir.Value, name: str, by_placeholder: dict[str, str],
          array: np.ndarray | None = None) -> ir.Value:
    """Rule 1: an initializer ``name`` holding ``source``'s value (or ``array``, rule 0),
    marked a parameter."""
    assert source.const_value is not None
    array = source.const_value.numpy() if array is None else array
    value = ir.Value(name=name, type=source.type, shape=ir.Shape(array.shape),
                     const_value=ir.tensor(array, name=name))
    value.metadata_props[TORCH_INPUT_KIND] = "PARAMETER"
    placeholder = next((p for p, target in by_placeholder.items() if target == name), None)
    if placeholder is not None:
        value.metadata_props[_TORCH_PLACEHOLDER] = placeholder
    graph.register_initializer(value)
    return value


def _how_lost(node: ir.Node | None) -> str:
    """Why a parameter its FX node names is read by no node, or its tensor is another one
    (rule 3, second half)."""
    if node is None:
        return "replaced by a rewritten tensor"
    rules = node.metadata_props.get(_REWRITE_RULE)
    if rules:
        return f"dropped or rewritten by {', '.join(dict.fromkeys(rules.split(', ')))} at node '{node.name}'"
    return f"merged at node '{node.name}' with no way to tell which input it was"
