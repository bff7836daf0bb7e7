"""A CUDA stream and per-step events for pipelined training steps (``Trainer.step_many``).

ORT runs a session's CUDA work on its own stream, and nothing in its Python API waits for one
step alone: a run either synchronises the device at its end or returns at once. To let the host
enqueue step k+1 while the GPU runs step k, and still read step k's loss only once step k is
done, the ``Trainer`` gives ORT a stream it owns (the CUDA provider's ``user_compute_stream``)
and records an event on it after every step. ``benchmarks/pipeline_probe.py`` shows why the
events matter: without them the host's copies (``update_inplace``, ``numpy()``) are not ordered
after ORT's work, and the pipelined tiny MLP trained a different model from its third step.

The stream and events come from torch (a dependency of mpgraph for export and reference), so
that no CUDA runtime binding of our own is needed.

Batches travel the same way (``Uploads``): each array is written to pinned host memory and
copied to its fixed device buffer on that stream, asynchronously, so the copy is ordered before
the step that reads it and the host does not wait for it. ``OrtValue.update_inplace`` (the
synchronous path) copies from pageable memory and returns only when the copy is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mpgraph.errors import MpgraphError

__all__ = ["StepEvents", "Uploads"]


class StepEvents:
    """A CUDA stream for ORT to compute on, and an event per recorded step."""

    def __init__(self, device_id: int) -> None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - torch is a dependency
            raise MpgraphError(f"pipelined steps need torch for their CUDA stream and events: {e}") from None
        if not torch.cuda.is_available():
            raise MpgraphError("pipelined steps need CUDA (torch.cuda.is_available() is False)")
        self._torch = torch
        self.stream = torch.cuda.Stream(device=device_id)

    def provider_options(self) -> dict[str, str]:
        """The CUDA provider's options that make ORT compute on this stream."""
        return {"user_compute_stream": str(self.stream.cuda_stream), "has_user_compute_stream": "1"}

    def record(self) -> Any:
        """An event after everything enqueued on the stream so far."""
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event

    def uploads(self, arrays: Mapping[str, np.ndarray], buffers: Mapping[str, Any]) -> Uploads:
        """Asynchronous uploads into ``buffers`` (name -> device ``OrtValue``), shaped like ``arrays``."""
        return Uploads(self._torch, self.stream, arrays, buffers)


class _DeviceArray:
    """A device buffer's address as ``__cuda_array_interface__`` (version 2: no stream to wait
    on), so that torch can alias an ``OrtValue``'s memory without copying it."""

    def __init__(self, address: int, array: np.ndarray) -> None:
        self.__cuda_array_interface__ = {"shape": array.shape, "typestr": array.dtype.str,
                                         "data": (address, False), "version": 2}


class Uploads:
    """One state set's batch buffers, each with a pinned host twin: ``copy`` writes a batch to
    the pinned memory and enqueues its copies to the device on the stream, without waiting.

    The caller guarantees what the ring of state sets already guarantees for the device
    buffers: the last step that read them, and so the last copy out of the pinned memory, is
    done before ``copy`` is called for the same set again.
    """

    def __init__(self, torch: Any, stream: Any, arrays: Mapping[str, np.ndarray], buffers: Mapping[str, Any]) -> None:
        self._torch, self._stream = torch, stream
        self._items: list[tuple[str, np.ndarray, Any, Any]] = []
        for name, buf in buffers.items():
            array = np.ascontiguousarray(arrays[name])
            if array.size == 0:
                continue
            pinned = torch.from_numpy(array.copy()).pin_memory()
            device = torch.as_tensor(_DeviceArray(buf.data_ptr(), array), device=stream.device)
            self._items.append((name, pinned.numpy(), pinned, device))

    def copy(self, batch: Mapping[str, np.ndarray]) -> None:
        with self._torch.cuda.stream(self._stream):
            for name, host, pinned, device in self._items:
                np.copyto(host, batch[name], casting="no")
                device.copy_(pinned, non_blocking=True)
