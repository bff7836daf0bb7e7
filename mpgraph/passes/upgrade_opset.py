"""UpgradeOpsetPass: raise the model's opset until its ops admit the policy's low dtype.

bfloat16 arrived in op schemas at opset 13 (ConvTranspose at 28): a model exported at opset 9
can lower nothing to bfloat16 until it is upgraded. ``onnx.version_converter`` does the upgrade.

Example:
    >>> from mpgraph.policy import load_policy
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 2]))
    >>> node = ir.Node("", "MatMul", [x, x], name="mm")
    >>> node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    >>> node.metadata_props["mpgraph.role"] = "forward"
    >>> model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 12}), ir_version=7)
    >>> UpgradeOpsetPass(load_policy("bf16"))(model).modified
    True
    >>> model.opset_imports[""], model.metadata_props["mpgraph.opset_upgraded"]
    (13, '12->13')
    >>> model.graph.node("mm").metadata_props["mpgraph.role"]
    'forward'
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx import version_converter

from mpgraph._ir import meta as md
from mpgraph.errors import first_line
from mpgraph.io import min_ir_version
from mpgraph.optypes import node_typing
from mpgraph.passes.quantize_fp8 import FP8_MIN_OPSET
from mpgraph.policy import Policy

__all__ = ["MAX_UPGRADE_OPSET", "UpgradeOpsetPass", "needed_opset"]

logger = logging.getLogger(__name__)

#: Upgrades stop here: opset 22 needs IR 10, which ONNX Runtime 1.31 loads (it refuses IR > 13,
#: and e.g. ConvTranspose admits bfloat16 only from opset 28). Ops needing more stay float32.
MAX_UPGRADE_OPSET = 22

# What the upgraded model brings besides its graph (the whole model is replaced in place).
_MODEL_FIELDS = ("graph", "ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string",
                 "device_configurations")


def needed_opset(model: ir.Model, policy: Policy, current: int) -> int:
    """Lowest opset at which every non-deny float op of the model admits the low dtype (and,
    for a policy with fp8 products, at least 19: Cast to float8)."""
    latest = min(onnx.defs.onnx_opset_version(), MAX_UPGRADE_OPSET)

    def admits(node: ir.Node, version: int) -> bool:
        typing = node_typing(node, {"": version})
        return typing.schema is not None and bool(typing.compute_vars) and typing.allows(policy.dtype)

    first: dict[str, int | None] = {}  # op type -> first opset admitting the low dtype
    needed = current
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or policy.category(node.op_type)[0] == "deny":
            continue
        typing = node_typing(node, {"": current})
        if typing.schema is None or not typing.compute_vars or typing.allows(policy.dtype):
            continue
        if node.op_type not in first:
            first[node.op_type] = next((v for v in range(current + 1, latest + 1) if admits(node, v)), None)
        version = first[node.op_type]
        if version is not None:
            needed = max(needed, version)
    if policy.fp8 is not None and any(n.op_type in policy.fp8.ops and n.domain in ("", "ai.onnx") for n in model.graph):
        needed = max(needed, min(FP8_MIN_OPSET, latest))  # Cast to float8
    return needed


class UpgradeOpsetPass(ir.passes.InPlacePass):
    """Upgrades the default-domain opset to the lowest one at which the model's ops admit the low dtype.

    Rules:
        1. A model already converted (``mpgraph.policy`` recorded) or without a default-domain
           opset is left as it is.
        2. The target is the lowest opset, at most ``MAX_UPGRADE_OPSET``, at which every float
           op the policy does not deny admits the low dtype (``needed_opset``); ops that admit
           it at no opset up to there do not count. No higher target: nothing changes.
        3. ``onnx.version_converter`` upgrades the model, and its IR version is raised to the
           least the new opset needs; the upgraded model replaces the model's contents.
        4. The converter drops node metadata, and with it the training roles that keep the
           optimizer float32: every node's metadata is carried across by node name.
        5. The upgrade is recorded in ``mpgraph.opset_upgraded`` as ``"<from>-><to>"``.
        6. A converter failure is a warning, not an error: the model is left as it is, and the
           ops that need the upgrade stay float32.
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        if current is None or md.MODEL_POLICY in model.metadata_props:
            return ir.passes.PassResult(model, False)
        target = needed_opset(model, self.policy, current)
        if target <= current:
            return ir.passes.PassResult(model, False)
        low = self.policy.dtype.name.lower()
        try:
            upgraded = version_converter.convert_version(ir.to_proto(model), target)
            upgraded.ir_version = max(
                upgraded.ir_version, min_ir_version({o.domain: o.version for o in upgraded.opset_import})
            )
            new = ir.from_proto(upgraded)
        except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors
            logger.warning(
                "opset %d -> %d upgrade failed (%s); ops without %s stay float32", current, target, first_line(e), low
            )
            return ir.passes.PassResult(model, False)
        old_props = {n.name: dict(n.metadata_props) for n in model.graph if n.name and n.metadata_props}
        for node in new.graph:
            for key, value in old_props.get(node.name or "", {}).items():
                node.metadata_props.setdefault(key, value)
        _replace_contents(model, new)
        model.metadata_props[md.MODEL_OPSET_UPGRADED] = f"{current}->{target}"
        logger.info("upgraded opset %d -> %d so ops admit %s", current, target, low)
        return ir.passes.PassResult(model, True)


def _replace_contents(model: ir.Model, new: ir.Model) -> None:
    """Make ``model`` hold what ``new`` holds (graph, versions, functions, metadata)."""
    for field in _MODEL_FIELDS:
        setattr(model, field, getattr(new, field))
    model.functions.clear()
    model.functions.update(new.functions)
    model.metadata_props.clear()
    model.metadata_props.update(new.metadata_props)
