"""``mpgraph kernels``: build (or find) the kernel library and say what it holds."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from mpgraph.cli.console import console

__all__ = ["kernels_command", "library_facts"]


def library_facts(cuda: bool) -> dict[str, Any]:
    """What ``plan_session`` would load for ``cuda`` (building it first where the cache lacks it):
    the path, whether it is prebuilt (``$MPGRAPH_CUDA_LIBRARY``), its CUDA kernels, the fused
    attention and GemmBias (each with why not), and whether GemmBias runs on CUDA.

    Raises:
        KernelBuildError: No compiler here, or it failed, or the variable names no file.
    """
    import ctypes

    from mpgraph.lowering.build import PREBUILT, build_library, cublaslt_flags, cudnn_flags, prebuilt_library
    from mpgraph.lowering.gemm_bias import gemm_bias_on_cuda
    from mpgraph.lowering.plan import has_gemm_bias, has_sdpa

    prebuilt = prebuilt_library(cuda)
    path = build_library(cuda)
    facts: dict[str, Any] = {"path": str(path), "bytes": path.stat().st_size,
                             "prebuilt": f"${PREBUILT[cuda]}" if prebuilt is not None else None,
                             "cuda_kernels": bool(ctypes.CDLL(str(path)).MpgraphKernelsHaveCuda())}
    if cuda:
        facts["fused_attention"] = has_sdpa(str(path))
        facts["gemm_bias"] = has_gemm_bias(str(path))
        facts["gemm_bias_runs"] = facts["gemm_bias"] and gemm_bias_on_cuda()
        built_here = prebuilt is None
        if not facts["fused_attention"]:
            facts["fused_attention_why_not"] = (cudnn_flags()[1] if built_here else "") or "built without it"
        if not facts["gemm_bias"]:
            facts["gemm_bias_why_not"] = (cublaslt_flags()[1] if built_here else "") or "built without it"
    return facts


def kernels_command(
    cpu: Annotated[bool, typer.Option("--cpu", help="The CPU library instead of the CUDA one (which holds the CPU kernels too).")] = False,
    copy_to: Annotated[Path | None, typer.Option("--copy-to", help="Copy the library to this file, to run it elsewhere "
                                                 "($MPGRAPH_CUDA_LIBRARY / $MPGRAPH_CPU_LIBRARY there).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as JSON.")] = False,
) -> None:
    """Build the fused-kernel library (or find it in the cache) and say what it holds.

    The CUDA library compiles with nvcc and needs no GPU; the fused attention is compiled in only
    where cuDNN's and cudnn-frontend's headers are found, GemmBias only where cuBLASLt is. A
    library copied with --copy-to runs on another machine of the same architecture, named by
    $MPGRAPH_CUDA_LIBRARY (or $MPGRAPH_CPU_LIBRARY) there.
    """
    from mpgraph.lowering.build import PREBUILT

    from mpgraph.errors import UsageError

    if copy_to is not None and copy_to.is_dir():
        raise UsageError(f"--copy-to {copy_to} is a folder; name the file to write (e.g. {copy_to / 'libmpgraph_kernels.so'})")
    cuda = not cpu
    facts = library_facts(cuda)
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(facts["path"], copy_to)
        facts["copied_to"] = str(copy_to)
    if as_json:
        sys.stdout.write(json.dumps(facts, indent=1) + "\n")
        return
    where = f" (prebuilt, from {facts['prebuilt']})" if facts["prebuilt"] else ""
    console.print(f"{'CUDA' if cuda else 'CPU'} kernel library: {escape(facts['path'])}{where}, "
                  f"{facts['bytes'] / 2**20:.1f} MiB", highlight=False, soft_wrap=True)
    if cuda:
        for key, name in (("fused_attention", "fused attention (cuDNN SDPA)"), ("gemm_bias", "GemmBias (cuBLASLt)")):
            state = "[green]in[/]" if facts[key] else f"[yellow]not in[/]: {escape(facts[key + '_why_not'])}"
            console.print(f"  {name}: {state}", highlight=False, soft_wrap=True)
        if facts["gemm_bias"] and not facts["gemm_bias_runs"]:
            console.print("  GemmBias runs on CUDA only with MPGRAPH_GEMM_BIAS=cublaslt", highlight=False)
    if copy_to is not None:
        console.print(f"copied to {escape(str(copy_to))}; where it runs: export {PREBUILT[cuda]}={escape(str(copy_to.resolve()))}",
                      highlight=False, soft_wrap=True)
