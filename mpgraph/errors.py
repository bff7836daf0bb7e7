"""The error hierarchy: every failure mpgraph reports to a user is an ``MpgraphError``.

The CLI turns these into a one-line message and exit code 2; anything else is a bug (one
line, exit code 1, and ``--debug`` shows the traceback). Library code raises a subclass with
the underlying exception chained (``raise DataError(...) from e``) so callers can see it.
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
    "UsageError",
    "DataError",
    "CheckpointError",
    "TrainingError",
    "OutputError",
    "ExportError",
    "first_line",
    "head_and_tail",
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


class UsageError(MpgraphError):
    """A command-line or API value is out of range or malformed (NaN learning rate, bad flag)."""


class DataError(MpgraphError):
    """A dataset or inputs file is unreadable or does not fit the graph (keys, shapes, labels)."""


class CheckpointError(MpgraphError):
    """A checkpoint cannot be read, belongs to another graph, or cannot be written."""


class TrainingError(MpgraphError):
    """Training met non-finite data or losses and was told to stop (``--on-nonfinite stop``)."""


class OutputError(ModelSaveError):
    """An output path (checkpoint, metrics, plot, model) cannot be written."""


class ExportError(MpgraphError):
    """A PyTorch module cannot be exported (bad arguments or an unsupported module)."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty.

    What a one-line error shows of an underlying exception (ORT, protobuf and the checker
    write several lines).

    >>> first_line(ValueError("bad shape\\n  at node 3")), first_line(KeyError())
    ('bad shape', 'KeyError')
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def head_and_tail(error: BaseException, limit: int = 300) -> str:
    """An exception's message on one line of at most ``limit`` characters, keeping its end.

    What a one-line reason shows of a message whose first line is generic and whose end says
    what went wrong: ORT's failed run starts "Non-zero status code returned while running
    Concat node..." and ends with the kernel's own words ("... supports at most 32 inputs
    during CUDA Graph capture"). The non-empty lines are joined with " / "; a longer text
    keeps the start of its first line (a third of ``limit`` at most) and the rest of ``limit``
    from its end, with " ... " between.

    >>> head_and_tail(RuntimeError("run failed\\n\\n  node 'c'\\nConcat: at most 32 inputs\\n"))
    "run failed / node 'c' / Concat: at most 32 inputs"
    >>> head_and_tail(RuntimeError("generic " * 20 + "\\nthe cause"), limit=40)
    'generic gener ... ic generic / the cause'
    >>> head_and_tail(KeyError())
    'KeyError'
    """
    text = " / ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if not text:
        return type(error).__name__
    if len(text) <= limit:
        return text
    head = min(len(text.split(" / ", 1)[0]), limit // 3)
    return f"{text[:head].rstrip()} ... {text[len(text) - (limit - head - 5):].lstrip()}"
