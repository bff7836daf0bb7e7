"""The error hierarchy: every failure mpgraph reports to a user is an ``MpgraphError``.

The CLI turns these into a one-line message and exit code 2; anything else is a bug.
"""

from __future__ import annotations

__all__ = [
    "MpgraphError",
    "PolicyError",
    "ModelLoadError",
    "ModelSaveError",
    "UnsupportedModelError",
    "ValidationError",
    "GradientError",
]


class MpgraphError(Exception):
    """Root of all user-facing errors. Messages name the thing, the rule and the fix."""


class PolicyError(MpgraphError):
    """A policy file or preset is invalid (names file, key path, bad value, valid choices)."""


class ModelLoadError(MpgraphError):
    """A model file cannot be read: missing, truncated, not ONNX."""


class ModelSaveError(MpgraphError):
    """An output file cannot be written."""


class UnsupportedModelError(MpgraphError):
    """The model uses something mpgraph cannot handle (op, type, structure)."""


class ValidationError(MpgraphError):
    """A rewritten model failed validation (checker, strict shape inference, policy invariants)."""


class GradientError(MpgraphError):
    """Differentiation failed: missing gradient rule, nothing to differentiate, bad freeze pattern."""
