"""Time one ONNX Runtime session with its inputs and outputs on the device (IOBinding)."""

from __future__ import annotations

import statistics
import time

import numpy as np


def time_session(session: object, feeds: dict[str, np.ndarray], device: str, rounds: int,
                 iters: int) -> tuple[float, dict[str, np.ndarray]]:
    """Median ms per run over ``rounds`` rounds of ``iters`` runs, after three warm-up runs,
    and the outputs by name; ``device`` is ``cuda`` or ``cpu``."""
    import onnxruntime as ort

    binding = session.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(feeds[i.name], device, 0) for i in session.get_inputs()]
    for i, value in zip(session.get_inputs(), keep, strict=True):
        binding.bind_ortvalue_input(i.name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name, device, 0)
    for _ in range(3):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - start) * 1e3 / iters)
    outs = dict(zip([o.name for o in session.get_outputs()], binding.copy_outputs_to_cpu(), strict=True))
    return statistics.median(times), outs
