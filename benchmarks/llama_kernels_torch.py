"""The RmsNormGrad, SwiGluGrad and SwiGlu CUDA kernels alone, against torch running the ops they replace.

Needs only torch with CUDA and nvcc (no onnxruntime-gpu): compiles ``csrc/rmsnorm.cu`` and
``csrc/swiglu.cu`` into a scratch library, calls their C entry points on torch tensors, and
compares them with the gradient rules' ops run one by one by torch (each op a kernel rounding
to its dtype, as ORT's do): SwiGluGrad in bfloat16 and float16 elementwise (expected: the same
bits), RmsNormGrad in float32 against float64. Then the time of one fused call against the op
sequence (CUDA events, median), at a Llama-style 125M's sizes.

RmsNormGrad is also built a second time with ``-DMPG_RMSNORM_THREE_PASS`` (the path it takes
for shapes the one-pass kernel does not cover: a block per row making dx, then a column kernel
re-reading x and dy for dscale) and timed against it, with the bytes the call must move and
the bandwidth that reaches. Exit status 1 when a check fails.

    python3 benchmarks/llama_kernels_torch.py                 # a CUDA machine with nvcc
    python3 benchmarks/llama_kernels_torch.py --rmsnorm       # RmsNormGrad only
    compute-sanitizer python3 benchmarks/llama_kernels_torch.py --small   # the same checks, tiny sizes
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[1] / "mpgraph" / "lowering" / "csrc"
TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}
QUICK = {"on": False}  # --small: one timed call (under compute-sanitizer)


def build(arch: str, *defines: str) -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "libllama_kernels.so"
    cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off", *defines,
           f"-gencode=arch=compute_{arch},code=sm_{arch}", str(CSRC / "rmsnorm.cu"), str(CSRC / "swiglu.cu"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.mpg_rmsnorm_grad_workspace.restype = ctypes.c_size_t
    lib.mpg_rmsnorm_grad_workspace.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    return lib


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def swiglu_ops(dy, a, b, s):
    """The Mul and Sigmoid rules' ops and the driver's float32 sum, one torch kernel each."""
    h = a * s
    db = dy * h
    dh = dy * b
    c1 = dh * s
    ds = dh * a
    c2 = ds * (s * (1 - s))
    return (c1.float() + c2.float()).to(a.dtype), db


def swiglu_forward_ops(a, b):
    """ORT's CUDA Sigmoid formula op by op in a's dtype (a > 0 ? 1 / (1 + exp(-|a|)) : 1 - that),
    then the two Muls."""
    q = 1 / (1 + torch.exp(-a.abs()))
    s = torch.where(a > 0, q, 1 - q)
    return (a * s) * b, s


def swiglu_forward_fused(lib, a, b):
    y, s = torch.empty_like(a), torch.empty_like(a)
    err = lib.mpg_swiglu_cuda(TYPES[a.dtype], ptr(a), ptr(b), ptr(y), ptr(s), ctypes.c_size_t(a.numel()), stream())
    assert err == 0, err
    return y, s


def swiglu_torch_forward(a, b):
    return torch.nn.functional.silu(a) * b  # torch eager's own: two kernels


def swiglu_fused(lib, dy, a, b, s):
    da, db = torch.empty_like(a), torch.empty_like(b)
    err = lib.mpg_swiglu_grad_cuda(TYPES[a.dtype], ptr(dy), ptr(a), ptr(b), ptr(s), ptr(da), ptr(db),
                                   ctypes.c_size_t(a.numel()), stream())
    assert err == 0, err
    return da, db


def rmsnorm_ops(dy, x, scale, eps):
    """The RMSNormalization rule's 13 ops, float32."""
    r = torch.reciprocal(torch.sqrt((x * x).mean(-1, keepdim=True) + eps))
    xhat = x * r
    dxhat = dy * scale
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(dim=tuple(range(x.dim() - 1)))


def rmsnorm_fused(lib, parts, x, scale, eps_t, addend=None):
    """RmsNormGrad with dy given as the parts the graph sums into it (RmsNormGradAdd with an addend)."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    dx, dscale = torch.empty_like(x), torch.empty_like(scale)
    work = torch.empty(lib.mpg_rmsnorm_grad_workspace(rows, cols), dtype=torch.float32, device=x.device)
    ptrs = (ctypes.c_void_p * len(parts))(*[p.data_ptr() for p in parts])
    types = (ctypes.c_int * len(parts))(*[TYPES[p.dtype] for p in parts])
    add = ptr(addend) if addend is not None else ctypes.c_void_p(0)
    err = lib.mpg_rmsnorm_grad_cuda(TYPES[x.dtype], len(parts), ptrs, types, ptr(x), ptr(scale), ptr(eps_t), add,
                                    ptr(dx), ptr(dscale), ptr(work), ctypes.c_size_t(rows), ctypes.c_size_t(cols),
                                    stream())
    assert err == 0, err
    return dx, dscale


def ms(fn, *args, iters: int = 50, rounds: int = 5) -> float:
    """Median ms of ``fn(*args)`` over ``rounds`` rounds of ``iters`` calls (CUDA events)."""
    if QUICK["on"]:
        iters, rounds = 1, 1
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    small = QUICK["on"] = "--small" in sys.argv[1:]
    major, minor = torch.cuda.get_device_capability()
    arch = os.environ.get("MPGRAPH_CUDA_ARCHS", f"{major}{minor}").split(",")[0]
    lib = build(arch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--rmsnorm" not in sys.argv[1:]:
        swiglu(lib, gen, small)
    ok = rmsnorm(lib, build(arch, "-DMPG_RMSNORM_THREE_PASS"), gen, small)
    sys.exit(0 if ok else 1)


def swiglu(lib, gen, small: bool) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        shape = (3, 7, 515) if small else (8, 1024, 2048)  # small: the scalar path (n % 8 != 0)
        a = (3 * torch.randn(shape, device="cuda", generator=gen)).to(dtype)
        ends = min(4096, a.numel())
        a.view(-1)[:ends] = torch.linspace(-30, 30, ends, device="cuda").to(dtype)  # saturated tails too
        b, dy = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(2))
        s = torch.sigmoid(a)
        want, got = swiglu_ops(dy, a, b, s), swiglu_fused(lib, dy, a, b, s)
        same = [float((g == w).float().mean()) for g, w in zip(got, want)]
        t_ops, t_fused = ms(swiglu_ops, dy, a, b, s), ms(swiglu_fused, lib, dy, a, b, s)
        print(f"SwiGluGrad {str(dtype)[6:]} {list(shape)}: da equal in {same[0]:.6%}, db in {same[1]:.6%} of elements; "
              f"fused {t_fused:.3f} ms, ops {t_ops:.3f} ms ({t_ops / t_fused:.1f}x)")
        want, got = swiglu_forward_ops(a, b), swiglu_forward_fused(lib, a, b)
        same = [float((g == w).float().mean()) for g, w in zip(got, want)]
        close = float((got[1].float() - torch.sigmoid(a.float())).abs().max())
        t_ops, t_fused = ms(swiglu_forward_ops, a, b), ms(swiglu_forward_fused, lib, a, b)
        t_torch = ms(swiglu_torch_forward, a, b)
        print(f"SwiGlu {str(dtype)[6:]}: y equal to ORT's formula op by op in {same[0]:.6%}, s in {same[1]:.6%}; "
              f"|s - float32 sigmoid| <= {close:.2g}; fused {t_fused:.3f} ms, those ops {t_ops:.3f} ms, "
              f"torch silu(a) * b {t_torch:.3f} ms")


#: RmsNormGrad cases (rows, cols, parts of dy, their dtype, residual addend): a Llama-style 125M's norms at
#: batch 8 x 1024 (before attention: q, k and v's bfloat16 input gradients and the residual;
#: before the MLP: gate's and up's; the final norm: one bfloat16 dy, no residual), one float32
#: dy, then shapes the one-pass kernel leaves to the three-pass path (cols not a multiple of 8,
#: more than 768 columns).
BF16, F32 = torch.bfloat16, torch.float32
RMS_SIZES = ((8192, 768, 3, BF16, True), (8192, 768, 2, BF16, True), (8192, 768, 1, BF16, False),
             (8192, 768, 1, F32, False), (1000, 100, 2, BF16, False), (3, 4096, 1, F32, False))
#: --small: one chunk of 8 columns a lane, a last chunk with one lane, a row count that is not a
#: multiple of 32, and the three-pass path.
RMS_SMALL = ((70, 96, 1, F32, False), (40, 768, 3, BF16, True), (33, 520, 2, torch.float16, True),
             (5, 100, 2, BF16, False))


def rmsnorm(lib, three_pass, gen, small: bool) -> bool:
    """RmsNormGrad against float64 and the torch ops; one pass against three; True if all agree."""
    ok = True
    for rows, cols, parts, dtype, residual in RMS_SMALL if small else RMS_SIZES:
        x = torch.randn(rows, cols, device="cuda", generator=gen)
        dys = [torch.randn(rows, cols, device="cuda", generator=gen).to(dtype) for _ in range(parts)]
        scale = 1 + 0.1 * torch.randn(cols, device="cuda", generator=gen)
        eps = 1e-6
        eps_t = torch.tensor(eps, dtype=torch.float32, device="cuda")
        res = torch.randn(rows, cols, device="cuda", generator=gen) if residual else None

        def ops(dys=dys, x=x, scale=scale, eps=eps, res=res):
            dy = dys[0].float()
            for part in dys[1:]:
                dy = dy + part.float()
            dx, dscale = rmsnorm_ops(dy, x, scale, eps)
            return (dx if res is None else res + dx), dscale

        got = rmsnorm_fused(lib, dys, x, scale, eps_t, res)
        again = rmsnorm_fused(lib, dys, x, scale, eps_t, res)
        old = rmsnorm_fused(three_pass, dys, x, scale, eps_t, res)
        dy64 = sum(p.double() for p in dys)
        ref = rmsnorm_ops(dy64, x.double(), scale.double(), eps)
        if res is not None:
            ref = (ref[0] + res.double(), ref[1])
        err = [float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)]
        err_old = [float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(old, ref)]
        err_ops = [float((o.double() - r).abs().max() / r.abs().max()) for o, r in zip(ops(), ref)]
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        good = same and max(err) <= 4 * max(*err_ops, *err_old, 1e-7)
        ok &= good
        t_ops, t_fused = ms(ops), ms(rmsnorm_fused, lib, dys, x, scale, eps_t, res)
        t_old = ms(rmsnorm_fused, three_pass, dys, x, scale, eps_t, res)
        moved = x.nbytes * (2 + (res is not None)) + sum(p.nbytes for p in dys) + 2 * scale.nbytes
        kind = f"{parts} {str(dtype)[6:]} part(s)"
        kind += ", + residual" if res is not None else ""
        print(f"RmsNormGrad [{rows}, {cols}], dy {kind}: |fused - float64| / max dx {err[0]:.2g}, dscale {err[1]:.2g} "
              f"(three-pass: {err_old[0]:.2g}, {err_old[1]:.2g}; the ops: {err_ops[0]:.2g}, {err_ops[1]:.2g}); "
              f"{'same bits twice' if same else 'DIFFERENT BITS on a second call'}; {'ok' if good else 'FAILED'}")
        print(f"    fused {t_fused * 1e3:.1f} us ({moved / t_fused / 1e9:.2f} TB/s of {moved / 1e6:.1f} MB; "
              f"{moved / 3e12 * 1e6:.1f} us at 3 TB/s), three-pass {t_old * 1e3:.1f} us ({t_old / t_fused:.2f}x), "
              f"ops {t_ops * 1e3:.1f} us ({t_ops / t_fused:.1f}x)")
    # A tensor 4 bytes off 16-byte alignment takes the three-pass path (the one-pass kernel's
    # loads are 16 bytes): the same results.
    rows, cols = (40, 768) if small else (1024, 768)
    x = torch.randn(rows * cols + 1, device="cuda", generator=gen)[1:].view(rows, cols)
    dys = [torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
    scale = 1 + 0.1 * torch.randn(cols, device="cuda", generator=gen)
    eps_t = torch.tensor(1e-6, dtype=torch.float32, device="cuda")
    got, old = rmsnorm_fused(lib, dys, x, scale, eps_t), rmsnorm_fused(three_pass, dys, x, scale, eps_t)
    same = all(torch.equal(a, b) for a, b in zip(got, old))
    print(f"RmsNormGrad [{rows}, {cols}], x unaligned: {'the three-pass bits' if same else 'FAILED: not the three-pass bits'}")
    return ok and same


if __name__ == "__main__":
    main()
