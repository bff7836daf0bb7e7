"""mpgraph: a precision-policy compiler for ONNX graphs.

Every command has a Python twin::

    mpgraph.export_module(module, x, "net.onnx", loss="cross_entropy")   # mpgraph export (needs torch)
    step = mpgraph.build_training_graph("net.onnx", optimizer="adamw")   # mpgraph train-graph
    low = mpgraph.convert(step, "fp16", emulate=True)                    # mpgraph convert
    mpgraph.audit(low)                                                   # mpgraph audit
    mpgraph.compare(reference, candidate, feeds)                         # mpgraph compare
    mpgraph.check_grad("net.onnx").passed                                # mpgraph check-grad
    mpgraph.Trainer(low, provider="cpu").fit(data, steps=100)            # mpgraph train
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpgraph.audit import audit, compare
    from mpgraph.check_grad import check_grad
    from mpgraph.convert import convert, convert_file
    from mpgraph.errors import MpgraphError
    from mpgraph.export import export_module
    from mpgraph.io import load_model, save_model
    from mpgraph.policy import Policy, load_policy
    from mpgraph.runtime.trainer import Trainer
    from mpgraph.training import build_training_graph

__all__ = [
    "MpgraphError",
    "Policy",
    "Trainer",
    "audit",
    "build_training_graph",
    "check_grad",
    "compare",
    "convert",
    "convert_file",
    "export_module",
    "load_model",
    "load_policy",
    "save_model",
]
__version__ = "0.1.0"

# Each public name is imported on first use: importing every twin up front loads onnx, onnx_ir
# (and through it sympy), ml_dtypes and onnxruntime, which cost every `mpgraph` call, even
# `--help` and `from mpgraph.errors import ...`, two seconds on a 2-core machine before
# it did anything. export_module also imports torch, an optional dependency.
_HOME = {
    "MpgraphError": "mpgraph.errors",
    "Policy": "mpgraph.policy",
    "Trainer": "mpgraph.runtime.trainer",
    "audit": "mpgraph.audit",
    "build_training_graph": "mpgraph.training",
    "check_grad": "mpgraph.check_grad",
    "compare": "mpgraph.audit",
    "convert": "mpgraph.convert",
    "convert_file": "mpgraph.convert",
    "export_module": "mpgraph.export",
    "load_model": "mpgraph.io",
    "load_policy": "mpgraph.policy",
    "save_model": "mpgraph.io",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mpgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``mpgraph.audit``, ``mpgraph.convert`` and ``mpgraph.check_grad`` are functions named
    like the subpackages that define them. Importing a submodule binds it on its parent, which
    would turn ``mpgraph.audit`` into a module once anything imported ``mpgraph.audit.report``;
    the function keeps the name instead (as when the names were imported eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
