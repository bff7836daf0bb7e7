"""``mpgraph kernels``: build (or find) the kernel library and say what it holds."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from mpgraph.cli.console import console

__all__ = ["kernels_command"]


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
    from mpgraph.errors import UsageError
    from mpgraph.lowering.build import PREBUILT

    if copy_to is not None and copy_to.is_dir():
        raise UsageError(f"--copy-to {copy_to} is a folder; name the file to write (e.g. {copy_to / 'libmpgraph_kernels.so'})")
    from mpgraph.lowering.plan import library_facts

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
            console.print("  GemmBias turned off on CUDA: MPGRAPH_GEMM_BIAS=ort", highlight=False)
    if copy_to is not None:
        console.print(f"copied to {escape(str(copy_to))}; where it runs: export {PREBUILT[cuda]}={escape(str(copy_to.resolve()))}",
                      highlight=False, soft_wrap=True)
