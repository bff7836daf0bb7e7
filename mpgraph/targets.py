"""Targets: which ops an execution provider runs in which dtype, apart from precision policies.

A policy says what is numerically safe to lower; a target says what a provider can execute.
The facts come from probes that open one-node models on ONNX Runtime
(``benchmarks/cpu_kernel_probe.py``, ``benchmarks/cuda_kernel_probe.py``), tabulated in
``mpgraph/kernel_table.py``. ``convert --target cuda|cpu|any`` keeps float32 exactly the ops
the target cannot run in the low dtype, with the reason ``no <dtype> kernel on <target>``.

* ``cuda``: the default of a native lowering (ORT CUDA, the version the probe ran).
* ``cpu``: ORT CPU. A native lowering keeps float32 every op without a low kernel (bfloat16:
  nearly everything but data movement). An emulated lowering computes in float32 anyway, so
  on ``cpu`` it keeps nothing extra; ``cpu`` is the default with ``emulate=True``.
* ``any``: no kernel facts applied.

Example:
    >>> import onnx_ir as ir
    >>> sorted(kernel_gaps("cuda", ir.DataType.BFLOAT16, 22, ["MaxPool", "MatMul"]))
    ['MaxPool']
    >>> kernel_gaps("cpu", ir.DataType.BFLOAT16, 22, ["MatMul"], emulate=True)
    {}
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import onnx
import onnx_ir as ir

from mpgraph._ir import meta as md
from mpgraph.errors import MpgraphError, UsageError
from mpgraph.policy.schema import Policy

__all__ = [
    "CUDA_NO_OPSET22_KERNEL",
    "TARGETS",
    "check_runnable",
    "cuda_opset_gaps",
    "default_target",
    "kernel_cell",
    "kernel_gaps",
    "lost_kernels",
    "probed_opsets",
    "resolve_target",
    "tables",
    "with_target",
]

TARGETS = ("cuda", "cpu", "any")


def tables() -> dict:
    """The probed kernel tables per provider (``mpgraph/kernel_table.py``)."""
    # Imported on use: the probe that generates the module imports mpgraph itself.
    from mpgraph.kernel_table import TABLES

    return TABLES


def default_target(emulate: bool) -> str:
    """``cuda`` for a native lowering, ``cpu`` for the CPU emulation."""
    return "cpu" if emulate else "cuda"


def resolve_target(target: str | None, emulate: bool) -> str:
    """The target to use; raises ``UsageError`` naming the valid ones."""
    if target is None:
        return default_target(emulate)
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}'; valid targets: {', '.join(TARGETS)}")
    return target


def probed_opsets(provider: str) -> list[int]:
    """Opsets the provider's probe ran at, ascending."""
    columns = next(iter(tables()[provider]["ops"].values()))
    return sorted({int(c.split("@")[1]) for c in columns})


def kernel_cell(provider: str, op_type: str, dtype: str, opset: int) -> str | None:
    """``ok``, ``fp32``, ``no``, ``n/a`` for ``op_type`` in ``dtype`` on ``provider``; None if not probed.

    The model's opset reads the column of the highest probed opset not above it (the lowest
    probed one for older models).
    """
    row = tables()[provider]["ops"].get(op_type)
    if row is None:
        return None
    opsets = probed_opsets(provider)
    column = max((o for o in opsets if o <= opset), default=opsets[0])
    # A column where the op is another version (or none: Gelu at 18 for a model at opset 20)
    # says nothing about it; a later probed opset with the model's version of the op does.
    version = _since_version(op_type, opset)
    if version is not None and _since_version(op_type, column) != version:
        column = min((o for o in opsets if o > opset and _since_version(op_type, o) == version), default=column)
    return row.get(f"{dtype}@{column}")


@functools.cache
def _since_version(op_type: str, opset: int) -> int | None:
    """The opset that introduced the version of ``op_type`` in force at ``opset``."""
    try:
        return onnx.defs.get_schema(op_type, opset).since_version
    except onnx.defs.SchemaError:
        return None


def kernel_gaps(
    target: str, low: ir.DataType, opset: int, op_types: Iterable[str], *, emulate: bool = False
) -> dict[str, str]:
    """Op type -> reason, for the ops ``target`` cannot run in ``low`` at ``opset``."""
    if target == "any" or (emulate and target == "cpu"):
        return {}
    dtype = low.name.lower()
    version = tables()[target]["onnxruntime"]
    return {
        op: f"no {dtype} kernel on {target} (ORT {version}, {tables()[target]['probe']})"
        for op in sorted(set(op_types))
        if kernel_cell(target, op, dtype, opset) == "no"
    }


def lost_kernels(provider: str, op_types: Iterable[str], opset: int, new_opset: int) -> dict[str, list[str]]:
    """Op type -> the dtypes in which ``provider`` runs it at ``opset`` and has no kernel at ``new_opset``.

    Ops the provider's table does not list, and providers without a table, lose nothing.

    Example:
        >>> lost_kernels("cuda", ["Dropout", "MaxPool", "Relu", "MatMul"], 18, 23)
        {'Dropout': ['float', 'float16', 'bfloat16'], 'MaxPool': ['float', 'float16']}
        >>> lost_kernels("cuda", ["Dropout"], 18, 20), lost_kernels("cpu", ["Dropout"], 18, 23)
        ({}, {})
    """
    if provider not in tables():
        return {}
    lost: dict[str, list[str]] = {}
    for op in sorted(set(op_types)):
        for dtype in ("float", "float16", "bfloat16"):
            if kernel_cell(provider, op, dtype, opset) in ("ok", "fp32") and kernel_cell(provider, op, dtype, new_opset) == "no":
                lost.setdefault(op, []).append(dtype)
    return lost


def with_target(policy: Policy, target: str, model: ir.Model, *, emulate: bool = False) -> Policy:
    """``policy`` with the model's ops that ``target`` cannot run low made ``deny``.

    Like a deny entry, a kernel gap spreads float32 forward through infer/clear ops (one cast
    pair around the island instead of one per op). Ops the policy already denies keep their
    numerics reason.
    """
    if policy.is_identity:
        return policy
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    ops = {n.op_type for n in model.graph if n.domain in ("", "ai.onnx")}
    gaps = kernel_gaps(target, policy.dtype, opset, ops, emulate=emulate)
    extra = {op: why for op, why in gaps.items() if policy.category(op)[0] != "deny"}
    if not extra:
        return policy
    return dataclasses.replace(policy, kernel_gaps={**policy.kernel_gaps, **extra})


def check_runnable(model: ir.Model, provider: str) -> list[str]:
    """Refuse a converted model on a provider that lacks a kernel it needs; return notes.

    Raises:
        MpgraphError: A low-precision node has no kernel on ``provider`` (names the op, the
            node, the model's recorded target and the fix).

    Returns:
        Notes for the user, e.g. that ORT CPU computes native float16 ops in float32.
    """
    props = model.metadata_props
    dtype = props.get(md.MODEL_DTYPE)
    if dtype in (None, "float32") or props.get(md.MODEL_EMULATED) == "true" or provider not in tables():
        return []
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    target = props.get(md.MODEL_TARGET, "unrecorded")
    for node in model.graph:
        if node.metadata_props.get(md.NODE_PRECISION) != dtype or node.domain not in ("", "ai.onnx"):
            continue
        if kernel_cell(provider, node.op_type, dtype, opset) == "no":
            raise MpgraphError(
                f"model was converted for target {target}, and ORT {provider} has no {dtype} kernel for "
                f"{node.op_type} (node '{node.name}'); convert the float32 model with --target {provider}"
            )
    if provider == "cpu" and dtype == "float16":
        return [
            "ORT CPU computes native float16 ops in float32 (it inserts Casts), so overflow and underflow "
            "do not show; convert with --emulate to see float16 rounding on CPU"
        ]
    return []


#: Ops that ONNX Runtime 1.31's CUDA provider registers only below opset 22 (any dtype;
#: measured by benchmarks/cuda_kernel_probe.py, benchmarks/results/cuda_kernels.log).
CUDA_NO_OPSET22_KERNEL = frozenset({"Dropout", "Elu", "MaxPool", "Selu"})


def cuda_opset_gaps(model: ir.Model) -> list[str]:
    """Op types of ``model`` that ORT 1.31 CUDA cannot run at the model's opset (sorted)."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    if opset < 22:
        return []
    return sorted({n.op_type for n in model.graph if n.domain in ("", "ai.onnx") and n.op_type in CUDA_NO_OPSET22_KERNEL})
