"""``real_models.py``'s models and rows: the constants, the log, the model cases and their
seeded batches, the exported loss graphs and step graphs (``prepare``, built ahead of the GPU
by ``Preparer``), and the torch and mpgraph configurations a row runs. Imported by
``real_models.py``, which puts this folder on ``sys.path``.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from step_timing import (
    Run,
    error_line,
)

MODELS = ("gpt2", "llama", "bert", "vit")
EXPORTERS = ("torchscript", "dynamo")
TITLES = {"gpt2": "GPT-2 small", "llama": "Llama-style 125M (GQA, RoPE, RMSNorm, SwiGLU)",
          "bert": "BERT-base, masked LM", "vit": "ViT-B/16, classification"}
#: The exporters' opsets: the TorchScript exporter's usual one; 23 is where the dynamo exporter
#: writes HF's sdpa attention as ONNX ``Attention``.
OPSETS = {"torchscript": 18, "dynamo": 23}
#: AdamW as torch's defaults, the same on both sides.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
BATCHES = 4  # distinct batches, cycled
#: bf16 dense matmul rate measured on the H200 with torch (DESIGN.md: 8192^3 MatMul).
BF16_PEAK_TFLOPS = 796.0

EAGER, COMPILED, CPU_TWIN = "torch amp bf16", "torch compile bf16", "torch fp32 cpu"
#: ``--compile-modes``: torch.compile's mode -> its row. Only "default" is judged (``verdicts``);
#: "reduce-overhead" (Inductor's CUDA graph trees) is printed beside it (``cudagraphs_table``).
CUDAGRAPHS = "torch compile cudagraphs bf16"
COMPILE_MODES = {"default": COMPILED, "reduce-overhead": CUDAGRAPHS}
#: The eager row once more, from the same weights and batches, for ``--check-step`` steps only:
#: torch's own run-to-run loss spread, measured in the same run (issue 30's dloss line).
RERUN = " rerun"
#: Steps a configuration takes in its memory child: the first three (warm-up, CUDA-graph
#: capture, arena growth) and one more.
MEMORY_STEPS = 4
GPU_POLICIES = ("bf16", "tf32", "fp16")
CPU_POLICIES = ("fp32", "bf16", "fp16")  # bf16 and fp16 emulated (DESIGN.md: CPU semantics)
NOTES = {"tf32": "float32 GEMMs as TF32 (ORT CUDA default)", "fp16": "dynamic loss scaling"}
#: A policy with this suffix is converted from a step graph built with ``pad_gemms=False``: the
#: A/B of ``PadGemmColumnsPass`` (on by default for ``target="cuda"``) in the same run.
UNPADDED = "-unpadded"


_START = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - _START


def reset_clock() -> None:
    """The time budget (``--time-budget``) and the log's seconds count from here."""
    global _START
    _START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{_elapsed():6.1f}s] {message}", flush=True)


# -- models --------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelCase:
    name: str
    module: torch.nn.Module  # train mode, HF's default attention
    batches: list[dict[str, np.ndarray]]
    flops_per_step: float


def _flops(module: torch.nn.Module, tokens: int, layers: int, batch: int, seq: int, width: int) -> float:
    """6 FLOP per matmul weight per token (forward 2, backward 4: Linear and the patch Conv; the
    tied LM head counted once) plus attention's two T x T x d products per layer (forward
    4*T^2*d, three times that with backward); no causal saving."""
    weights = {id(m.weight): m.weight.numel() for m in module.modules()
               if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)}
    return 6.0 * sum(weights.values()) * tokens + 12.0 * layers * batch * seq * seq * width


@functools.lru_cache(maxsize=1)
def build_case(name: str, small: bool, seed: int = 0) -> ModelCase:
    """The model (random init from ``seed``) and its batches, the same in every process."""
    import transformers as tf

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    batch = 4 if small else 8
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if name in ("gpt2", "llama"):
        seq, vocab = (64, 256) if small else (1024, 50257 if name == "gpt2" else 32000)
        if name == "gpt2":
            size = dict(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0) if small else {}
            config = tf.GPT2Config(**size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
            module = tf.GPT2LMHeadModel(config)
            layers, width = config.n_layer, config.n_embd
        else:
            size = dict(tiny, num_key_value_heads=2, bos_token_id=0, eos_token_id=0) if small else dict(
                hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4)
            config = tf.LlamaConfig(**size, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
                                    tie_word_embeddings=False)
            module = tf.LlamaForCausalLM(config)
            layers, width = config.num_hidden_layers, config.hidden_size
        tokens = [rng.integers(0, vocab, (batch, seq), dtype=np.int64) for _ in range(BATCHES)]
        batches = [{"input_ids": t, "labels": t} for t in tokens]
    elif name == "bert":
        seq = 64 if small else 512
        size = dict(tiny, vocab_size=256, max_position_embeddings=seq) if small else {}
        config = tf.BertConfig(**size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        module = tf.BertForMaskedLM(config)
        mask_id = 4 if small else 103  # bert-base-uncased's [MASK]
        batches = []
        for _ in range(BATCHES):
            tokens = rng.integers(5, config.vocab_size, (batch, seq), dtype=np.int64)
            masked = rng.random((batch, seq)) < 0.15
            batches.append({"input_ids": np.where(masked, mask_id, tokens), "labels": np.where(masked, tokens, -100)})
        layers, width = config.num_hidden_layers, config.hidden_size
    elif name == "vit":
        size = dict(tiny, image_size=32, patch_size=8) if small else {}
        config = tf.ViTConfig(**size, num_labels=10 if small else 1000)
        module = tf.ViTForImageClassification(config)
        side = config.image_size
        batches = [{"pixel_values": rng.standard_normal((batch, 3, side, side)).astype(np.float32),
                    "labels": rng.integers(0, config.num_labels, (batch,), dtype=np.int64)} for _ in range(BATCHES)]
        seq = (side // config.patch_size) ** 2 + 1
        layers, width = config.num_hidden_layers, config.hidden_size
    else:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(MODELS)}")
    module.train()
    return ModelCase(name, module, batches, _flops(module, batch * seq, layers, batch, seq, width))


def fingerprint(module: torch.nn.Module) -> str:
    """A hash of the parameters: the worker that exported a model built the same weights."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- export and step graphs --------------------------------------------------------------


class _Loss(torch.nn.Module):
    """The model's own loss from the batch tensors, in the batch's key order.

    ``full_mask``: pass an all-ones ``attention_mask`` made in the graph. Without a mask, HF's
    causal LMs look for packed sequences in the position ids with ``torch.diff``, which the
    TorchScript exporter cannot write ("Exporting the operator 'aten::diff' to ONNX opset
    version 18 is not supported"); with one they build the causal and padding mask instead,
    which computes the same attention.
    """

    def __init__(self, model: torch.nn.Module, keys: Sequence[str], full_mask: bool = False) -> None:
        super().__init__()
        self.model = model  # registered: the TorchScript exporter finds the parameters through it
        self.keys = list(keys)
        self.full_mask = full_mask

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        inputs = dict(zip(self.keys, batch, strict=True))
        if self.full_mask:
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        return self.model(**inputs).loss


class _LossOfParameters(torch.nn.Module):
    """``_Loss`` with the parameters as leading inputs (``torch.func.functional_call``)."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], keys: Sequence[str]) -> None:
        super().__init__()
        # Not registered: its own parameters would become dead initializers.
        self.__dict__["model"] = model
        self.names, self.keys = list(names), list(keys)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        n = len(self.names)
        params = dict(zip(self.names, args[:n], strict=True))
        batch = dict(zip(self.keys, args[n:], strict=True))
        return torch.func.functional_call(self.model, params, (), batch).loss


def export_loss_graph(case: ModelCase, exporter: str) -> Any:
    """The forward graph whose only output is the loss (an ``onnx.ModelProto``)."""
    import onnx
    from onnx import numpy_helper

    module = copy.deepcopy(case.module).eval()  # dropout is off: eval and train compute alike
    keys = list(case.batches[0])
    batch = tuple(torch.from_numpy(case.batches[0][k]) for k in keys)
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            module.set_attn_implementation("eager")
            f = io.BytesIO()
            causal = case.name in ("gpt2", "llama")
            torch.onnx.export(_Loss(module, keys, full_mask=causal), batch, f, dynamo=False, opset_version=OPSETS[exporter],
                              do_constant_folding=False, keep_initializers_as_inputs=True,
                              input_names=keys, output_names=["loss"])
            return onnx.load_from_string(f.getvalue())
        names = [n for n, _ in module.named_parameters()]
        params = tuple(p.detach() for p in module.parameters())
        program = torch.onnx.export(_LossOfParameters(module, names, keys), params + batch, dynamo=True,
                                    # optimize: without it GPT-2's qkv split stays SplitToSequence
                                    # + SequenceAt, which train-graph has no gradient rule for.
                                    opset_version=OPSETS[exporter], optimize=True, verbose=False,
                                    input_names=names + keys, output_names=["loss"])
    proto = program.model_proto
    present = {i.name for i in proto.graph.input}
    values = dict(zip(names, params, strict=True))
    proto.graph.initializer.extend(numpy_helper.from_array(values[n].numpy(), n) for n in names if n in present)
    return proto


@dataclasses.dataclass(frozen=True)
class PrepJob:
    """What a worker builds: one model's step graphs for one exporter, one file per policy."""

    model: str
    exporter: str
    small: bool
    seed: int
    policies: tuple[str, ...]
    emulate: bool
    target: str | None
    workdir: str
    canonicalize: bool | None = None


def prepare(job: PrepJob) -> dict[str, Any]:
    """Export, ``build_training_graph`` and ``convert`` per policy; files in ``job.workdir``.

    Every stage's failure is recorded as its one-line error, never raised."""
    import onnx_ir as ir

    import mpgraph
    from mpgraph.io import save_model
    from mpgraph.training import MAX_IR_VERSION, build_training_graph, state_pairs

    case = build_case(job.model, job.small, job.seed)
    out: dict[str, Any] = {"model": job.model, "exporter": job.exporter, "fingerprint": fingerprint(case.module),
                           "graphs": {}, "errors": {}, "seconds": {}, "notes": []}
    t = time.perf_counter()
    try:
        proto = export_loss_graph(case, job.exporter)
    except Exception as e:  # noqa: BLE001 - torch raises many types from its exporters
        out["errors"]["export"] = error_line(e)
        return out
    out["seconds"]["export"] = time.perf_counter() - t
    ops = [n.op_type for n in proto.graph.node]
    out["forward_nodes"], out["attention_nodes"] = len(ops), ops.count("Attention")
    t = time.perf_counter()
    steps = {}
    try:
        for pad in (None, False) if any(p.endswith(UNPADDED) for p in job.policies) else (None,):
            canonical = {} if job.canonicalize is None else {"canonicalize": job.canonicalize}
            steps[pad] = build_training_graph(proto, optimizer="adamw", lr=LR, target=job.target, pad_gemms=pad,
                                              **canonical,
                                              optimizer_options={"beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
                                                                 "weight_decay": WEIGHT_DECAY})
    except Exception as e:  # noqa: BLE001 - the row says what train-graph refused
        out["errors"]["train-graph"] = error_line(e)
        return out
    out["seconds"]["train-graph"] = time.perf_counter() - t
    del proto
    step = steps[None]
    out["padded_gemms"] = sum(1 for n in step.graph if n.op_type == "Slice" and n.name.startswith("align/"))
    out["step_nodes"] = sum(1 for _ in step.graph)
    # Every torch parameter must be a trained value; the TorchScript export names them under
    # the loss wrapper's attribute ``model.``.
    state = {a for a, _ in state_pairs(step)}
    prefix = "model." if job.exporter == "torchscript" else ""
    torch_names = [n for n, _ in case.module.named_parameters()]
    missing = [n for n in torch_names if prefix + n not in state]
    out["trained_parameters"] = f"{len(torch_names) - len(missing)}/{len(torch_names)}"
    if missing:
        out["notes"].append(f"trains {out['trained_parameters']} torch parameters (missing {', '.join(missing[:3])})")
    for k, policy in enumerate(job.policies):
        t = time.perf_counter()
        try:
            base, pad = (policy[: -len(UNPADDED)], False) if policy.endswith(UNPADDED) else (policy, None)
            last = not any(p.endswith(UNPADDED) == (pad is False) for p in job.policies[k + 1:])
            graph = steps[pad] if last else ir.from_proto(ir.to_proto(steps[pad]))
            if base != "fp32":
                # calibrate=None: the fp16 range check runs the step on ORT CPU (minutes at this
                # size); these rows measure speed, and fp16 has dynamic loss scaling.
                graph = mpgraph.convert(graph, base, emulate=job.emulate, validate=False, calibrate=None,
                                        target=job.target)
            if graph.ir_version > MAX_IR_VERSION:  # onnxruntime-gpu 1.31 loads ir_version <= 13
                graph.ir_version = MAX_IR_VERSION
            path = os.path.join(job.workdir, f"{job.model}_{job.exporter}_{policy}.onnx")
            save_model(graph, path)
            out["graphs"][policy] = path
        except Exception as e:  # noqa: BLE001 - the row says what convert refused
            out["errors"][policy] = error_line(e)
        out["seconds"][f"convert {policy}"] = time.perf_counter() - t
    return out


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")


def _failed(model: str, exporter: str, e: BaseException) -> dict[str, Any]:
    return {"model": model, "exporter": exporter, "graphs": {}, "seconds": {}, "notes": [],
            "errors": {"prep": error_line(e)}}


class Preparer:
    """Builds step graphs ahead of the GPU, at most ``workers`` jobs at a time (each holds a
    model's graphs in memory and on disk); in this process with ``workers == 0``, or once a
    worker died."""

    def __init__(self, jobs: Sequence[PrepJob], workers: int) -> None:
        self.jobs = {(j.model, j.exporter): j for j in jobs}
        self.queue = list(self.jobs)
        self.running: dict[tuple[str, str], futures.Future[dict[str, Any]]] = {}
        self.workers = workers
        self.pool: futures.ProcessPoolExecutor | None = None
        if workers > 0:
            threads = max(1, (os.cpu_count() or 2) // (workers + 1))
            self.pool = futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_worker_init, initargs=(threads,))
        self._fill()

    def _fill(self) -> None:
        while self.pool is not None and self.queue and len(self.running) < self.workers:
            key = self.queue.pop(0)
            self.running[key] = self.pool.submit(prepare, self.jobs[key])

    def get(self, model: str, exporter: str) -> dict[str, Any]:
        key = (model, exporter)
        future = self.running.pop(key, None)
        result = None
        if future is not None:
            try:
                result = future.result()
            except futures.process.BrokenProcessPool as e:
                log(f"a graph worker died ({error_line(e)}); building in this process from now on")
                self.close()
            except Exception as e:  # noqa: BLE001 - prepare records its stages' errors; this is the rest
                result = _failed(model, exporter, e)
        if result is None:
            if key in self.queue:
                self.queue.remove(key)
            try:
                result = prepare(self.jobs[key])
            except Exception as e:  # noqa: BLE001
                result = _failed(model, exporter, e)
        self._fill()
        return result

    def skip(self, model: str, exporter: str) -> None:
        key = (model, exporter)
        future = self.running.pop(key, None)
        if future is not None:
            future.cancel()
        if key in self.queue:
            self.queue.remove(key)
        self._fill()

    def close(self) -> None:
        """Stop the workers; jobs they had not finished go back to the queue."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = None
        self.queue = list(self.running) + self.queue
        self.running.clear()


# -- the configurations ------------------------------------------------------------------


def mpgraph_run(label: str, path: str, case: ModelCase, provider: str, twin: str) -> Run:
    from mpgraph import Trainer

    trainer = Trainer(path, provider, threads=2 if provider == "cpu" else None)
    names = [s.name for s in trainer.data_inputs]
    feeds = [{n: b[n] for n in names} for b in case.batches]

    def step(i: int) -> float:
        return trainer.step(feeds[i % len(feeds)]).loss

    def steps(i: int, n: int) -> list[float]:
        return [r.loss for r in trainer.step_many([feeds[j % len(feeds)] for j in range(i, i + n)])]

    return Run(label, step, twin, device=provider, trainer=trainer, steps=steps if trainer.pipeline else None)


def torch_run(label: str, case: ModelCase, device: str, twin: str | None, *, amp: torch.dtype | None,
              compile_: bool = False, mode: str = "default") -> Run:
    """One torch configuration. ``mode="reduce-overhead"`` (with ``compile_``): the forward and
    backward run as Inductor's CUDA graph trees; the batch's fresh device copies are copied into
    the graphs' static inputs, the parameters keep their addresses (AdamW updates them in place),
    and each step begins a new graph generation after the previous step's gradients are freed."""
    graphs = compile_ and mode == "reduce-overhead"
    if graphs and device != "cuda":
        raise ValueError(f"torch.compile mode {mode!r} needs CUDA (CUDA graphs), not {device}")
    module = copy.deepcopy(case.module).to(device).train()
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            foreach=device == "cuda")
    forward = (torch.compile(module) if mode == "default" else torch.compile(module, mode=mode)) if compile_ else module
    batches = [{k: torch.from_numpy(v) for k, v in b.items()} for b in case.batches]
    skips = _cudagraph_skips() if graphs else 0

    def step(i: int) -> float:
        batch = {k: v.to(device) for k, v in batches[i % len(batches)].items()}
        opt.zero_grad(set_to_none=True)  # frees the last replay's gradient outputs first
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=amp or torch.float32, enabled=amp is not None):
            loss = forward(**batch).loss
        loss.backward()
        opt.step()
        if graphs:  # did Inductor run any of its graphs without CUDA graphs? (a dict read)
            run.note = f"{note}; optimizer eager; cudagraph skips {_cudagraph_skips() - skips}"
        return float(loss.item())

    note = f"HF attention: {module.config._attn_implementation}"
    run = Run(label, step, twin, device=device, note=note)
    return run


def _cudagraph_skips() -> int:
    """Inductor's count of compiled graphs it ran without CUDA graphs (mutated inputs, CPU
    tensors, dynamic shapes...): a reduce-overhead row with skips is not all graph replays."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def rerun_row(case: ModelCase, cuda: bool) -> tuple[str, Callable[[], Run]]:
    """The eager row's second copy (``RERUN``): same weights, batches and seed, its twin the first."""
    label = EAGER if cuda else CPU_TWIN
    return label + RERUN, functools.partial(torch_run, label + RERUN, case, "cuda" if cuda else "cpu", label,
                                            amp=torch.bfloat16 if cuda else None)


def torch_rows(case: ModelCase, cuda: bool, compile_modes: Sequence[str]) -> list[tuple[str, Callable[[], Run]]]:
    """The model's torch rows: eager AMP, then one torch.compile row per mode (``COMPILE_MODES``)."""
    if cuda:
        rows = [(EAGER, functools.partial(torch_run, EAGER, case, "cuda", None, amp=torch.bfloat16))]
        rows += [(COMPILE_MODES[m], functools.partial(torch_run, COMPILE_MODES[m], case, "cuda", EAGER,
                                                      amp=torch.bfloat16, compile_=True, mode=m))
                 for m in compile_modes]
        return rows
    # No CPU AMP row: bf16 autocast on a CPU without bf16 units is slower than fp32 (8x on the
    # tiny GPT-2 here) and says nothing about the GPU.
    return [(CPU_TWIN, functools.partial(torch_run, CPU_TWIN, case, "cpu", None, amp=None))]


def mpgraph_label(policy: str, cuda: bool) -> str:
    if cuda:
        return f"mpgraph {policy}"
    return f"mpgraph {policy} cpu" if policy.removesuffix(UNPADDED) == "fp32" else f"mpgraph {policy} emulated cpu"


def mpgraph_twin(policy: str, cuda: bool) -> str:
    return EAGER if cuda else CPU_TWIN
