"""Datasets for ``mpgraph train``: shipped with a package, generated, or a user ``.npz``.

Three sources, picked by name:

1. ``digits``: scikit-learn's ``load_digits`` (1,797 8x8 grey images, 10 classes), pixels
   standardised with the training split's mean and deviation, split 80/20 with a fixed seed.
   Arrays: ``x`` (float32 ``[N, 64]``) and ``label`` (int64 ``[N]``). Matched to a model whose
   input is ``[N, 1, 8, 8]`` (a CNN), ``x`` is reshaped to that.
2. ``sequence``: a generated next-token task for GPT-style models. Every sequence follows one
   deterministic rule that its prefix reveals: a random motif of length 2-6 repeated
   (copy), or an arithmetic progression ``(start + step * t) mod vocab``. Arrays: ``tokens``
   (int64 ``[N, T]``) and ``label`` (int64 ``[N, T]``, ``label[:, t] = tokens[:, t + 1]`` of
   the underlying sequence). Fitted to a model whose inputs follow Hugging Face names, the
   arrays become ``input_ids``, ``labels`` (the input ids: HF causal LMs shift inside the model)
   and ``attention_mask`` (ones).
3. A path to an ``.npz``: keys are graph input names; keys prefixed ``test_`` form the test
   split.

``dataset_for_model`` loads one of them and renames/reshapes its arrays to a model's data
inputs; ``Batches`` iterates over a split in seeded, reshuffled-per-epoch order and has an
exact, checkpointable position. ``random_feeds`` makes seeded sample inputs that respect a
model, for the range check, ``compare`` and ``tune``; it and the input checks live in
``mpgraph.feeds`` and are re-exported here.

Example:
    >>> ds = load_dataset("sequence", seq_len=8, vocab=16, size=32)
    >>> ds.train["tokens"].shape, ds.train["label"].shape
    ((32, 8), (32, 8))
    >>> b = Batches(ds.train, batch_size=10, seed=0)
    >>> [len(next(b)["tokens"]) for _ in range(4)]
    [10, 10, 10, 10]
    >>> b.position
    (1, 10)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpgraph.errors import DataError, MpgraphError, first_line
from mpgraph.feeds import (
    RANDOM_FEEDS_BYTES,
    check_finite,
    check_inputs,
    check_labels,
    index_bound,
    random_feeds,
)

__all__ = [
    "BUILTIN_DATASETS",
    "Dataset",
    "Batches",
    "data_digest",
    "load_dataset",
    "dataset_for_model",
    "InputSpec",
    "token_input",
    "read_npz",
    "check_finite",
    "check_inputs",
    "check_labels",
    "random_feeds",
    "index_bound",
    "RANDOM_FEEDS_BYTES",
]

BUILTIN_DATASETS = ("digits", "sequence")
_SPLIT_SEED = 1234
_TEST_PREFIX = "test_"


@dataclass(frozen=True)
class InputSpec:
    """A graph data input: name, numpy dtype, shape (``None`` or a str for symbolic dims)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...] | None


@dataclass(frozen=True)
class Dataset:
    """Named arrays of a train and a test split (same keys; the test split may be empty).

    Attributes:
        name: ``digits``, ``sequence`` or the ``.npz`` path.
        train: Input name -> array, first dimension the sample.
        test: Like ``train``; empty when the source has no test split.
        task: ``classification`` (labels are class indices), ``sequence`` (next-token
            classes per position) or ``custom``.
        num_classes: Classes (vocabulary size for ``sequence``), when known.
    """

    name: str
    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray] = field(default_factory=dict)
    task: str = "custom"
    num_classes: int | None = None

    def __len__(self) -> int:
        return _length(self.train, self.name)


def _length(arrays: Mapping[str, np.ndarray], name: str) -> int:
    scalars = [k for k, v in arrays.items() if np.ndim(v) == 0]
    if scalars:
        raise DataError(f"dataset '{name}': array(s) {', '.join(scalars)} are scalars; the first dimension must be the sample")
    sizes = {k: len(v) for k, v in arrays.items()}
    if not sizes:
        raise DataError(f"dataset '{name}' has no arrays")
    if len(set(sizes.values())) != 1:
        raise DataError(f"dataset '{name}': arrays differ in length ({', '.join(f'{k}={n}' for k, n in sizes.items())})")
    n = next(iter(sizes.values()))
    if n == 0:
        raise DataError(f"dataset '{name}' is empty (0 samples in {', '.join(sizes)})")
    return n


def _unknown(name: str) -> MpgraphError:
    return MpgraphError(f"unknown dataset '{name}'; valid: {', '.join(BUILTIN_DATASETS)}, or a path to .npz")


def load_dataset(name: str | os.PathLike[str], *, seq_len: int = 16, vocab: int = 64,
                 size: int = 4096, seed: int = 0) -> Dataset:
    """Load a built-in dataset by name or a user ``.npz``.

    Args:
        name: ``digits``, ``sequence`` or a path to an ``.npz`` file.
        seq_len: ``sequence``: tokens per sample.
        vocab: ``sequence``: vocabulary size (tokens are ``0 .. vocab-1``).
        size: ``sequence``: training samples (the test split has a quarter as many).
        seed: ``sequence``: generator seed (the digits split is fixed).

    Raises:
        MpgraphError: Unknown name, missing or unreadable file, inconsistent arrays.
    """
    text = os.fspath(name)
    if text == "digits":
        return _digits()
    if text == "sequence":
        return _sequence(seq_len=seq_len, vocab=vocab, size=size, seed=seed)
    if text.endswith(".npz") or os.sep in text or Path(text).exists():
        return _npz(Path(text))
    raise _unknown(text)


def _digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MpgraphError("the digits dataset needs scikit-learn: pip install 'mpgraph[data]'") from None
    raw = load_digits()
    x = raw.data.astype(np.float64)
    y = raw.target.astype(np.int64)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(x))
    n_test = len(x) // 5
    test_idx, train_idx = order[:n_test], order[n_test:]
    mean = x[train_idx].mean(axis=0)
    std = x[train_idx].std(axis=0)
    std[std == 0] = 1.0  # constant border pixels
    x = ((x - mean) / std).astype(np.float32)
    return Dataset(
        "digits",
        train={"x": x[train_idx], "label": y[train_idx]},
        test={"x": x[test_idx], "label": y[test_idx]},
        task="classification",
        num_classes=10,
    )


def _sequence(*, seq_len: int, vocab: int, size: int, seed: int) -> Dataset:
    if seq_len < 2 or vocab < 4:
        raise MpgraphError(f"sequence dataset needs seq_len >= 2 and vocab >= 4 (got {seq_len}, {vocab})")
    rng = np.random.default_rng([seed, _SPLIT_SEED])
    n = size + max(size // 4, 1)
    t = np.arange(seq_len + 1)
    full = np.empty((n, seq_len + 1), np.int64)
    copy = rng.random(n) < 0.5
    for i in range(n):
        if copy[i]:
            period = int(rng.integers(2, 7))
            motif = rng.integers(0, vocab, period)
            full[i] = motif[t % period]
        else:
            start, step = int(rng.integers(0, vocab)), int(rng.integers(1, vocab))
            full[i] = (start + step * t) % vocab
    tokens, label = full[:, :-1], full[:, 1:]
    return Dataset(
        "sequence",
        train={"tokens": tokens[:size].copy(), "label": label[:size].copy()},
        test={"tokens": tokens[size:].copy(), "label": label[size:].copy()},
        task="sequence",
        num_classes=vocab,
    )


def read_npz(path: str | os.PathLike[str], error: type[MpgraphError] = DataError, *,
             what: str = "a readable .npz file", hint: bool = True) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file (no pickles); ``error`` with one line if unreadable.

    Recognised and named: a missing file, a folder, an empty file, a single ``.npy`` array
    renamed ``.npz``, a file that is not a zip archive, a truncated archive or one whose CRC
    check fails, object (pickled) arrays, and an archive without arrays. The message reads
    ``PATH: not WHAT (reason)``; ``hint`` adds how to write one with numpy.
    """
    p = Path(path)
    if not p.exists():
        raise error(f"{p}: no such file")
    if p.is_dir():
        raise error(f"{p}: is a directory, expected an .npz file")
    try:
        with open(p, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from e
    how = "; save arrays with np.savez(path, name=array, ...)" if hint else ""
    if not head:
        raise error(f"{p}: not {what} (the file is empty{how})")
    if head == b"\x93NUMPY":
        raise error(f"{p}: not {what} (it is a single .npy array{how})")
    if not head.startswith(b"PK"):
        raise error(f"{p}: not {what} (no zip header{how})")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - zipfile, zlib, numpy and pickle refusals all mean "unreadable"
        reason = first_line(e)
        if "allow_pickle" in reason or "Object arrays" in reason:
            reason = "it holds object arrays (pickles), which mpgraph does not load"
        raise error(f"{p}: not {what} ({reason})") from e
    if not arrays:
        raise error(f"{p}: not {what} (the archive holds no arrays)")
    return arrays


def _npz(path: Path) -> Dataset:
    if not path.exists():
        raise DataError(f"{path}: no such dataset file; valid: {', '.join(BUILTIN_DATASETS)}, or a path to .npz")
    arrays = read_npz(path)
    bad = [k for k, v in arrays.items() if v.dtype.kind not in "biuf"]
    if bad:
        raise DataError(f"{path}: array(s) {', '.join(bad)} are not numeric ({', '.join(str(arrays[k].dtype) for k in bad)})")
    test = {k[len(_TEST_PREFIX):]: v for k, v in arrays.items() if k.startswith(_TEST_PREFIX)}
    train = {k: v for k, v in arrays.items() if not k.startswith(_TEST_PREFIX)}
    if not train:
        raise DataError(f"{path}: no training arrays (keys are graph input names; test_<name> for the test split)")
    _length(train, str(path))
    if test:
        _length(test, str(path))
        if set(test) != set(train):
            raise DataError(f"{path}: test_ keys {sorted(test)} do not match the training keys {sorted(train)}")
    label = train.get("label")
    task = "classification" if label is not None and label.dtype.kind in "iu" else "custom"
    return Dataset(str(path), train=train, test=test, task=task)


def dataset_for_model(name: str | os.PathLike[str], inputs: Sequence[InputSpec], *, seed: int = 0,
                      size: int = 4096, vocab: int | None = None) -> Dataset:
    """Load a dataset and fit it to a model's data inputs.

    Arrays are renamed to the input names (a single float/int feature array goes to the single
    input of that kind besides ``label``), cast to the input dtype, and reshaped when the
    input's static shape has the same number of elements per sample (``[N, 64]`` -> ``[N, 1,
    8, 8]``). The ``sequence`` length comes from the token input's static shape; ``vocab``
    (default 64) must not exceed the model's embedding rows.

    Raises:
        MpgraphError: The dataset cannot feed the inputs (names the missing input).
    """
    text = os.fspath(name)
    if text == "sequence":
        tok = token_input(inputs)
        seq_len = 16
        if tok is not None and tok.shape is not None and len(tok.shape) >= 2 and isinstance(tok.shape[1], int):
            seq_len = tok.shape[1]
        ds = load_dataset(text, seq_len=seq_len, vocab=vocab or 64, size=size, seed=seed)
        ds = _sequence_for(ds, inputs, tok)
    else:
        ds = load_dataset(text, seed=seed)
    return fit_to_inputs(ds, inputs)


#: Integer inputs that are not the token ids of a sequence model.
_NOT_TOKENS = ("label", "labels", "attention_mask", "token_type_ids", "position_ids")


def token_input(inputs: Sequence[InputSpec]) -> InputSpec | None:
    """The token-id input of a sequence model: ``input_ids`` (Hugging Face), else the first
    integer input that is not a label, mask or position/type id."""
    ints = [s for s in inputs if s.dtype.kind in "iu"]
    return next((s for s in ints if s.name == "input_ids"), None) or next((s for s in ints if s.name not in _NOT_TOKENS), None)


def _sequence_for(ds: Dataset, inputs: Sequence[InputSpec], tok: InputSpec | None) -> Dataset:
    """The ``sequence`` arrays under the model's own names.

    ``label`` holds the next tokens (mpgraph's convention). ``labels`` with ``input_ids`` is the
    Hugging Face convention, where a causal LM shifts the labels inside the model: it gets the
    input ids themselves, and the task becomes ``custom`` (no next-token accuracy). An
    ``attention_mask`` input gets ones.
    """
    names = {s.name for s in inputs}
    if tok is None:
        return ds

    def rename(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not arrays:
            return {}
        tokens = arrays["tokens"]
        out = {tok.name: tokens}
        if "labels" in names:
            out["labels"] = tokens.copy()
        elif "label" in names:
            out["label"] = arrays["label"]
        if "attention_mask" in names:
            out["attention_mask"] = np.ones_like(tokens)
        return out

    task = "custom" if "labels" in names else ds.task
    return Dataset(ds.name, rename(ds.train), rename(ds.test), task, ds.num_classes)


def fit_to_inputs(ds: Dataset, inputs: Sequence[InputSpec]) -> Dataset:
    """``ds`` with arrays renamed, cast and reshaped to ``inputs`` (see ``dataset_for_model``)."""
    names = {s.name for s in inputs}
    rename: dict[str, str] = {k: k for k in ds.train if k in names}
    spare = [k for k in ds.train if k not in names]
    unfed = [s for s in inputs if s.name not in rename.values()]
    for spec in list(unfed):
        kind = "f" if spec.dtype.kind == "f" else "i"
        cands = [k for k in spare if ds.train[k].dtype.kind in ("f" if kind == "f" else "iu")]
        if len(cands) == 1 and len([s for s in unfed if (s.dtype.kind == "f") == (kind == "f")]) == 1:
            rename[cands[0]] = spec.name
            spare.remove(cands[0])
            unfed.remove(spec)
    if unfed:
        raise DataError(
            f"dataset '{ds.name}' has no array for graph input(s) {', '.join(repr(s.name) for s in unfed)} "
            f"(dataset arrays: {', '.join(sorted(ds.train))}; an .npz needs keys named like the inputs)"
        )
    specs = {s.name: s for s in inputs}

    def convert(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for src, dst in rename.items():
            if src not in arrays:
                continue
            out[dst] = _fit_array(arrays[src], specs[dst], ds.name)
        return out

    return Dataset(ds.name, convert(ds.train), convert(ds.test), ds.task, ds.num_classes)


def _fit_array(a: np.ndarray, spec: InputSpec, source: str) -> np.ndarray:
    a = np.asarray(a)
    if spec.shape is not None and all(isinstance(d, int) for d in spec.shape[1:]):
        want = tuple(int(d) for d in spec.shape[1:])  # type: ignore[arg-type]
        if a.shape[1:] != want:
            if int(np.prod(a.shape[1:])) != int(np.prod(want)):
                raise DataError(
                    f"dataset '{source}': array for input '{spec.name}' has samples of shape "
                    f"{list(a.shape[1:])}, the graph wants {list(want)}"
                )
            a = a.reshape((len(a), *want))
    if a.dtype != spec.dtype:
        if a.dtype.kind == "f" and spec.dtype.kind in "iu":
            raise DataError(f"dataset '{source}': input '{spec.name}' wants {spec.dtype} but the array is {a.dtype}")
        a = a.astype(spec.dtype)
    return np.ascontiguousarray(a)


def data_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """A short hash of arrays by name: their names, dtypes, shapes and bytes.

    A checkpoint records it so that a resume on other data is refused instead of silently
    training on a different stream (BLAKE2b reads about 1 GB/s: a second per GB, once a run).

    >>> a = {"x": np.zeros((2, 3), np.float32)}
    >>> data_digest(a) == data_digest({"x": np.zeros((2, 3), np.float32)}), data_digest(a) == data_digest({"x": np.ones((2, 3), np.float32)})
    (True, False)
    """
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.view(np.uint8) if a.ndim and a.dtype.itemsize else a.tobytes())  # any dtype (bfloat16 has no buffer format)
    return h.hexdigest()


class Batches(Iterator[dict[str, np.ndarray]]):
    """Endless mini-batches of one split in a seeded order, reshuffled every epoch.

    The order of epoch ``e`` is a permutation drawn from ``default_rng([seed, e])``, so the
    position ``(epoch, index)`` alone restores the stream exactly. A final partial batch is
    dropped (a graph with a static batch dimension takes every batch).

    Args:
        arrays: Input name -> array (the same first dimension).
        batch_size: Samples per batch (clamped to the split's size).
        seed: Shuffle seed.
        position: ``(epoch, index)`` to start from.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, seed: int = 0,
                 position: tuple[int, int] = (0, 0)) -> None:
        if batch_size < 1:
            raise MpgraphError(f"batch size must be >= 1, got {batch_size}")
        self.arrays = dict(arrays)
        self.n = _length(self.arrays, "batches")
        self.batch_size = min(batch_size, self.n)
        self.seed = seed
        self.epoch, self.index = position
        self._order = self._perm(self.epoch)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """``data_digest`` of the arrays (computed once)."""
        if self._digest is None:
            self._digest = data_digest(self.arrays)
        return self._digest

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, index)`` of the next batch."""
        return self.epoch, self.index

    def seek(self, position: tuple[int, int]) -> None:
        """Go to ``(epoch, index)``: the next batch is the one at that position."""
        epoch, index = position
        if epoch != self.epoch:
            self._order = self._perm(epoch)
        self.epoch, self.index = epoch, index

    def state(self) -> dict[str, Any]:
        """Everything needed to resume this stream, and what identifies it (JSON-serialisable)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "batch_size": self.batch_size,
                "digest": self.digest}

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index + self.batch_size > self.n:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        idx = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return {k: v[idx] for k, v in self.arrays.items()}
