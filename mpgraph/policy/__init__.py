"""Precision policies: schema, YAML loading and the presets in ``rules/``."""

from mpgraph.policy.loader import (
    list_presets,
    load_policy,
    load_policy_file,
    parse_policy,
    preset_path,
)
from mpgraph.policy.schema import (
    CATEGORIES,
    InitializerRange,
    LossScaling,
    Override,
    Pin,
    Policy,
)

__all__ = [
    "CATEGORIES",
    "InitializerRange",
    "LossScaling",
    "Override",
    "Pin",
    "Policy",
    "list_presets",
    "load_policy",
    "load_policy_file",
    "parse_policy",
    "preset_path",
]
