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


def time_graph(graph: bytes, provider: str, feeds: dict[str, np.ndarray], rounds: int, iters: int,
               custom_ops: str | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """``time_session`` of a new session of ``graph`` on ``provider`` (``cuda`` or ``cpu``),
    with the kernel library ``custom_ops`` registered when given."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if custom_ops:
        options.register_custom_ops_library(custom_ops)
    ep = "CUDAExecutionProvider" if provider == "cuda" else "CPUExecutionProvider"
    session = ort.InferenceSession(graph, options, providers=[ep])
    return time_session(session, feeds, "cuda" if provider == "cuda" else "cpu", rounds, iters)
