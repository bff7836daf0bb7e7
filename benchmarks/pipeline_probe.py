"""Can ORT run a launch-bound training step pipelined, host ahead of the GPU, and still train the
same model? A probe for issue 11's "never a sync per step" (the Trainer does not pipeline).

The tiny MLP of ``gpu_step.py`` (4-64-64-2, batch 64, AdamW, ``target="cuda"``), captured as CUDA
graphs the way ``Trainer`` does, but with a batch buffer set and a loss buffer per state parity,
so that the batch of step k+1 can be uploaded while step k may still run. Three loops over the
same batches from the same initial state, each timed in rounds (median, microseconds a step):

- ``trainer``: ``Trainer.step`` as a user calls it (reference losses);
- ``sync``: this probe's replica of it (upload, replay with ORT's end-of-run sync, read loss);
- ``pipelined``: upload into parity p's buffers, replay with
  ``disable_synchronize_execution_providers=1``, then read step k-1's loss from the other
  parity's buffer while step k may run. With ``--events`` ORT computes on a CUDA stream the
  probe owns (a torch stream passed as ``user_compute_stream``) and the host waits for step
  k-1's event before that read; without, nothing orders the host's copies after ORT's work.
  The timed loop ends with a device-wide sync, so its time includes all the GPU's work.

It then checks that the pipelined loop's losses and final state equal the reference's bit for
bit (a race between an upload and a replay still reading that buffer, or a loss read before its
step finished, would show as a mismatch). ``OrtValue.update_inplace`` and ``numpy()`` copy on
CUDA's legacy default stream; whether those wait for ORT's compute stream is what this decides.

    python3 benchmarks/pipeline_probe.py [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_step  # noqa: E402

from mpgraph.io import as_model  # noqa: E402
from mpgraph.runtime.trainer import Trainer  # noqa: E402
from mpgraph.specialize import specialize_shapes  # noqa: E402


class Pipeline:
    """Two captured graphs (one per state parity), each with its own batch and loss buffers."""

    def __init__(self, graph: object, batch: dict[str, np.ndarray], events: bool = False) -> None:
        # events: ORT computes on a stream this probe owns (torch's; ORT's user_compute_stream
        # option), so each step's completion is an event the host can wait for alone.
        self.stream = torch.cuda.Stream() if events else None
        options = {"user_compute_stream": str(self.stream.cuda_stream), "has_user_compute_stream": "1"} if events else None
        self.done: list = [None, None]
        t = self.trainer = Trainer(graph, "cuda", cuda_graph=False, provider_options=options)
        t._bind_lr(None)  # noqa: SLF001 - the probe builds what Trainer._start_replay builds, twice over
        fixed = specialize_shapes(as_model(t._session_bytes), {n: list(a.shape) for n, a in batch.items()})  # noqa: SLF001
        self.session = t._new_session(graph=True, model=fixed)  # noqa: SLF001
        out = {o.name: o for o in self.session.get_outputs()}
        self.loss = [t._out_buffer(out[t.loss_name], "cuda") for _ in range(2)]  # noqa: SLF001
        lr = ort.OrtValue.ortvalue_from_numpy(np.asarray(t._lr_value, np.float32), "cuda", 0)  # noqa: SLF001
        self.batch = [{n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", 0) for n, a in batch.items()}
                      for _ in range(2)]
        state, spare = t._state, t._spare  # noqa: SLF001
        self.bindings = [t._make_binding(self.session, state, spare, self.loss[0], None, lr),  # noqa: SLF001
                         t._make_binding(self.session, spare, state, self.loss[1], None, lr)]  # noqa: SLF001
        for p in range(2):
            for n, buf in self.batch[p].items():
                self.bindings[p].bind_ortvalue_input(n, buf)
        self.options = []
        for sync in (True, False):
            pair = []
            for p in range(2):
                o = ort.RunOptions()
                o.add_run_config_entry("gpu_graph_id", str(1 + p))
                if not sync:
                    o.add_run_config_entry("disable_synchronize_execution_providers", "1")
                pair.append(o)
            self.options.append(pair)
        self.k = 0

    def state(self) -> dict[str, np.ndarray]:
        t = self.trainer
        current = t._state if self.k % 2 == 0 else t._spare  # noqa: SLF001
        return {name: current[name].numpy().copy() for name, _ in t.pairs}

    def step(self, batch: dict[str, np.ndarray], sync: bool) -> float | None:
        """Run one step; the loss of this step (sync) or of the one before it (pipelined)."""
        p = self.k % 2
        for n, buf in self.batch[p].items():
            buf.update_inplace(np.ascontiguousarray(batch[n]))
        self.session.run_with_iobinding(self.bindings[p], self.options[0 if sync else 1][p])
        if self.stream is not None:
            self.done[p] = torch.cuda.Event()
            self.done[p].record(self.stream)
        self.k += 1
        if sync:
            return float(self.loss[p].numpy().reshape(-1)[0])
        if self.k == 1:
            return None
        if self.stream is not None:
            self.done[1 - p].synchronize()  # step k-1 only: step k may still run
        return float(self.loss[1 - p].numpy().reshape(-1)[0])

    def drain(self) -> float:
        """The last step's loss (after a pipelined loop), once the device is idle."""
        torch.cuda.synchronize()
        return float(self.loss[(self.k - 1) % 2].numpy().reshape(-1)[0])


def run_pipelined(pipe: Pipeline, batches: list[dict[str, np.ndarray]], steps: int, warm: int = 0) -> list[float]:
    """``steps`` steps, the first ``warm`` in sync (ORT captures each parity's graph on its
    first runs), the rest pipelined; every step's loss."""
    losses = [pipe.step(batches[i % len(batches)], sync=True) for i in range(warm)]
    for i in range(warm, steps):
        previous = pipe.step(batches[i % len(batches)], sync=False)
        if previous is not None and i > warm:
            losses.append(previous)
    losses.append(pipe.drain())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=0, help="steps run in sync before pipelining (the graphs' capture)")
    p.add_argument("--events", action="store_true", help="ORT on a stream of the probe's; wait for each step's event")
    args = p.parse_args()
    spec = gpu_step.tiny_spec()
    graph = gpu_step.step_graphs(spec, False, ["fp32"], target="cuda")["fp32"]
    batches = [{"x": spec.inputs[i], "label": spec.labels[i]} for i in range(len(spec.inputs))]

    # Same model and batches three ways: the reference Trainer, the replica in sync, pipelined.
    ref = Trainer(graph, "cuda")
    ref_losses = [ref.step(batches[i % 4]).loss for i in range(args.steps)]
    replica = Pipeline(graph, batches[0])
    sync_losses = [replica.step(batches[i % 4], sync=True) for i in range(args.steps)]
    pipe = Pipeline(graph, batches[0], events=args.events)
    pipe_losses = run_pipelined(pipe, batches, args.steps, warm=args.warm)
    ref_state, pipe_state = ref.state, pipe.state()
    same_sync = sync_losses == ref_losses
    same_pipe = pipe_losses == ref_losses and all(np.array_equal(ref_state[k], pipe_state[k]) for k in ref_state)
    first_bad = next((i for i, (a, b) in enumerate(zip(pipe_losses, ref_losses)) if a != b), None)
    print(f"{args.steps} steps from the same state: replica (sync) equals Trainer: {same_sync}; "
          f"pipelined equals Trainer (losses and final state): {same_pipe}"
          + (f" (first differing step {first_bad}: {pipe_losses[first_bad]!r} vs {ref_losses[first_bad]!r})" if first_bad is not None else ""))
    # Which race: a stale loss read leaves the state right and reads an older step's loss;
    # an upload overwriting a batch still in use changes the training itself.
    same_state = all(np.array_equal(ref_state[k], pipe_state[k]) for k in ref_state)
    bad = [i for i, (a, b) in enumerate(zip(pipe_losses, ref_losses)) if a != b]
    stale = {lag: sum(1 for i in bad if i >= lag and pipe_losses[i] == ref_losses[i - lag]) for lag in (1, 2, 3, 4)}
    print(f"  final state equal: {same_state}; {len(bad)} of {len(ref_losses)} losses differ; of those, equal to the "
          f"reference loss 1/2/3/4 steps earlier: {stale[1]}/{stale[2]}/{stale[3]}/{stale[4]}")

    # The Trainer's own pipelined path (Trainer(pipeline=True).step_many), built on what this
    # probe showed: the same batches from the same state, compared bit for bit too.
    piped = Trainer(graph, "cuda", pipeline=True)
    many = [r.loss for r in piped.step_many([batches[i % 4] for i in range(args.steps)])]
    many_state = piped.state
    print(f"  Trainer(pipeline=True).step_many equals Trainer.step: losses {many == ref_losses}, "
          f"final state {all(np.array_equal(ref_state[k], many_state[k]) for k in ref_state)}")

    timings: dict[str, list[float]] = {"trainer": [], "sync": [], "pipelined": [], "step_many": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        for i in range(args.steps):
            ref.step(batches[i % 4])
        timings["trainer"].append((time.perf_counter() - start) * 1e6 / args.steps)
        start = time.perf_counter()
        for i in range(args.steps):
            replica.step(batches[i % 4], sync=True)
        timings["sync"].append((time.perf_counter() - start) * 1e6 / args.steps)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_pipelined(pipe, batches, args.steps)  # ends with a device-wide sync: the GPU's work is in
        timings["pipelined"].append((time.perf_counter() - start) * 1e6 / args.steps)
        start = time.perf_counter()
        piped.step_many([batches[i % 4] for i in range(args.steps)])  # ends with its last step's event
        timings["step_many"].append((time.perf_counter() - start) * 1e6 / args.steps)
    print(f"{'loop':<12}{'us/step (median)':>18}{'min':>9}{'max':>9}")
    for name, values in timings.items():
        print(f"{name:<12}{statistics.median(values):>18.1f}{min(values):>9.1f}{max(values):>9.1f}")


if __name__ == "__main__":
    main()
