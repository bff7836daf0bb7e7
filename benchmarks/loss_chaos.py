"""How sensitive a real model's 50-step loss is to rounding: torch alone, no mpgraph.

``real_models.py`` judges mpgraph's loss after 50 steps against torch eager AMP's. That check
means something only where torch's own loss would land in the same place after a change the
size of one rounding. This script trains the same model (``real_models_cases.build_case``)
with torch eager on CUDA several times: AMP bf16 as built, then AMP bf16 with every weight
multiplied by ``1 + 2**-12 * N(0, 1)`` (below bf16's resolution; one seed per run), and once in
float32 with TF32 off. It prints the loss every ten steps and each run's distance from the
first, for the benchmark's data (random tokens, four batches cycled: nothing to learn but the
batches themselves) and, with ``--data markov``, for tokens drawn from a fixed random bigram
chain (something to learn, as in text).

    python3 benchmarks/loss_chaos.py --models gpt2,llama --data uniform,markov --runs 3
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_models_cases import BATCHES, BETAS, EPS, LR, WEIGHT_DECAY, build_case  # noqa: E402


def markov_tokens(vocab: int, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """Tokens of a fixed random bigram chain: each token's successor is one of its 8 (chosen
    once), with probabilities 1/(i+1) normalised, or with probability 0.1 any token."""
    succ = np.random.default_rng(1234).integers(0, vocab, (vocab, 8))
    p = 1.0 / np.arange(1, 9)
    p /= p.sum()
    out = np.empty((batch, seq), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab, batch)
    for t in range(1, seq):
        pick = succ[out[:, t - 1], rng.choice(8, batch, p=p)]
        out[:, t] = np.where(rng.random(batch) < 0.1, rng.integers(0, vocab, batch), pick)
    return out


def train(module: torch.nn.Module, batches: list[dict], steps: int, amp: bool) -> list[float]:
    module = module.cuda().train()
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)
    dev = [{k: torch.from_numpy(v).cuda() for k, v in b.items()} for b in batches]
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = module(**dev[i % len(dev)]).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    m = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + 2.0**-12 * torch.randn(p.shape, generator=g))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--data", default="uniform,markov")
    ap.add_argument("--runs", type=int, default=3, help="perturbed bf16 runs")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.models.split(","):
        case = build_case(name, False)
        for data in args.data.split(","):
            batches = case.batches
            if data == "markov":
                rng = np.random.default_rng(0)
                b, s = batches[0]["input_ids"].shape
                vocab = case.module.config.vocab_size
                batches = [{"input_ids": t, "labels": t} for t in
                           (markov_tokens(vocab, b, s, rng) for _ in range(BATCHES))]
            runs = {"bf16": train(copy.deepcopy(case.module), batches, args.steps, True)}
            for r in range(args.runs):
                runs[f"bf16 perturbed {r}"] = train(perturbed(case.module, r), batches, args.steps, True)
            runs["fp32 (no TF32)"] = train(copy.deepcopy(case.module), batches, args.steps, False)
            ref = runs["bf16"]
            marks = [k for k in (1, 10, 20, 30, 40, args.steps) if k <= args.steps]
            print(f"\n== {name}, data {data}: loss after step " + ", ".join(map(str, marks)))
            for label, ls in runs.items():
                cells = " ".join(f"{ls[k - 1]:8.4f}" for k in marks)
                print(f"{label:<20} {cells}   vs bf16 at {args.steps}: {ls[-1] / ref[-1] - 1:+.2%}")
            end = [ls[-1] for ls in runs.values()]
            print(f"spread at {args.steps} (max-min)/min over the runs: {(max(end) - min(end)) / min(end):.2%}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
