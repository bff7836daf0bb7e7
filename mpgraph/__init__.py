"""mpgraph: a precision-policy compiler for ONNX graphs."""

from mpgraph.convert import convert, convert_file
from mpgraph.errors import MpgraphError
from mpgraph.io import load_model, save_model
from mpgraph.policy import Policy, load_policy

__all__ = [
    "MpgraphError",
    "Policy",
    "convert",
    "convert_file",
    "load_model",
    "load_policy",
    "save_model",
]
__version__ = "0.1.0"
