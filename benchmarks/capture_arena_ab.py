"""How much ORT's CUDA arena grows in a step's first call, by session graph and capture mode.

``trainer_memory.py`` showed ViT's capturing step growing the arena by 1.71 GiB in ORT's first
run where ``estimate_memory`` of the same plan says 0.69, while the step without CUDA graphs grows
it by 0.74. The two sessions differ in two ways at once: the capturing one runs the plan
specialised to the batch's shapes, and it has ``enable_cuda_graph``. This script separates them.
It loads graphs as ORT ran them (``MPGRAPH_ORT_OPTIMIZED_MODELS`` writes them, e.g.
``cuda-graph-0.onnx`` and ``cuda-0.onnx``), and runs each once with and without CUDA graph capture.
A third mode, ``stream``, runs without capture on the single EP-level stream that capture forces
(``use_ep_level_unified_stream``). Each configuration gets a fresh process, so every arena starts
empty.

Every input is a device buffer bound once, with random floats and zero integers. Each state output
is bound to its input's buffer, as the Trainer binds in-place state. Other outputs are left to ORT.
The arena's growth is read from ORT's INFO log (``memory_check.parse_arena_log``), split by the
runs ORT makes inside the call.

Run on the GPU machine with the kernel library the graphs name (``MPGRAPH_CUDA_LIBRARY``)::

    python3 benchmarks/capture_arena_ab.py --graphs DIR/cuda-graph-0.onnx,DIR/cuda-0.onnx
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_check import MARK, parse_arena_log  # noqa: E402

GiB = float(2**30)


def _child(args: argparse.Namespace) -> None:
    import onnx
    import onnxruntime as ort

    from mpgraph.runtime import providers

    providers.set_default_logger_severity(1)  # the arena logs its extensions through ORT's default logger
    proto = onnx.load(args.graph, load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    pairs = [tuple(p) for p in json.loads(meta.get("mpgraph.state_pairs", "[]"))]
    library = os.environ.get("MPGRAPH_CUDA_LIBRARY") or None
    cuda = args.provider == "cuda"
    options = {"device_id": "0", "arena_extend_strategy": args.arena} if cuda else {}
    if cuda and args.capture == "stream":  # no capture, but the one EP-level stream capture runs on
        options["use_ep_level_unified_stream"] = "1"
    session = providers.new_session(proto.SerializeToString(), args.provider, options, threads=None,
                                    cuda_graph=cuda and args.capture == "on", custom_ops=library if cuda else None,
                                    mem_pattern=False)
    device = "cuda" if cuda else "cpu"
    rng = np.random.default_rng(0)
    binding = session.io_binding()
    buffers = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in value.shape]
        dtype = providers.ORT_TYPES.get(value.type, np.float32)
        array = (rng.standard_normal(shape).astype(dtype) * 0.02 if np.issubdtype(dtype, np.floating)
                 else np.zeros(shape, dtype))
        # np.array: a 0-d product is a numpy scalar, which OrtValue refuses
        buffers[value.name] = ort.OrtValue.ortvalue_from_numpy(np.array(array, dtype, ndmin=len(shape)), device, 0)
        binding.bind_ortvalue_input(value.name, buffers[value.name])
    aliased = {out: inp for inp, out in pairs if inp in buffers}
    for value in session.get_outputs():
        if value.name in aliased:
            binding.bind_ortvalue_output(value.name, buffers[aliased[value.name]])
        else:
            binding.bind_output(value.name, device, 0)
    for step in (1, 2):
        print(f"{MARK} model:step{step}", file=sys.stderr, flush=True)
        session.run_with_iobinding(binding)
    print(f"{MARK} end", file=sys.stderr, flush=True)
    print(json.dumps({"inputs": len(buffers), "aliased": len(aliased)}), flush=True)


def _run(graph: str, capture: str, arena: str, timeout: int, provider: str = "cuda") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ort.log"
        env = {**os.environ, "MPGRAPH_ORT_LOG_SEVERITY": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--graph", graph, "--capture", capture,
               "--arena", arena, "--provider", provider]
        with log.open("w") as err:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=timeout,
                                  check=False)
        text = log.read_text(errors="replace")
    if done.returncode != 0:
        tail = [line for line in text.splitlines() if "rror" in line][-1:] or text.splitlines()[-1:]
        return {"error": f"exit {done.returncode}: {' '.join(tail)[:400]}"}
    phases = parse_arena_log(text)
    arena_name = "Cuda" if provider == "cuda" else "Cpu"
    return {name: phase.get(arena_name, {}) for name, phase in phases.items() if name.startswith("model")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", help="comma-separated ORT-optimized session graphs")
    parser.add_argument("--captures", default="on,off,stream",
                        help="on: CUDA graph capture; off: none; stream: none, on the EP-level stream capture uses")
    parser.add_argument("--arena", default="kSameAsRequested",
                        help="ORT's arena_extend_strategy (comma-separated: each is a configuration)")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--provider", default="cuda", help="cuda; cpu only checks this script on a CPU plan")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--graph", help=argparse.SUPPRESS)
    parser.add_argument("--capture", default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    print("# growth of ORT's device arena in GiB (extensions, largest request), by ORT run inside each call")
    for arena in args.arena.split(","):
        for graph in args.graphs.split(","):
            for capture in args.captures.split(","):
                result = _run(graph, capture, arena, args.timeout, args.provider)
                head = f"{Path(graph).name:20s} {arena:17s} capture {capture:3s} "
                if "error" in result:
                    print(f"{head} {result['error']}", flush=True)
                    continue
                parts = [f"{name.removeprefix('model:')} {slot.get('extended', 0) / GiB:.2f} "
                         f"({slot.get('count', 0)}x, {slot.get('largest', 0) / 2**20:.1f} MiB)"
                         for name, slot in result.items()]
                print(head + ";  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
