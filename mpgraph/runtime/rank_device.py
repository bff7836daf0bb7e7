"""Where a data-parallel rank runs, checked before anything is built.

``place_rank`` gives a rank its device (the CPU, or on ``cuda`` the GPU ``LOCAL_RANK`` names,
as torchrun sets it) and refuses, with the fix, what this machine cannot do: NCCL asked where
torch sees no GPU, ORT without its CUDA provider, more ranks on a node than visible GPUs.
``check_backend`` refuses a process group whose backend cannot reduce the provider's buffers.
``torch_modules`` imports torch (an optional extra) when a data-parallel executor is made.
"""

from __future__ import annotations

import os
from typing import Any

import onnxruntime as ort

from mpgraph.errors import MpgraphError, UsageError
from mpgraph.runtime import providers

__all__ = ["check_backend", "place_rank", "torch_modules"]


def torch_modules() -> tuple[Any, Any]:
    """``torch`` and ``torch.distributed``, imported when an executor is made (an optional
    extra); ``UsageError`` without torch."""
    try:
        import torch
        import torch.distributed
    except ImportError as e:
        raise UsageError(f"data-parallel training needs torch ({e}); install mpgraph[torch]") from e
    return torch, torch.distributed


def place_rank(provider: str, device_id: int, rank: int, world: int) -> tuple[str, int]:
    """The device a rank runs on: ``("cpu", 0)``, or on ``cuda`` ``("cuda", LOCAL_RANK)``
    (torchrun's; ``device_id`` without it), checked against what this machine has.

    Raises:
        UsageError: A provider other than ``cpu``/``cuda``.
        MpgraphError: ``cuda`` without a GPU torch can see, without ORT's CUDA provider, or
            with more ranks on this node than visible GPUs.
    """
    if provider == "cpu":
        return "cpu", 0
    if provider != "cuda":
        raise UsageError(f"data-parallel training runs on provider 'cpu' (gloo) or 'cuda' (NCCL), not '{provider}'")
    import torch

    if not torch.cuda.is_available():
        raise MpgraphError(f"data-parallel training on cuda (NCCL) needs a GPU, and torch {torch.__version__} sees "
                           "none (torch.cuda.is_available() is False); train with provider 'cpu' (gloo) here")
    if providers.PROVIDERS["cuda"] not in ort.get_available_providers():
        raise MpgraphError(f"onnxruntime {ort.__version__} has no {providers.PROVIDERS['cuda']}: install "
                           "onnxruntime-gpu, or train with provider 'cpu' (gloo)")
    local = int(os.environ.get("LOCAL_RANK", device_id))
    count = torch.cuda.device_count()
    if local >= count:
        raise MpgraphError(f"rank {rank} of {world} would run on cuda:{local}, but {count} GPU(s) are visible: "
                           f"start at most {count} process(es) per node (torchrun --nproc-per-node {count}) "
                           "or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return "cuda", local


def check_backend(provider: str, backend: str | None) -> None:
    """The process group's backend must reduce this provider's buffers: NCCL for ``cuda``
    (GPU tensors), gloo for ``cpu`` (host tensors). ``None``: no group (world size 1).

    Example:
        >>> check_backend("cpu", "gloo"); check_backend("cuda", "nccl"); check_backend("cuda", None)
        >>> check_backend("cpu", "nccl")
        Traceback (most recent call last):
        mpgraph.errors.MpgraphError: provider 'cpu' keeps its buckets in host memory, which the process group's backend 'nccl' cannot reduce: init_process_group('gloo') for 'cpu' (or train on provider 'cuda')
    """
    want = "nccl" if provider == "cuda" else "gloo"
    if backend is None or want in str(backend):
        return
    where = "GPU" if provider == "cuda" else "host"
    other = "cpu" if provider == "cuda" else "cuda"
    raise MpgraphError(f"provider '{provider}' keeps its buckets in {where} memory, which the process group's "
                       f"backend '{backend}' cannot reduce: init_process_group('{want}') for '{provider}' "
                       f"(or train on provider '{other}')")
