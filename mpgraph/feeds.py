"""Model inputs for the precision tools and ``train``: seeded random feeds that respect a model,
and the checks every tool runs on the inputs it is given.

``random_feeds`` makes the sample inputs of the range check, ``compare``, ``tune`` and
``advise-scale`` when none are given; ``check_inputs`` (samples present, floats finite),
``check_finite`` and ``check_labels`` (class and token ids within the graph's bounds, from
``index_bound``) refuse data that would make a measurement meaningless. ``mpgraph.data``
re-exports them all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from mpgraph.dtypes import is_float
from mpgraph.errors import DataError

__all__ = ["RANDOM_FEEDS_BYTES", "check_finite", "check_inputs", "check_labels", "index_bound", "random_feeds"]

# Ops an integer input passes through unchanged on its way to a Gather index or a label.
_PASS_THROUGH = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"})
_LABEL_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_LENGTH_NAME = re.compile(r"(^|[_.\-/])(seq_?)?len(gth)?s?($|[_.\-/])", re.IGNORECASE)


def check_finite(arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Every float array of ``arrays`` is finite.

    Raises:
        DataError: Naming the array, how many values are NaN or infinite, and the first sample.
    """
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        bad = ~np.isfinite(a)
        if bad.any():
            first = int(np.argwhere(bad.reshape(len(a), -1).any(axis=1))[0, 0]) if a.ndim else 0
            raise DataError(f"{what}: '{name}' has {int(bad.sum())} non-finite value(s) (NaN or inf), first in sample {first}")


def check_inputs(arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Inputs a precision tool measures with: every array has samples, every float is finite.

    A NaN in an input makes every value it reaches NaN in both models, and an array without
    samples runs nothing: either way nothing is compared, and ``compare``, ``tune``,
    ``advise-scale`` and the range check would report an agreement never measured. ``train``
    refuses such data the same way. (Only the first axis counts as the samples: a zero-length
    cache axis elsewhere is a real input.)

    Raises:
        DataError: Naming the array and its shape, or how many values are NaN or infinite.
    """
    for name, a in arrays.items():
        shape = np.shape(a)
        if shape and shape[0] == 0:
            raise DataError(f"{what}: '{name}' has no samples (shape {list(shape)}); give at least one, "
                            "or leave the inputs out for seeded random ones")
    check_finite(arrays, what)


def check_labels(arrays: Mapping[str, np.ndarray], bounds: Mapping[str, tuple[int, int | None]], what: str) -> None:
    """Integer class/token arrays lie in ``[0, classes)`` (or equal the loss's ignore index).

    Args:
        arrays: Input name -> array.
        bounds: Input name -> (classes, ignore_index or None), from the graph.
        what: The data's name for the message.

    Raises:
        DataError: Naming the array, the bad value, its sample and the valid range.
    """
    for name, (classes, ignore) in bounds.items():
        a = arrays.get(name)
        if a is None or np.asarray(a).size == 0 or np.asarray(a).dtype.kind not in "iu":
            continue
        a = np.asarray(a)
        bad = (a < 0) | (a >= classes)
        if ignore is not None:
            bad &= a != ignore
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            valid = f"0..{classes - 1}" + (f" or the ignore index {ignore}" if ignore is not None else "")
            raise DataError(f"{what}: '{name}' holds {int(a[index])} at sample {index[0]} "
                            f"({int(bad.sum())} value(s) out of range); the graph has {classes} classes: valid {valid}")


def index_bound(value: ir.Value) -> int | None:
    """Exclusive upper bound for an integer input: the rows of the table it indexes (``Gather``,
    ``GatherElements``), or the classes it labels; the smallest when several read it."""
    bounds: list[int] = []
    stack, seen = [value], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for use in current.uses():
            node, idx = use.node, use.idx
            if node.op_type in _PASS_THROUGH and idx == 0:
                stack.extend(node.outputs)
            elif node.op_type in ("Gather", "GatherElements") and idx == 1 and node.inputs[0] is not None:
                axis_attr = node.attributes.get("axis")
                axis = axis_attr.value if axis_attr is not None else 0
                shape = node.inputs[0].shape
                if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
                    bounds.append(shape[axis])
            elif node.op_type in _LABEL_OPS and idx == 1 and node.inputs[0] is not None:
                shape = node.inputs[0].shape
                if shape is not None and len(shape) > 1 and isinstance(shape[1], int):
                    bounds.append(shape[1])
    return min(bounds) if bounds else None


#: The most bytes of random inputs ``random_feeds`` makes: a model that declares a huge input
#: dimension (2**31 rows) once ran out of memory, or into numpy's size limit, in the range check.
RANDOM_FEEDS_BYTES = 1 << 30


def random_feeds(model: ir.Model, seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    """Seeded sample inputs that respect the model; dynamic dims become ``batch``.

    Float inputs are standard normal; integer inputs that index a table (``Gather``) or label
    classes (``SoftmaxCrossEntropyLoss``) are uniform over its rows or classes; inputs named
    like a mask are ones, like a length 1 (positive, and within any sequence); bool inputs are
    true; other integers are uniform in [0, 2).

    Raises:
        DataError: An input declares a negative dimension, or the inputs would take more than
            ``RANDOM_FEEDS_BYTES`` (naming the input, its shape and the bytes).

    Example:
        >>> from onnx import helper as h, TensorProto as T
        >>> g = h.make_graph([h.make_node("Gather", ["table", "ids"], ["y"])], "g",
        ...     [h.make_tensor_value_info("ids", T.INT64, [2, 3])], [h.make_tensor_value_info("y", T.FLOAT, None)],
        ...     [h.make_tensor("table", T.FLOAT, [5, 1], [0.0] * 5)])
        >>> ids = random_feeds(ir.from_proto(h.make_model(g)))["ids"]
        >>> bool(ids.min() >= 0 and ids.max() < 5)
        True
    """
    rng = np.random.default_rng(seed)
    inputs = [
        v
        for v in model.graph.inputs
        if not v.is_initializer() and v.dtype is not None and v.shape is not None and v.name
    ]
    shapes = {v.name: [d if isinstance(d, int) else batch for d in v.shape] for v in inputs}  # type: ignore[union-attr]
    total = 0
    for value in inputs:
        shape = shapes[value.name]
        if any(d < 0 for d in shape):
            raise DataError(f"input '{value.name}' declares a negative dimension (shape {shape}), so no random inputs "
                            "can be made for it: fix the model's input shape, or give inputs")
        total += math.prod(shape) * np.dtype(value.dtype.numpy()).itemsize  # type: ignore[union-attr]
        if total > RANDOM_FEEDS_BYTES:
            raise DataError(f"random inputs would take {total / 2**30:.3g} GiB (input '{value.name}' has shape {shape}), "
                            f"more than the {RANDOM_FEEDS_BYTES >> 30} GiB mpgraph makes; give smaller inputs")
    feeds: dict[str, np.ndarray] = {}
    for value in inputs:
        name = value.name or ""
        shape = shapes[name]
        np_dtype = value.dtype.numpy()  # type: ignore[union-attr]
        if value.dtype == ir.DataType.BOOL or _MASK_NAME.search(name):
            feeds[name] = np.ones(shape, dtype=np_dtype)
        elif is_float(value.dtype):
            feeds[name] = rng.standard_normal(shape).astype(np_dtype)
        elif _LENGTH_NAME.search(name):
            feeds[name] = np.ones(shape, dtype=np_dtype)
        else:
            high = index_bound(value) or 2
            feeds[name] = rng.integers(0, max(high, 1), size=shape).astype(np_dtype)
    return feeds
