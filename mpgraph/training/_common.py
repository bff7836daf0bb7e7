"""Small helpers every training pass shares."""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["name_of"]


def name_of(value: ir.Value) -> str:
    """The name of a value that ``NormalizeForwardPass`` has named (every value is)."""
    assert value.name is not None, "graph values are named by NormalizeForwardPass"
    return value.name
