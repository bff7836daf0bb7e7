"""A CUDA stream and per-step events for pipelined training steps (``Trainer.step_many``).

ORT runs a session's CUDA work on its own stream, and nothing in its Python API waits for one
step alone: a run either synchronises the device at its end or returns at once. To let the host
enqueue step k+1 while the GPU runs step k, and still read step k's loss only once step k is
done, the ``Trainer`` gives ORT a stream it owns (the CUDA provider's ``user_compute_stream``)
and records an event on it after every step. ``benchmarks/results/pipeline_probe.txt`` shows why the
events matter: without them the host's copies (``update_inplace``, ``numpy()``) are not ordered
after ORT's work, and the pipelined tiny MLP trained a different model from its third step.

The stream and events come from torch (a dependency of mpgraph for export and reference), so
that no CUDA runtime binding of our own is needed.
"""

from __future__ import annotations

from typing import Any

from mpgraph.errors import MpgraphError

__all__ = ["StepEvents"]


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
