"""Test support: step a training graph on ONNX Runtime CPU, feeding state outputs back as inputs.

The state pairs come from the model's ``MODEL_STATE_PAIRS`` metadata; initial state values
are the same-named initializers that ``build_training_graph`` writes.

Example:
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="sgd")  # doctest: +SKIP
    >>> runner = CpuRunner(step)  # doctest: +SKIP
    >>> loss = runner.step({"x": x, "label": y}, lr=0.1)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from mpgraph._ir.meta import MODEL_STATE_PAIRS
from mpgraph.errors import MpgraphError

__all__ = ["CpuRunner"]


class CpuRunner:
    """Runs a training step graph N times on the ORT CPU provider.

    State (parameters, optimizer moments, step counter, running statistics) stays in ORT
    ``OrtValue`` buffers between steps: each step writes updated state into a second set of
    buffers, then the two sets swap, so no state is copied through numpy.

    Args:
        model: A training step graph (onnx-ir model, serialized bytes or path).
        threads: Intra-op threads (``None``: ORT's default).
        state: Initial state values overriding the model's initializers.
        spin: Let ORT's worker threads spin between steps (fastest when ORT owns the cores;
            turn off when other work, such as a torch reference, shares them).
    """

    def __init__(
        self,
        model: ir.Model | bytes | str | os.PathLike[str],
        *,
        threads: int | None = None,
        state: Mapping[str, np.ndarray] | None = None,
        spin: bool = True,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            model = ir.load(str(model))
        elif isinstance(model, bytes):
            import onnx

            model = ir.from_proto(onnx.load_from_string(model))
        raw = model.metadata_props.get(MODEL_STATE_PAIRS)
        if raw is None:
            raise MpgraphError("not a training step graph: no mpgraph.state_pairs metadata; run train-graph first")
        self.pairs: list[tuple[str, str]] = [(a, b) for a, b in json.loads(raw)]
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads is not None:
            options.intra_op_num_threads = threads
        if not spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        inits = model.graph.initializers
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._state = {}
        for name, _ in self.pairs:
            if state is not None and name in state:
                value = state[name]
            else:
                tensor = inits[name].const_value if name in inits else None
                if tensor is None:
                    raise MpgraphError(f"state input '{name}' has no initial value; pass it in state=")
                value = tensor.numpy()
            # A copy: an OrtValue over the initializer's own memory would write the trained
            # weights back into the model (a later convert() would start from them).
            self._state[name] = ort.OrtValue.ortvalue_from_numpy(np.array(value, copy=True, order="C"))
        self._spare = {
            name: ort.OrtValue.ortvalue_from_numpy(np.empty_like(self._state[name].numpy()))
            for name, _ in self.pairs
        }
        self.loss_name = self.output_names[0]
        self.steps = 0

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Current state values (copies), by input name."""
        return {k: v.numpy().copy() for k, v in self._state.items()}

    def step(self, feeds: Mapping[str, np.ndarray], *, lr: float | None = None) -> float:
        """Run one step and return the loss.

        Args:
            feeds: Data inputs (e.g. ``x``, ``label``).
            lr: Learning rate for this step (``None``: the graph's default).
        """
        binding = self.session.io_binding()
        # Inputs that have initializers (lr, state) are bound as OrtValues: ORT's
        # bind_cpu_input only knows inputs without initializers.
        keep = []
        for name, value in feeds.items():
            keep.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value)))
            binding.bind_ortvalue_input(name, keep[-1])
        if lr is not None:
            keep.append(ort.OrtValue.ortvalue_from_numpy(np.asarray(lr, dtype=np.float32)))
            binding.bind_ortvalue_input("lr", keep[-1])
        for name, value in self._state.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(self.loss_name, "cpu")
        for name, out in self.pairs:
            binding.bind_ortvalue_output(out, self._spare[name])
        self.session.run_with_iobinding(binding)
        self._state, self._spare = self._spare, self._state
        self.steps += 1
        return float(binding.get_outputs()[0].numpy())

    def run(self, batches: Iterable[Mapping[str, np.ndarray]], *, lr: float | None = None) -> list[float]:
        """Run one step per batch; return the losses."""
        return [self.step(b, lr=lr) for b in batches]
