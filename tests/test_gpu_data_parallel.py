"""The data-parallel executor on CUDA: NCCL ranks (one per visible GPU, at most 2; world size 1
on a one-GPU machine) against one CPU process over the same slices.

Each rank (``torch.multiprocessing.spawn``) runs on ``cuda:<rank>`` with strict float32
(``tf32=False``): ORT writes the gradients into torch tensors on the GPU through DLPack and
NCCL reduces them in place. Against the CPU reference (``DataParallelRunner`` with as many
micro-batches as the ranks have slices, gloo-free) the results agree to float32 rounding, not
bit for bit: the GPU's kernels sum in another order. Every rank ends with the same state, bit
for bit (the reduced gradients are the same bits everywhere and the apply part is
elementwise). Marked ``gpu``: skipped without CUDA, NCCL or onnxruntime-gpu.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.gpu

HAS_CUDA = (torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()
            and torch.distributed.is_nccl_available())

#: name: (model, options, steps, global batch)
CASES = {
    "mlp": ("tiny_mlp", {"reduction": "all_reduce", "bucket_bytes": 4096}, 3, 8),
    "mlp_ordered": ("tiny_mlp", {"reduction": "ordered", "micro_batches": 2}, 3, 8),
    "gpt": ("gpt", {"reduction": "all_reduce", "bucket_bytes": 1 << 16}, 2, 4),
}


def _rank(rank: int, world: int, folder: str) -> None:
    """One NCCL rank: every case, its state and losses to ``folder``."""
    import torch.distributed as dist

    from mpgraph.runtime.data_parallel import DataParallelOptions, DataParallelRunner, shard_batch
    from mpgraph.runtime.options import RunOptions
    from tests.test_data_parallel import _batches, _step

    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        for name, (model, options, steps, size) in CASES.items():
            runner = DataParallelRunner(_step(model), options=DataParallelOptions(**options),
                                        run_options=RunOptions(provider="cuda", tf32=False))
            executor = runner.executor
            losses = [runner.step(shard_batch(b, rank, world)).loss for b in _batches(model, steps, None, size)]
            # The buckets are GPU tensors, and ORT wrote the gradients into them (same addresses).
            where = {str(t.device) for t in executor.bucket_tensors}
            same = (all(o.data_ptr() == executor.bucket_views()[n].data_ptr()
                        for n, o in executor.gradient_outputs().items() if n in executor.bucket_views())
                    if options.get("micro_batches", 1) == 1 else True)
            np.savez(os.path.join(folder, f"{name}.{rank}.npz"), __losses=np.array(losses),
                     __where=np.array(sorted(where)), __same=np.array(same), **runner.full_state())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_CUDA:
        pytest.skip("needs CUDA, NCCL and onnxruntime-gpu's CUDAExecutionProvider")
    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 2)
    folder = tmp_path_factory.mktemp("nccl")
    mp.spawn(_rank, args=(world, str(folder)), nprocs=world, join=True)
    out = {}
    for name in CASES:
        out[name] = []
        for rank in range(world):
            with np.load(folder / f"{name}.{rank}.npz") as data:
                out[name].append({k: data[k] for k in data.files})
    return world, out


@pytest.mark.parametrize("name", list(CASES))
def test_nccl_ranks_train_like_one_cpu_process(ranks, name):
    from mpgraph.runtime.data_parallel import DataParallelOptions, DataParallelRunner
    from tests.test_data_parallel import _batches, _step

    world, results = ranks
    model, options, steps, size = CASES[name]
    slices = world * options.get("micro_batches", 1)
    reference = DataParallelRunner(_step(model), options=DataParallelOptions(threads=1, micro_batches=slices))
    losses = [reference.step(b).loss for b in _batches(model, steps, None, size)]
    state = reference.full_state()
    for rank, got in enumerate(results[name]):
        assert got["__where"].tolist() == [f"cuda:{rank}"]
        assert bool(got["__same"]), "ORT did not write the gradients into the bucket tensors"
        np.testing.assert_allclose(got["__losses"], losses, rtol=1e-5, err_msg=f"rank {rank}")
        for key, value in state.items():
            # AdamW turns the rounding noise of a gradient that is zero in exact arithmetic into
            # updates of up to lr (test_data_parallel: 1.6e-5 on the GPT): atol 1e-4.
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-4, err_msg=f"{name} rank {rank}: {key}")
            np.testing.assert_array_equal(got[key], results[name][0][key], err_msg=f"rank {rank} vs rank 0: {key}")
