"""Where a launch-bound ``Trainer.step`` spends its time on ORT CUDA (CUDA graphs on).

Builds the tiny MLP of ``gpu_step.py`` (4-64-64-2, batch 64, AdamW, ``target="cuda"``), runs
it through ``Trainer`` until its CUDA graphs are captured, then times, interleaved over
rounds (median of round medians, microseconds):

- ``step``: the whole ``Trainer.step`` as a user calls it;
- ``upload``: ``update_inplace`` of the batch's input buffers (host to device);
- ``replay``: ``run_with_iobinding`` of the captured graph, without reading anything back;
- ``replay+sync``: the same, then one device sync (reading the loss);
- ``readback``: ``numpy()`` of the device loss buffer alone;
- ``cpu step``: the same step graph on ORT CPU at 2 threads, for the crossover.

With ``--kernels`` it then lists every CUDA kernel of one replayed step by name (CUPTI through
torch.profiler), in launch order: which ONNX nodes a launch-bound step spends its kernels on.

    python3 benchmarks/step_overhead_probe.py [--rounds 20] [--steps 200] [--kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402

from mpgraph.runtime.trainer import Trainer  # noqa: E402


def timer(fn: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) * 1e6 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kernels", action="store_true", help="list the kernels of one step by name")
    args = p.parse_args()
    spec = gpu_step.tiny_spec()
    cuda_graph = gpu_step.step_graphs(spec, False, ["fp32"], target="cuda")["fp32"]
    cpu_graph = gpu_step.step_graphs(spec, False, ["fp32"])["fp32"]
    trainer = Trainer(cuda_graph, "cuda")
    cpu = Trainer(cpu_graph, "cpu", threads=2)
    batch = {"x": spec.inputs[0], "label": spec.labels[0]}
    for _ in range(20):
        trainer.step(batch)
        cpu.step(batch)
    replay = trainer._replay  # noqa: SLF001 - the probe looks inside on purpose
    assert replay is not None, f"no CUDA graph: {trainer.cuda_graph_reason}"
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "1")
    # Replaying parity 0's graph again and again re-reads the same state set: the timings
    # are the launch's, the values don't matter here.
    binding = replay.bindings[0]

    def upload() -> None:
        for name, buf in replay.batch[0].items():
            buf.update_inplace(np.ascontiguousarray(batch[name]))

    parts: dict[str, Callable[[], object]] = {
        "step": lambda: trainer.step(batch),
        "upload": upload,
        "replay": lambda: replay.session.run_with_iobinding(binding, options),
        "replay+sync": lambda: (replay.session.run_with_iobinding(binding, options), replay.loss[0].numpy()),
        "readback": lambda: replay.loss[0].numpy(),
        "cpu step": lambda: cpu.step(batch),
    }
    samples: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(args.rounds):
        for name, fn in parts.items():
            samples[name].append(timer(fn, args.steps))
    print(f"{'part':<18}{'us (median)':>12}{'min':>9}{'max':>9}")
    for name, values in samples.items():
        print(f"{name:<18}{statistics.median(values):>12.1f}{min(values):>9.1f}{max(values):>9.1f}")
    if args.kernels:
        list_kernels(lambda: trainer.step(batch))


def list_kernels(step: Callable[[], object]) -> None:
    """Every CUDA kernel and copy of one step, in launch order, with its GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    print(f"-- {len(events)} kernels in one step")
    for e in events:
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        print(f"{us:8.1f} us  {e.name[:140]}")


if __name__ == "__main__":
    main()
