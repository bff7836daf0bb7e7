"""Write a policy back as commented YAML: the starting point ``mpgraph policy init`` gives a user.

The file lists every key explicitly (no ``extends``), so what a user reads is what the policy
does, and loading it gives the same policy under a new name.

Example:
    >>> from mpgraph.policy import load_policy, parse_policy
    >>> text = policy_yaml(load_policy("bf16"), name="mine")
    >>> copy = parse_policy(text, "mine.yaml")
    >>> copy.ops == load_policy("bf16").ops and copy.name == "mine"
    True
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import yaml

from mpgraph.policy.schema import CATEGORIES, Policy

__all__ = ["policy_yaml"]

_CATEGORY_HELP = {
    "allow": "run in the low dtype (matrix products, convolutions)",
    "infer": "follow their inputs: low between or after low ops",
    "clear": "dtype-neutral data movement: low next to low ops",
    "deny": "stay float32; float32 spreads forward through infer/clear ops",
}


def _scalar(value: object) -> str:
    """One YAML scalar on one line (quoted when it needs to be)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _quoted(text: str) -> str:
    """A double-quoted scalar, safe inside a flow mapping (JSON strings are YAML)."""
    return json.dumps(text)


def policy_yaml(policy: Policy, *, name: str, source: str | None = None) -> str:
    """``policy`` as a commented, self-contained YAML document named ``name``."""
    low = policy.dtype.name.lower()
    lines = [
        f"# Precision policy '{name}'" + (f", a copy of {source}" if source else "") + ", written by `mpgraph policy init`.",
        "# Edit it, check it with `mpgraph policy check FILE`, use it with `mpgraph convert MODEL --policy FILE`.",
        "# Which ops a provider can run in the low dtype is not part of a policy: convert's --target",
        "# (cuda by default, cpu with --emulate; `mpgraph targets` shows the table) keeps those float32.",
        f"name: {_scalar(name)}",
        "description: >",
        *(f"  {line}" for line in textwrap.wrap(policy.description or "(none)", 94)),
        f"dtype: {low}  # float16 | bfloat16 | float32",
        f"default: {policy.default_category}  # category of the ops not listed below: allow | infer | clear | deny",
        "ops:",
    ]
    for category in CATEGORIES:
        entries = sorted((op, why) for op, (cat, why) in policy.ops.items() if cat == category)
        lines.append(f"  # {category}: {_CATEGORY_HELP[category]}")
        if not entries:
            lines.append(f"  {category}: {{}}")
            continue
        lines.append(f"  {category}:")
        lines += [f"    {_scalar(op)}: {_scalar(why)}" for op, why in entries]
    lines += [
        "# Per-node overrides by fnmatch pattern over node names; the first match wins.",
        "#   - {match: \"/head/*\", precision: float32, reason: keep the classifier exact}",
    ]
    if policy.overrides:
        lines.append("overrides:")
        lines += [
            f"  - {{match: {_quoted(o.pattern)}, precision: {o.precision}, reason: {_quoted(o.reason)}}}"
            for o in policy.overrides
        ]
    else:
        lines.append("overrides: []")
    lines.append("# Input slots of an op type kept float32 (coordinates, scales).")
    if policy.pins:
        lines.append("pins:")
        lines += [
            f"  - {{op: {_quoted(p.op_type)}, inputs: {list(p.inputs)}, reason: {_quoted(p.reason)}}}" for p in policy.pins
        ]
    else:
        lines.append("pins: []")
    keep = policy.keep_io_types if isinstance(policy.keep_io_types, bool) else list(policy.keep_io_types)
    loss = dataclasses.asdict(policy.loss_scaling)
    lines += [
        "# Graph inputs/outputs kept float32: true, false, or a list of names.",
        f"keep_io_types: {_scalar(keep)}",
        "# Weights beyond the low dtype's range: overflow keep_fp32 | clamp | error; underflow keep | keep_fp32 | error.",
        f"initializers: {{overflow: {policy.initializers.overflow}, underflow: {policy.initializers.underflow}}}",
        "# Training graphs: none | static | dynamic (torch.amp.GradScaler's defaults).",
        "loss_scaling: {" + ", ".join(f"{k}: {_scalar(v)}" for k, v in loss.items()) + "}",
        "# true lets float32 MatMul/Gemm/Conv run as TF32 on CUDA.",
        f"tf32: {_scalar(policy.tf32)}",
    ]
    lines += _fp8_lines(policy)
    return "\n".join(lines) + "\n"


def _fp8_lines(policy: Policy) -> list[str]:
    """The ``fp8`` section, when the policy has one."""
    if policy.fp8 is None:
        return []
    fp8, scaling = policy.fp8, dataclasses.asdict(policy.fp8.scaling)
    return [
        "# fp8 matrix products: operand formats (float8e4m3fn | float8e5m2) and the per-tensor scaling",
        "# recipe (delayed | current; history length, amax max | most_recent, margin, rounding pow2 | none).",
        "fp8:",
        f"  ops: [{', '.join(fp8.ops)}]",
        f"  products: {fp8.products}  # all | linear (only products with a weight operand, and their backward)",
        f"  forward: {fp8.forward.name.lower()}",
        f"  backward: {fp8.backward.name.lower()}",
        "  scaling: {" + ", ".join(f"{k}: {_scalar(v)}" for k, v in scaling.items()) + "}",
    ]
