"""Train a step graph on ONNX Runtime (CPU or CUDA) with state resident on the device.

A ``Trainer`` is the public face of three parts: a ``Program`` (``program.py``: the step
contract and its session plans from ``mpgraph.lowering.plan_session``), an ``Executor``
(``executor.py``: one device's sessions, buffers and bindings) and the training loop
(``loop.py``/``stream.py``: steps, fit, data, checkpoints, metrics), driven by one
``RunOptions``. It runs a training step graph (``build_training_graph``, optionally converted
by ``mpgraph.convert``) in one ORT session. Every state input of ``MODEL_STATE_PAIRS``
(parameters, optimizer moments, step counter, running statistics and, with loss scaling,
``loss_scale`` and its growth tracker) lives in an ``OrtValue`` on the provider's device.
Two buffer sets and two prebuilt ``IOBinding`` objects alternate: binding A reads set 1 and
writes set 2, binding B the reverse. A step binds only the batch, runs, and copies back the
loss (and ``found_inf``/the loss scale when the graph has them), nothing else.

Before the first step the session rules of ``mpgraph.runtime.providers`` apply: the provider
must exist and be able to run the graph, and on CUDA no float node may fall back to CPU
unless ``allow_cpu_fallback=True``. ``node_providers()`` returns the assignment.

Checkpoints (``save_checkpoint``, ``mpgraph.runtime.checkpoint``) hold every state buffer,
the step count, the data stream position, the lr and a fingerprint of the graph;
``load_checkpoint`` refuses one from another graph, and continuing after it reproduces the
uninterrupted run bit for bit on CPU: ``fit`` goes on with the checkpoint's batch size and seed
when none is given and refuses other ones, or other data (``stream_settings``).

Accuracy (``evaluate``): the forward part of the step graph (from the data inputs and
parameters to the logits, planned by ``mpgraph.lowering.plan_session``) runs in an inference session on the
same provider, whose parameter inputs are bound to the trainer's state buffers, so
evaluation copies no weights.

Example:
    >>> import numpy as np
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw", lr=0.05)
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((256, 4)).astype(np.float32)
    >>> data = {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}
    >>> trainer = Trainer(step, provider="cpu", threads=1)
    >>> metrics = trainer.fit(data, steps=60, batch_size=32)
    >>> metrics.loss[-1] < metrics.loss[0], trainer.evaluate(data)["accuracy"] > 0.9
    (True, True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from mpgraph.data import Dataset, InputSpec, check_labels, dataset_for_model, token_input
from mpgraph.errors import MpgraphError, UsageError
from mpgraph.io import ModelLike, as_model
from mpgraph.runtime import providers
from mpgraph.runtime.executor import PIPELINE_MAX_STATE_MIB, Executor
from mpgraph.runtime.loop import COLLAPSE_SKIPS, NONFINITE_MODES, TrainingLoop
from mpgraph.runtime.options import RunOptions
from mpgraph.runtime.program import Program
from mpgraph.runtime.run import FinalCheckpointError, StopRequest, run_training, stop_on_signals

__all__ = [
    "Trainer",
    "RunOptions",
    "run_training",
    "stop_on_signals",
    "StopRequest",
    "FinalCheckpointError",
    "NONFINITE_MODES",
    "COLLAPSE_SKIPS",
    "PIPELINE_MAX_STATE_MIB",
]


class Trainer(TrainingLoop):
    """Runs a training step graph on ORT with its state kept on the device.

    Args:
        model: A training step graph (onnx-ir, protobuf, bytes or path).
        provider: ``cpu`` or ``cuda``.
        device_id: CUDA device ordinal.
        threads: Intra-op threads (``None``: ORT's default).
        allow_cpu_fallback: On CUDA, accept float nodes that ORT assigns to the CPU provider.
        track_scale: Read the loss scale back every step (one fp32 scalar) for the metrics.
        state: Initial state values overriding the graph's initializers.
        provider_options: Extra options for the execution provider (ORT's names and string
            values, e.g. ``{"cudnn_conv_algo_search": "HEURISTIC"}``); they win over the ones
            the trainer derives. On CUDA it derives ``arena_extend_strategy=kSameAsRequested``
            (``executor.ARENA_EXTEND_STRATEGY``: ORT's default power-of-two growth held more).
        tf32: Let float32 matmuls run as TF32 on CUDA. ``None`` reads the graph's policy
            (``mpgraph.tf32``, set by the ``tf32`` preset); absent means strict float32
            (``use_tf32=0``), because ORT's CUDA provider would otherwise use TF32 silently.
        cuda_graph: Capture the step as CUDA graphs and replay them (one per state-buffer
            parity). ``None``: on for CUDA where ORT can capture it. Needs every batch to have
            the first batch's shapes; a batch of another shape runs in a plain session.
            ``cuda_graph_reason`` says why capture is off when it is.
        kernels: Run the session's copy of the graph with mpgraph's fused kernels
            (``mpgraph.lowering.lower``: multi-tensor AdamW, casts and loss-scale unscale,
            bit-identical; the LayerNorm, GELU, attention-softmax, Relu and cross-entropy
            backwards, equal within float32 rounding; on CPU, convolutions on ORT's NCHWc
            kernels). ``None``: each provider's default (the ``default`` scope of ``mpgraph.lowering``'s rules):
            all of it on CUDA where the library builds (needs ``nvcc``); on CPU the
            convolutions, AdamW and the Relu backward (the convolutions alone where no C++
            compiler builds the library). ``True``: all of it (fails if the library cannot be
            built). ``kernels_reason`` says why less than the default runs.
        pipeline: Pipeline the steps of ``fit`` and ``step_many`` on CUDA: the host uploads
            and launches step k+1 while the GPU runs step k, and reads step k's loss once that
            step's event has passed, so it never waits for the GPU every step. ORT then
            computes on a CUDA stream the trainer owns (torch's, as the provider's
            ``user_compute_stream``), and the state has three buffer sets instead of two, so
            that a step whose loss comes back non-finite can still be undone with the step
            launched after it (``fit``'s ``on_nonfinite`` works as without pipelining). The
            results are the same bits as ``step`` one batch at a time. ``None``: on for
            ``cuda`` with CUDA graphs where torch sees the GPU (``pipeline_reason`` says why
            not). ``None`` also leaves it off when one state set is over
            ``PIPELINE_MAX_STATE_MIB``: there a step takes long enough that the host's time per
            step hardly counts (the bench GPT, 1.4 GB of state: 13.32 against 13.51 ms a step)
            and the third set costs real memory (7.3 against 5.4 GiB);
            ``benchmarks/results/gpu_step_2026-12-01T17_b.log``. ``False`` saves the third set.
        deterministic: The same bits every run on CUDA: ORT's ``use_deterministic_compute``
            (its reductions then add without atomics), cuDNN's fixed default convolution
            algorithm instead of a timed search (``cudnn_conv_algo_search=DEFAULT``, unless
            ``provider_options`` sets it), the embedding gradient's scatter-add as a
            one-hot ``Gemm`` and the bias gradients' sums as ``MatMul``s with ones (cuBLAS
            instead of ORT's deterministic reductions, which run on cuDNN;
            ``mpgraph.lowering.deterministic``; CUDA only: ORT CPU's adds in order). Needs
            strict float32 matmuls. Without it two CUDA runs of the bench GPT part after one step (bias
            gradients, the token embedding) and the DQN's (cuDNN's algorithm per session,
            ``benchmarks/results/repeat_probe_state_diff.txt``); with it the GPT's state is
            the same bits after every step (``repeat_probe_state_diff_deterministic.txt``;
            with the sums on cuBLAS ``repeat_probe_state_diff_deterministic_sums.txt``, bf16),
            at 14.6 against 13.7 ms a bf16 step (18.8 with cuDNN's sums) and 69.3
            against 68.2 fp32 (``gpu_step_2026-12-01T23_deterministic_gpt_sums.log``). The DQN was
            bit-reproducible with the default algorithm (not with the heuristic or timed
            choice); its speed that way is not measured.
        mem_pattern: ORT's memory pattern (``SessionOptions.enable_mem_pattern``): from the
            second run on, one planned block for every intermediate, on top of the arena
            regions the first run made, so activations are held about twice. ``None``: off for
            the sessions that capture CUDA graphs (a captured step allocates nothing per run
            anyway: the bench GPT's bf16 step holds 6.4 instead of 10.5 GiB at the same speed,
            ``benchmarks/results/mem_pattern_ab.log``), ORT's default (on) otherwise.

        inplace_state: Write each updated state value (parameters, Adam's moments) into its
            input's device buffer instead of a second set, as PyTorch's optimizers do: one copy
            of the state instead of two (GPT-2 small: 1.49 GB less). Only where
            ``mpgraph._ir.inplace`` proves it safe in the session's graph (the update is
            elementwise, and every other reader of the old value is an ancestor of it, so ORT
            runs it first); the other values keep two buffers, and a log line says why. The
            price: ``fit`` cannot undo a non-finite step (its rule 7), and no pipelining.
            ``None``: on for CUDA when one state set is over ``PIPELINE_MAX_STATE_MIB``
            (then no pipelining), off otherwise. With CUDA graphs a graph's first launch runs
            the step twice (ORT's capture), so the executor puts the state back and runs the
            captured graph once more: the same bits as two sets on the H200
            (``tests/test_gpu_inplace.py``, 2026-12-03).
            ``inplace`` names the values, ``inplace_reason`` why none or not all are.

        options: All of the above as one ``RunOptions`` (``provider`` and keywords given as
            well win over it).

    The parts: ``program`` (the step contract and its session plans), ``executor`` (the
    device: sessions, buffers, CUDA-graph replay, pipelining) and the loop this class is
    (``TrainingLoop``: steps, fit, the data stream, checkpoints).

    Raises:
        MpgraphError: Not a step graph, provider unavailable, a native low-precision graph on
            CPU, or (CUDA) float nodes falling back to CPU.
    """

    def __init__(
        self,
        model: ModelLike,
        provider: str = "cpu",
        *,
        device_id: int = 0,
        threads: int | None = None,
        allow_cpu_fallback: bool = False,
        track_scale: bool = True,
        state: Mapping[str, np.ndarray] | None = None,
        provider_options: Mapping[str, str] | None = None,
        tf32: bool | None = None,
        cuda_graph: bool | None = None,
        kernels: bool | None = None,
        mem_pattern: bool | None = None,
        pipeline: bool | None = None,
        deterministic: bool = False,
        inplace_state: bool | None = None,
        options: RunOptions | None = None,
    ) -> None:
        keywords = RunOptions(
            provider=provider, device_id=device_id, threads=threads, allow_cpu_fallback=allow_cpu_fallback,
            track_scale=track_scale, provider_options=dict(provider_options or {}), tf32=tf32, cuda_graph=cuda_graph,
            kernels=kernels, mem_pattern=mem_pattern, pipeline=pipeline, deterministic=deterministic,
            inplace_state=inplace_state)
        if options is not None and keywords != RunOptions():
            raise UsageError("Trainer: give the run options either as keywords or as options=RunOptions(...), not both")
        #: How this trainer runs (the keywords above as one record).
        self.options = options or keywords
        model = as_model(model)
        self.program = Program(model, state)
        #: Notes about running this graph on ``provider`` (``mpgraph.targets.check_runnable``,
        #: which refuses a graph converted for a target whose kernels ``provider`` lacks).
        self.notes: list[str] = providers.check_provider(model, self.options.provider)
        self.executor = Executor(self.program, self.options)
        self._start_loop()

    # -- what the parts answer ---------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self.executor.provider

    @property
    def device(self) -> str:
        return self.executor.device

    @property
    def device_id(self) -> int:
        return self.executor.device_id

    @property
    def pipeline(self) -> bool:
        return self.executor.pipeline

    @property
    def pipeline_reason(self) -> str:
        return self.executor.pipeline_reason

    @property
    def inplace(self) -> frozenset[str]:
        return self.executor.inplace

    @property
    def inplace_reason(self) -> str:
        return self.executor.inplace_reason

    @property
    def tf32(self) -> bool:
        return self.executor.tf32

    @property
    def provider_options(self) -> dict[str, str]:
        return self.executor.provider_options

    @property
    def kernels_reason(self) -> str:
        return self.executor.kernels_reason

    @property
    def kernels_fused(self) -> int:
        return self.executor.kernels_fused

    @property
    def deterministic_rewrites(self) -> int:
        return self.executor.deterministic_rewrites

    @property
    def session(self) -> ort.InferenceSession:
        return self.executor.session

    @property
    def cuda_graph(self) -> bool:
        return self.executor.cuda_graph

    @property
    def cuda_graph_reason(self) -> str:
        return self.executor.cuda_graph_reason

    @property
    def model(self) -> ir.Model:
        return self.program.model

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return self.program.pairs

    @property
    def fingerprint(self) -> str:
        return self.program.fingerprint

    @property
    def default_lr(self) -> float | None:
        return self.program.default_lr

    @property
    def loss_name(self) -> str:
        return self.program.loss_name

    @property
    def found_inf_name(self) -> str | None:
        return self.program.found_inf_name

    @property
    def data_inputs(self) -> list[InputSpec]:
        return self.program.data_inputs

    @property
    def _lr_value(self) -> float | None:
        """The lr the steps read (a resumed checkpoint's, the last given, or the graph's)."""
        return self.executor.lr

    # -- data checks ----------------------------------------------------------------------

    def label_bounds(self) -> dict[str, tuple[int, int | None]]:
        """``Program.label_bounds``: label inputs with (classes, ignore_index)."""
        return self.program.label_bounds()

    def vocab(self, token_input: str) -> int | None:
        """``Program.vocab``: rows of the embedding table a token input indexes."""
        return self.program.vocab(token_input)

    def load_data(self, name: str | os.PathLike[str], *, seed: int = 0) -> Dataset:
        """The dataset ``name`` (``digits``, ``sequence`` or a ``.npz``) fitted to this graph.

        A token input's vocabulary is the embedding table's row count, and the labels of
        both splits are checked against the loss's class count (``label_bounds``).

        Raises:
            DataError: Unknown dataset, arrays that do not fit the inputs, or labels out of range.
        """
        specs: list[InputSpec] = self.program.data_inputs
        tok = token_input(specs)
        vocab = self.vocab(tok.name) if tok is not None else None
        dataset = dataset_for_model(name, specs, seed=seed, vocab=vocab)
        bounds = self.label_bounds()
        check_labels(dataset.train, bounds, f"dataset '{name}'")
        check_labels(dataset.test, bounds, f"dataset '{name}' (test split)")
        return dataset

    # -- inspection and evaluation --------------------------------------------------------

    def node_providers(self) -> dict[str, str]:
        """Node name -> execution provider ORT assigned it (empty if this ORT cannot say)."""
        return self.executor.node_providers()

    def predict(self, arrays: Mapping[str, np.ndarray], batch_size: int = 512) -> np.ndarray:
        """Logits of the forward model on ``arrays`` with the current parameters."""
        settled: Mapping[str, ort.OrtValue] = self._settled()[0]
        return self.executor.predict(arrays, settled, batch_size)

    def evaluate(self, arrays: Mapping[str, np.ndarray], *, label: str = "label", batch_size: int = 512) -> dict[str, float]:
        """Classification accuracy of the current parameters on ``arrays`` (e.g. a test split).

        Logits ``[..., C]`` are compared with integer labels position by position (a language
        model's ``[N*T, C]`` logits with ``[N, T]`` labels work too). A training-mode
        BatchNormalization in the step graph normalises with batch statistics here as well.
        """
        if label not in arrays or np.asarray(arrays[label]).dtype.kind not in "iu":
            raise MpgraphError(f"cannot evaluate accuracy: no integer '{label}' array")
        logits = self.predict(arrays, batch_size)
        labels = np.asarray(arrays[label]).reshape(-1)
        pred = logits.reshape(-1, logits.shape[-1]).argmax(-1)
        if pred.shape != labels.shape:
            raise MpgraphError(f"cannot evaluate: {pred.size} predictions for {labels.size} labels")
        return {"accuracy": float((pred == labels).mean()), "samples": float(labels.size)}
