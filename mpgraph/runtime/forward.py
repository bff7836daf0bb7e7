"""``Forward``: the forward part of a step graph, run on a training executor's state buffers.

``Trainer.predict``/``evaluate`` run the forward plan (``PlanOptions.forward_of``: the step
graph cut at its logits) in an inference session of its own, its parameters bound to the
executor's state buffers (no copies). Both executors (``Executor`` on one device,
``DataParallelExecutor`` on one rank) hold one and build its session on first use, on the
providers of their training session and its device id (a rank's forward session runs on the
rank's GPU, where its state lives).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from mpgraph.errors import MpgraphError
from mpgraph.io import as_model
from mpgraph.lowering import PlanOptions
from mpgraph.runtime import providers
from mpgraph.runtime.program import Program

__all__ = ["Forward"]


class Forward:
    """The forward plan of ``program`` on ``provider``, in a session made like ``like``'s."""

    def __init__(self, program: Program, provider: str) -> None:
        self.program, self.provider = program, provider
        self._session: tuple[ort.InferenceSession, str, list[str]] | None = None

    def session(self, like: ort.InferenceSession) -> tuple[ort.InferenceSession, str, list[str]]:
        """The forward session (made on first use on ``like``'s providers and their options),
        its logits output and its input names."""
        if self._session is None:
            plan = self.program.plan(self.provider, PlanOptions(forward_of=providers.logits_name(self.program.model)))
            # Only the device id is passed on: the forward session keeps ORT's defaults otherwise,
            # as it did when it got provider names alone (and so ran on GPU 0 on every rank).
            options = like.get_provider_options()
            chosen = [(p, {k: v for k, v in options.get(p, {}).items() if k == "device_id"}) for p in like.get_providers()]
            session = providers.eval_session(plan.graph, chosen)
            forward = as_model(plan.graph)  # read for its names
            self._session = (session, forward.graph.outputs[0].name or "", [v.name or "" for v in forward.graph.inputs])
        return self._session

    def predict(self, like: ort.InferenceSession, arrays: Mapping[str, np.ndarray],
                state: Mapping[str, ort.OrtValue], batch_size: int = 512) -> np.ndarray:
        """Logits of the forward model on ``arrays``, its parameters bound to ``state``."""
        session, out_name, inputs = self.session(like)
        n = len(next(iter(arrays.values())))
        parts = []
        for start in range(0, n, batch_size):
            binding = session.io_binding()
            keep = []
            for name in inputs:
                if name in self.program.state_names:
                    binding.bind_ortvalue_input(name, state[name])
                else:
                    if name not in arrays:
                        raise MpgraphError(f"evaluation data has no array for input '{name}'")
                    keep.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arrays[name][start:start + batch_size])))
                    binding.bind_ortvalue_input(name, keep[-1])
            binding.bind_output(out_name, "cpu")
            session.run_with_iobinding(binding)
            parts.append(binding.get_outputs()[0].numpy())
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)
