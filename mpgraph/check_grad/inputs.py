"""The data a check runs on: the user's ``.npz`` or seeded inputs valid for the model, and
seeded random weights for models whose own weights are placeholders."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from mpgraph.check_grad.report import InputsError
from mpgraph.data import index_bound, read_npz

__all__ = ["generate_inputs", "random_weights", "read_inputs"]

#: Default size of a symbolic dimension: the leading one (the batch) and the others.
BATCH = 2
OTHER_DIM = 8


def read_inputs(inputs: str | os.PathLike[str] | Mapping[str, np.ndarray], specs: Sequence[ir.Value]) -> dict[str, np.ndarray]:
    """The user's data inputs (an ``.npz`` path or a dict), cast to the dtypes ``specs`` want.

    Raises:
        InputsError: A data input is missing, a key is unknown, or a float feeds an integer input.
    """
    if isinstance(inputs, Mapping):
        arrays, where = {k: np.asarray(v) for k, v in inputs.items()}, "inputs"
    else:
        path = Path(inputs)
        where = str(path)
        if not path.is_file():
            raise InputsError(f"{path}: no such inputs file (an .npz keyed by the model's input names)")
        arrays = read_npz(path, InputsError)
    need = [v.name or "" for v in specs]
    missing = [n for n in need if n not in arrays]
    extra = [k for k in arrays if k not in need]
    if missing or extra:
        what = "; ".join(
            part for part in (
                f"missing {', '.join(repr(n) for n in missing)}" if missing else "",
                f"unknown {', '.join(repr(k) for k in extra)}" if extra else "",
            ) if part
        )
        raise InputsError(
            f"{where}: {what} (the file has: {', '.join(sorted(arrays)) or 'nothing'}; "
            f"the model needs: {', '.join(need)})"
        )
    out = {}
    for v in specs:
        a, want = arrays[v.name or ""], np.dtype(v.dtype.numpy()) if v.dtype is not None else None
        if want is not None and a.dtype != want:
            if a.dtype.kind == "f" and want.kind in "iub":
                raise InputsError(f"{where}: '{v.name}' is {a.dtype}, the model wants {want}")
            a = a.astype(want)
        out[v.name or ""] = a
    return out


def generate_inputs(specs: Sequence[ir.Value], rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    """Seeded inputs: floats standard normal, integers valid for what reads them (``index_bound``),
    ``*mask*`` inputs ones; symbolic dims of the same name get the same size."""
    sizes: dict[str, int] = {}
    feeds = {}
    for v in specs:
        dims = []
        for axis, d in enumerate(v.shape or ()):
            if isinstance(d, int):
                dims.append(d)
            else:
                key = str(d) if d is not None and str(d) not in ("None", "") else f"{v.name}:{axis}"
                dims.append(sizes.setdefault(key, batch if axis == 0 else OTHER_DIM))
        dtype = np.dtype(v.dtype.numpy()) if v.dtype is not None else np.dtype(np.float32)
        if dtype.kind == "f":
            feeds[v.name or ""] = rng.standard_normal(dims).astype(dtype)
        elif dtype.kind == "b":
            feeds[v.name or ""] = np.ones(dims, dtype)
        else:
            bound = index_bound(v)
            if bound is None:
                # A mask of ones is valid; other integers of unknown meaning are zeros.
                fill = 1 if "mask" in (v.name or "").lower() else 0
                feeds[v.name or ""] = np.full(dims, fill, dtype)
            else:
                feeds[v.name or ""] = rng.integers(0, bound, dims).astype(dtype)
    return feeds


def random_weights(base: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Matrices and kernels ``N(0, 1/fan_in)``; vectors (biases, norm scales) their mean plus
    ``N(0, 0.1^2)``, so a norm scale of ones stays near one."""
    out = {}
    for name, value in base.items():
        if value.ndim >= 2:
            fan_in = int(np.prod(value.shape[1:]))
            out[name] = (rng.standard_normal(value.shape) / np.sqrt(fan_in)).astype(value.dtype)
        else:
            out[name] = (np.mean(value) + 0.1 * rng.standard_normal(value.shape)).astype(value.dtype)
    return out
