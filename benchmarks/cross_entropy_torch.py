"""The fused cross-entropy kernels (``csrc/cross_entropy.cu``) on a GPU without onnxruntime-gpu.

Compiles ``cross_entropy.cu`` alone with nvcc into a small library, calls its two entry points
through ctypes on PyTorch's CUDA tensors and stream, and checks them against PyTorch at GPT-2
small's loss head (batch 8, T 1024: 8192 rows; 50257 classes padded to 50304 columns, as
``PadGemmColumnsPass`` pads them; labels with HF's -100 rows): the loss and the per-row
statistics against float64, dlogits against float32 autograd rounded to the logits' dtype (at
most one ulp apart), the padding columns exactly zero. Then it times, with CUDA events, the fused
forward + backward against the unfused chain the CUDA plan ran before (Slice copy, float32 Cast,
log-softmax and loss, the float32 gradient, the Pad, the Cast back), written as PyTorch ops, and
prints the bytes each moves and the bandwidth reached.

    python3 benchmarks/cross_entropy_torch.py                     # any CUDA machine with torch and nvcc
    python3 benchmarks/cross_entropy_torch.py --dtype float16 --rows 4096
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[1] / "mpgraph" / "lowering" / "csrc"
TYPES = {"bfloat16": (torch.bfloat16, 16), "float16": (torch.float16, 10), "float32": (torch.float32, 1)}
IGNORE = -100


def build() -> ctypes.CDLL:
    source = (CSRC / "cross_entropy.cu").read_bytes()
    key = hashlib.sha256(source + (CSRC / "cuda_util.h").read_bytes() + (CSRC / "multi.h").read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"mpg_cross_entropy_{key}.so"
    if not out.exists():
        arch = os.environ.get("MPGRAPH_CUDA_ARCHS", "90").split(",")[0]
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off",
                        f"-gencode=arch=compute_{arch},code=sm_{arch}", str(CSRC / "cross_entropy.cu"), "-o", str(out)],
                       check=True)
    lib = ctypes.CDLL(str(out))
    sz, p, i64 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64
    lib.mpg_ce_rows_cuda.argtypes = [ctypes.c_int, p, p, p, p, p, sz, sz, sz, i64, ctypes.c_bool, ctypes.c_int, p]
    lib.mpg_ce_rows_grad_cuda.argtypes = [ctypes.c_int, p, p, p, p, p, p, sz, sz, sz, i64, ctypes.c_bool, ctypes.c_int, p]
    return lib


class Fused:
    """The two ops on preallocated outputs (reduction mean, ignore_index -100)."""

    def __init__(self, lib: ctypes.CDLL, code: int, logits: torch.Tensor, labels: torch.Tensor, valid: int) -> None:
        self.lib, self.code, self.logits, self.labels, self.valid = lib, code, logits, labels, valid
        self.rows, self.cols = labels.numel(), logits.shape[-1]
        dev = logits.device
        self.loss = torch.empty((), device=dev)
        self.stats = torch.empty(self.rows, 2, device=dev)
        self.count = torch.empty((), device=dev)
        self.dloss = torch.ones((), device=dev)
        self.dx = torch.empty_like(logits)

    def forward(self) -> None:
        s = torch.cuda.current_stream().cuda_stream
        err = self.lib.mpg_ce_rows_cuda(self.code, self.logits.data_ptr(), self.labels.data_ptr(), self.loss.data_ptr(),
                                        self.stats.data_ptr(), self.count.data_ptr(), self.rows, self.cols, self.valid,
                                        IGNORE, True, 0, s)
        assert err == 0, err

    def backward(self) -> None:
        s = torch.cuda.current_stream().cuda_stream
        err = self.lib.mpg_ce_rows_grad_cuda(self.code, self.logits.data_ptr(), self.labels.data_ptr(), self.stats.data_ptr(),
                                             self.count.data_ptr(), self.dloss.data_ptr(), self.dx.data_ptr(), self.rows,
                                             self.cols, self.valid, IGNORE, True, 0, s)
        assert err == 0, err


def unfused(logits: torch.Tensor, labels: torch.Tensor, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's chain before the rule, op for op: Slice (copy), Cast float32, log-softmax and
    the mean NLL over kept rows; the gradient (exp(log_prob) - onehot) * scale in float32, Pad to
    the GEMM's columns, Cast back."""
    cols = logits.shape[-1]
    rows = logits.reshape(-1, cols)[:, :valid].contiguous()
    x = rows.float()
    log_prob = torch.log_softmax(x, -1)
    kept = labels != IGNORE
    safe = torch.where(kept, labels, 0)
    count = kept.sum().float()
    loss = -(log_prob.gather(1, safe[:, None])[:, 0] * kept).sum() / count
    scale = (1.0 / count) * kept.float()
    grad = log_prob.exp()
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(scale)[:, None])
    grad.mul_(scale[:, None])
    padded = torch.nn.functional.pad(grad, (0, cols - valid))
    return loss, padded.to(logits.dtype).reshape(logits.shape)


def timed(fn, iters: int, rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def check(fused: Fused, logits: torch.Tensor, labels: torch.Tensor, valid: int, dtype: torch.dtype) -> str:
    fused.forward()
    fused.backward()
    torch.cuda.synchronize()
    x = logits.reshape(-1, logits.shape[-1])[:, :valid].double()
    lse = torch.logsumexp(x, -1)
    kept = labels != IGNORE
    want_loss = ((lse - x.gather(1, torch.where(kept, labels, 0)[:, None])[:, 0]) * kept).sum() / kept.sum()
    got_lse = fused.stats[:, 0].double() + fused.stats[:, 1].double()
    loss_err = abs(fused.loss.item() - want_loss.item()) / abs(want_loss.item())
    lse_err = ((got_lse - lse).abs() / lse.abs().clamp_min(1)).max().item()
    xf = logits.reshape(-1, logits.shape[-1])[:, :valid].float().requires_grad_()
    torch.nn.functional.cross_entropy(xf, labels, ignore_index=IGNORE).backward()
    want = xf.grad.to(dtype).float()
    got = fused.dx.reshape(-1, logits.shape[-1]).float()
    assert torch.all(got[:, valid:] == 0), "padding columns not zero"
    bits, smallest = {torch.bfloat16: (7, -133), torch.float16: (10, -24), torch.float32: (23, -149)}[dtype]
    _, exponent = torch.frexp(want)  # want = m * 2^exponent, 0.5 <= |m| < 1: one ulp is 2^(exponent - 1 - bits)
    ulp = torch.ldexp(torch.ones_like(want), torch.where(want == 0, smallest, (exponent - 1 - bits).clamp_min(smallest)))
    ulps = ((got[:, :valid] - want).abs() / ulp).max().item()
    equal = (got[:, :valid] == want).float().mean().item()
    allowed = 64.0 if dtype == torch.float32 else 1.0  # float32: expf against torch's exp, unrounded
    assert loss_err < 1e-5 and lse_err < 1e-6 and ulps <= allowed, (loss_err, lse_err, ulps)
    return (f"loss {fused.loss.item():.6f} (float64 {want_loss.item():.6f}, rel {loss_err:.1e}), logsumexp worst rel "
            f"{lse_err:.1e}; dlogits equal to autograd's rounded to {str(dtype)[6:]} in {equal:.4%} of elements, "
            f"worst {ulps:.2f} ulp; padding zero")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=tuple(TYPES), default="bfloat16")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--valid", type=int, default=50257)
    parser.add_argument("--cols", type=int, default=50304)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    dtype, code = TYPES[args.dtype]
    lib = build()
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.rows, args.cols, device="cuda", generator=g) * 2).to(dtype)
    logits[:, args.valid:] = 0  # the padded GEMM's zero columns
    labels = torch.randint(0, args.valid, (args.rows,), device="cuda", generator=g)
    labels[1023::1024] = IGNORE  # HF's shifted labels: each sequence's last position
    fused = Fused(lib, code, logits, labels, args.valid)
    print(f"# cross_entropy_torch.py: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype} "
          f"[{args.rows}, {args.cols}] logits, {args.valid} classes, median of {args.rounds} x {args.iters}")
    print(check(fused, logits, labels, args.valid, dtype))
    size = logits.element_size()
    t_fwd = timed(fused.forward, args.iters, args.rounds)
    t_bwd = timed(fused.backward, args.iters, args.rounds)
    t_old = timed(lambda: unfused(logits, labels, args.valid), args.iters, args.rounds)
    n, v = args.rows * args.cols, args.rows * args.valid
    fused_bytes = 3 * n * size  # read the logits twice, write dlogits
    # Slice v -> v, Cast v -> v float32, loss v -> log_prob v, grad v -> v, Pad v -> n, Cast n -> n
    old_bytes = 3 * v * size + 6 * v * 4 + 2 * n * 4 + n * size
    print(f"fused: forward {t_fwd:.3f} ms ({n * size / t_fwd / 1e6:.0f} GB/s), backward {t_bwd:.3f} ms "
          f"({2 * n * size / t_bwd / 1e6:.0f} GB/s); {fused_bytes / 1e9:.2f} GB a step")
    print(f"unfused chain (PyTorch ops, the plan's old ops): {t_old:.3f} ms, about {old_bytes / 1e9:.2f} GB; "
          f"fused/unfused {(t_fwd + t_bwd) / t_old:.2f}x")


if __name__ == "__main__":
    main()
