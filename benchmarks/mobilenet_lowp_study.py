"""Is MobileNetV2's low-precision corpus failure the model or mpgraph? (tests/test_corpus.py xfail)

The corpus's lowp check (tests/corpus/check.py ``lowp_deltas``) asks that the emulated bf16 and
fp16 AdamW step graphs' loss after 5 updates be within 1e-2 of the fp32 step graph's. This
script measures, on the same model, weights and batch as the corpus (``build("mobilenet_v2")``):

    (a) mpgraph fp32 step vs torch fp32 and torch float64, 5 AdamW steps, per-step losses;
    (b) mpgraph emulated bf16 / fp16 vs mpgraph fp32 (per update; fp16 skipped steps counted);
    (c) torch's own CPU autocast bf16 (and fp16 with GradScaler("cpu"), initial scale 65536
        like mpgraph's) vs torch fp32, same 5 steps;
    (s) sensitivity: torch fp32 trained from the initial weights rounded to bfloat16 (a
        perturbation of the size one bf16 rounding makes, with every op in fp32);
    (d) step-1 gradients: relative L2 error against torch float64 of torch fp32, mpgraph fp32,
        torch autocast bf16 and mpgraph emulated bf16, for the parameters with the largest
        gradients and the worst ones;
    (u) the parameter update of each of the first 3 applied updates, all parameters
        concatenated: relative L2 error and share of elements whose sign flips, low precision
        against its own fp32 (mpgraph against mpgraph, torch against torch);
    (e) chaos: torch fp32 from initial weights multiplied by (1 + r N(0, 1)), r = 2^-11 (one
        fp16 ulp) and 2^-8 (one bf16 ulp), 8 seeds each: the spread of the losses.

    .venv/bin/python benchmarks/mobilenet_lowp_study.py [--exporters torchscript,dynamo]
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpgraph.convert import convert  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402
from tests.corpus import check  # noqa: E402
from tests.corpus.models import Case, build  # noqa: E402
from tests.cpu_runner import CpuRunner  # noqa: E402

MAX_SKIPS = 12


def _adamw(module: torch.nn.Module) -> torch.optim.AdamW:
    a = check.ADAMW
    return torch.optim.AdamW(module.parameters(), lr=check.LR, betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                             weight_decay=a["weight_decay"], foreach=False)


def torch_losses(case: Case, dtype: torch.dtype | None = None, scaler: bool = False) -> tuple[list[float], int]:
    """Losses before each of 5 applied AdamW updates and after the last (6 values); ``dtype``:
    CPU autocast to it; ``scaler``: GradScaler("cpu") at its default initial scale 65536. Also
    the number of steps the scaler skipped."""
    module = copy.deepcopy(case.module).train()
    opt = _adamw(module)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    losses: list[float] = []
    skipped = 0
    while len(losses) < check.STEPS + 1:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = module(*case.inputs)
        if len(losses) == check.STEPS:
            losses.append(loss.item())
            break
        if grad_scaler is None:
            loss.backward()
            opt.step()
            losses.append(loss.item())
            continue
        grad_scaler.scale(loss).backward()
        before = grad_scaler.get_scale()
        grad_scaler.step(opt)
        grad_scaler.update()
        if grad_scaler.get_scale() < before:
            skipped += 1
            if skipped > MAX_SKIPS:
                raise AssertionError("torch fp16: too many skipped steps")
            continue
        losses.append(loss.item())
    return losses, skipped


def bf16_rounded(case: Case) -> Case:
    module = copy.deepcopy(case.module)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return Case(case.name, module, case.inputs, case.input_names)


def mpgraph_losses(step: bytes, case: Case) -> tuple[list[float], int]:
    """The step graph's loss before each applied update and after the last (6 values), and how
    many steps dynamic loss scaling skipped (a skipped step's loss is not listed)."""
    runner = CpuRunner(step, threads=1, spin=False)
    feeds = {n: t.numpy() for n, t in zip(case.input_names, case.inputs, strict=True)}
    counter = "optim/step" if any(name == "optim/step" for name, _ in runner.pairs) else None
    losses: list[float] = []
    done = 0
    for i in range(check.STEPS + MAX_SKIPS):
        loss = runner.step(feeds)
        now = i + 1 if counter is None else int(runner.state[counter].ravel()[0])
        if now > done:
            losses.append(loss)
            done = now
        if done >= check.STEPS:
            losses.append(runner.step(feeds))
            return losses, i + 1 - check.STEPS
    raise AssertionError("more than MAX_SKIPS steps skipped")


def lowp_step(step: bytes, policy: str) -> bytes:
    low = convert(ir.from_proto(onnx.load_from_string(step)), policy, emulate=True)
    return ir.to_proto(low).SerializeToString()


def mpgraph_grads(exported: check.Exported, policy: str | None) -> dict[str, np.ndarray]:
    """Step-1 gradients of the gradient-only step graph (``policy``: emulated bf16/fp16)."""
    graph = build_training_graph(exported.model, optimizer=None, loss=exported.loss)
    if policy is not None:
        graph = convert(graph, policy, emulate=True)
    session = check._session(graph)
    names = [o.name for o in session.get_outputs()]
    feeds = {n: t.numpy() for n, t in zip(exported.case.input_names, exported.case.inputs, strict=True)}
    outs = dict(zip(names, session.run(None, feeds), strict=True))
    return {k.removeprefix("grad/"): v for k, v in outs.items() if k.startswith("grad/")} | {"<loss>": outs[names[0]]}


def torch_grads(case: Case, dtype: torch.dtype | None) -> dict[str, np.ndarray]:
    module = copy.deepcopy(case.module).train()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = module(*case.inputs)
    loss.backward()
    grads = {n: p.grad.double().numpy() for n, p in module.named_parameters() if p.grad is not None}
    return grads | {"<loss>": np.array(loss.item())}


def _row(label: str, losses: list[float], ref: list[float], skipped: int | None = None) -> str:
    cells = " ".join(f"{x:9.6f}" for x in losses)
    deltas = " ".join(f"{abs(x - y):8.1e}" for x, y in zip(losses, ref, strict=True))
    skip = "" if skipped is None else f"  skipped {skipped}"
    return f"  {label:34s} {cells}\n  {'  |delta| vs its fp32':34s} {deltas}{skip}"


def loss_section(exported: check.Exported, out: list[str]) -> None:
    case = exported.case
    step = check.adamw_step(exported)
    ours, _ = mpgraph_losses(step, case)
    theirs, _ = torch_losses(case)
    exact, _ = torch_losses(check._double(case))
    out.append("losses: before updates 1..5, then after update 5 (the value the lowp check compares)")
    out.append(f"  {'torch float64':34s} " + " ".join(f"{x:9.6f}" for x in exact))
    out.append(_row("torch fp32 (vs float64)", theirs, exact))
    out.append(_row("(a) mpgraph fp32 (vs torch fp32)", ours, theirs))
    out.append(_row("    mpgraph fp32 (vs float64)", ours, exact))
    for policy in ("bf16", "fp16"):
        low, skipped = mpgraph_losses(lowp_step(step, policy), case)
        out.append(_row(f"(b) mpgraph {policy} emulated", low, ours, skipped))
    low, _ = torch_losses(case, torch.bfloat16)
    out.append(_row("(c) torch autocast bf16", low, theirs))
    low, skipped = torch_losses(case, torch.float16, scaler=True)
    out.append(_row("(c) torch autocast fp16 + GradScaler", low, theirs, skipped))
    low, _ = torch_losses(bf16_rounded(case))
    out.append(_row("(s) torch fp32, weights bf16-rounded", low, theirs))


def grad_section(exported: check.Exported, out: list[str], top: int = 8) -> None:
    case = exported.case
    exact = torch_grads(check._double(case), None)
    runs = {"torch fp32": torch_grads(case, None), "mpgraph fp32": mpgraph_grads(exported, None),
            "torch bf16": torch_grads(case, torch.bfloat16), "mpgraph bf16": mpgraph_grads(exported, "bf16")}
    norms = {k: float(np.linalg.norm(v)) for k, v in exact.items() if k != "<loss>"}
    floor = check.GRAD_FLOOR * max(norms.values())

    def err(run: str, name: str) -> float:
        got = runs[run].get(name)
        return float("inf") if got is None else check._rel(got, exact[name], floor)

    errors = {run: {n: err(run, n) for n in norms} for run in runs}
    out.append("step-1 gradients: relative L2 error against torch float64 (norm floored at 1e-6 of the largest)")
    out.append("  " + f"{'loss':60s}" + "".join(f"{float(runs[r]['<loss>']):>14.7f}" for r in runs)
               + f"   float64 {float(exact['<loss>']):.7f}")
    out.append("  " + f"{'parameter (|grad| float64)':60s}" + "".join(f"{r:>14s}" for r in runs))
    largest = sorted(norms, key=norms.get, reverse=True)[:top]
    worst = sorted((n for n in norms if n not in largest), key=lambda n: errors["mpgraph bf16"][n], reverse=True)[:top]
    for title, names in (("largest gradients", largest), ("worst mpgraph bf16 among the rest", worst)):
        out.append(f"  -- {title}")
        for n in names:
            short = n.removeprefix("model.").removeprefix("mobilenet_v2.")
            out.append(f"  {short[:48]:48s} {norms[n]:9.2e}  " + "".join(f"{errors[r][n]:14.2e}" for r in runs))
    weighted = {r: float(np.sqrt(sum((errors[r][n] * norms[n]) ** 2 for n in norms) / sum(v * v for v in norms.values())))
                for r in runs}
    out.append("  " + f"{'all parameters (norm-weighted)':60s}" + "".join(f"{weighted[r]:14.2e}" for r in runs))
    medians = {r: float(np.median(list(errors[r].values()))) for r in runs}
    out.append("  " + f"{'median over parameters':60s}" + "".join(f"{medians[r]:14.2e}" for r in runs))


def _param_snapshots(step: bytes | None, case: Case, dtype: torch.dtype | None = None,
                     updates: int = 3) -> list[dict[str, np.ndarray]]:
    """Parameters before and after each of ``updates`` applied updates: of the step graph, or
    (``step`` None) of torch.optim.AdamW, under CPU autocast to ``dtype`` (float16: with
    GradScaler)."""
    names = check.param_names(case.module)
    if step is not None:
        runner = CpuRunner(step, threads=1, spin=False)
        feeds = {n: t.numpy() for n, t in zip(case.input_names, case.inputs, strict=True)}
        snaps, done = [{n: np.array(runner.state[n]) for n in names}], 0
        while len(snaps) <= updates:
            runner.step(feeds)
            if (now := int(runner.state["optim/step"].ravel()[0])) > done:
                done = now
                snaps.append({n: np.array(runner.state[n]) for n in names})
        return snaps
    module = copy.deepcopy(case.module).train()
    fp16 = dtype == torch.float16
    opt, scaler = _adamw(module), torch.amp.GradScaler("cpu", enabled=fp16)
    snaps = [{n: p.detach().numpy().copy() for n, p in module.named_parameters()}]
    while len(snaps) <= updates:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = module(*case.inputs)
        scaler.scale(loss).backward()
        before = scaler.get_scale() if fp16 else 1.0
        scaler.step(opt)
        scaler.update()
        if not fp16 or scaler.get_scale() >= before:
            snaps.append({n: p.detach().numpy().copy() for n, p in module.named_parameters()})
    return snaps


def update_section(exported: check.Exported, out: list[str]) -> None:
    case = exported.case
    step = check.adamw_step(exported)
    runs = {"mpgraph fp32": _param_snapshots(step, case), "torch fp32": _param_snapshots(None, case),
            "mpgraph fp16": _param_snapshots(lowp_step(step, "fp16"), case),
            "mpgraph bf16": _param_snapshots(lowp_step(step, "bf16"), case),
            "torch fp16": _param_snapshots(None, case, torch.float16),
            "torch bf16": _param_snapshots(None, case, torch.bfloat16)}
    pairs = (("mpgraph fp32", "torch fp32"), ("mpgraph fp16", "mpgraph fp32"), ("torch fp16", "torch fp32"),
             ("mpgraph bf16", "mpgraph fp32"), ("torch bf16", "torch fp32"))
    out.append("(u) parameter updates, all parameters concatenated: rel L2 error / share of sign flips")
    out.append("  " + f"{'':30s}" + "".join(f"{'update ' + str(k):>18s}" for k in (1, 2, 3)))
    for a, b in pairs:
        cells = []
        for k in (1, 2, 3):
            ua, ub = (np.concatenate([(runs[r][k][n] - runs[r][k - 1][n]).ravel() for n in runs[r][0]]) for r in (a, b))
            cells.append(f"{check._rel(ua, ub):8.3f} / {np.mean(np.sign(ua) != np.sign(ub)):5.3f}")
        out.append(f"  {a + ' vs ' + b:30s}" + "".join(f"{c:>18s}" for c in cells))


def chaos_section(case: Case, out: list[str], seeds: int = 8) -> None:
    base, _ = torch_losses(case)
    out.append(f"(e) torch fp32 from perturbed initial weights, {seeds} seeds: range of the loss per step, max |delta|")
    for rel, label in ((2.0**-11, "r = 2^-11 (fp16 ulp)"), (2.0**-8, "r = 2^-8 (bf16 ulp)")):
        rows = []
        for seed in range(seeds):
            module = copy.deepcopy(case.module)
            generator = torch.Generator().manual_seed(100 + seed)
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(1 + rel * torch.randn(p.shape, generator=generator))
            rows.append(torch_losses(Case(case.name, module, case.inputs, case.input_names))[0])
        losses = np.array(rows)
        out.append(f"  {label:22s} min   " + " ".join(f"{x:9.6f}" for x in losses.min(0)))
        out.append(f"  {'':22s} max   " + " ".join(f"{x:9.6f}" for x in losses.max(0)))
        out.append(f"  {'':22s} |d|   " + " ".join(f"{x:9.1e}" for x in np.abs(losses - base).max(0))
                   + f"   median final |delta| {np.median(np.abs(losses[:, -1] - base[-1])):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exporters", default=",".join(check.EXPORTERS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; 5 AdamW steps lr {check.LR} {check.ADAMW}; lowp tolerance {check.LOWP_TOL}")
    for exporter in args.exporters.split(","):
        exported = check.export(build("mobilenet_v2"), exporter)
        out = [f"\n== mobilenet_v2 / {exporter}"]
        loss_section(exported, out)
        grad_section(exported, out)
        if exporter == args.exporters.split(",")[0]:
            update_section(exported, out)
            chaos_section(exported.case, out)
        print("\n".join(out), flush=True)


if __name__ == "__main__":
    main()
