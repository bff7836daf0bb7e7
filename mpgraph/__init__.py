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

from typing import Any

from mpgraph.audit import audit, compare
from mpgraph.check_grad import check_grad
from mpgraph.convert import convert, convert_file
from mpgraph.errors import MpgraphError
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


def __getattr__(name: str) -> Any:
    # export_module imports torch, an optional dependency: load it on first use only.
    if name == "export_module":
        from mpgraph.export import export_module

        return export_module
    raise AttributeError(f"module 'mpgraph' has no attribute {name!r}")
