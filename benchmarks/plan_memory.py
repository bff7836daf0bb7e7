"""``estimate_memory`` of the session a CUDA Trainer captures, made on any machine: where a step's
device memory goes, by part, with the state in two sets or in place, under both arena growths.

The plan is made as ``plan_session`` makes the capturing session's on a GPU machine whose kernel
library has the fused attention and ``GemmBias``: the step graph specialised to the batch's shapes,
then the ``cuda`` rules of the ``default`` scope with ``sdpa`` and ``gemm_bias`` (no library is
built or loaded here; ``--no-sdpa``, ``--no-gemm-bias`` for a library without them). Sizes
come from the shapes the plan records (``recorded_shapes=True``). A capturing session has no
memory pattern, so the Trainer's part is persistent + outputs + first-step arena; the pattern
block is printed for reference. On CUDA the state sets come from onnxruntime's Python CUDA
allocator, whose arena grows by powers of two: ``cuda`` is that arena
(``cuda_state_arena_bytes``) + the first-step arena. Then what is live at the transient peak, by the role of the node
that made it (the loss head apart).

    python3 benchmarks/plan_memory.py STEP.onnx --shapes '{"input_ids": [8, 1024], "labels": [8, 1024]}'
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import onnx_ir as ir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpgraph._ir import meta as md  # noqa: E402
from mpgraph.audit import memory  # noqa: E402
from mpgraph.audit.ort_alloc import ARENA_STRATEGIES  # noqa: E402
from mpgraph.lowering.plan import _apply  # noqa: E402  (plan_session's rules, without a library)
from mpgraph.lowering.registry import Target  # noqa: E402
from mpgraph.lowering.specialize import specialize_shapes  # noqa: E402

GIB = 2**30


def capturing_plan(path: str, shapes: dict[str, list[int]], sdpa: bool, gemm_bias: bool = True) -> ir.Model:
    """The capturing CUDA session's plan of the step graph at ``path``, as ``plan_session`` makes
    it with a library that has the fused attention (``sdpa``) and cuBLASLt's ``GemmBias``
    (``gemm_bias``; on by default on CUDA, ``MPGRAPH_GEMM_BIAS=ort`` turns its rules off)."""
    model = specialize_shapes(ir.load(path), shapes)
    applied = _apply(model, Target("cuda", "default", sdpa=sdpa, gemm_bias=gemm_bias), False)
    print(f"# rules applied: {', '.join(f'{n} {k}' for n, k in applied if k)}")
    return model


def live_at_peak(model: ir.Model) -> tuple[int, str, dict[str, int]]:
    """The transient peak, where, and what is live there by the role of its producer."""
    nodes = memory.ort_order(model)
    buffers, *_ = memory._walk(nodes, memory._recorded(model), {v.name for v in model.graph.outputs})
    peak, where = memory._peak(buffers, nodes)
    at = next(i for i, n in enumerate(nodes) if f"{n.op_type} '{n.name}'" == where)
    producer = {v.name: n for n in nodes for v in n.outputs}
    parts: dict[str, int] = collections.Counter()
    for b in buffers:
        if b.start <= at <= b.end:
            node = producer[b.name]
            role = node.metadata_props.get(md.NODE_ROLE, "no role (inserted casts)")
            if node.op_type.startswith("CastTo"):
                role = "bf16 weight copies"
            elif "lm_head" in b.name or "SoftmaxCrossEntropy" in node.op_type:
                role = f"loss head ({role})"
            parts[role] += b.nbytes
    return peak, where, dict(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph")
    parser.add_argument("--shapes", required=True, help="JSON: data input -> shape of the batch.")
    parser.add_argument("--no-sdpa", action="store_true", help="A library without the fused attention.")
    parser.add_argument("--no-gemm-bias", action="store_true", help="A library without cuBLASLt's GemmBias.")
    args = parser.parse_args()
    start = time.perf_counter()
    model = capturing_plan(args.graph, json.loads(args.shapes), not args.no_sdpa, not args.no_gemm_bias)
    g = lambda b: f"{b / GIB:6.2f}"  # noqa: E731
    print(f"{'state':9s} {'arena':16s} {'inputs':>6s} {'outputs':>7s} {'arena':>6s} {'trainer':>7s} "
          f"{'state on cuda':>13s} {'cuda':>6s} {'(pattern':>8s} {'live peak':>9s} {'kept fwd':>8s})  GiB; "
          "trainer = inputs + outputs + arena; cuda = state on cuda + arena")
    for inplace in (False, True):
        for arena in ARENA_STRATEGIES:
            r = memory.estimate_memory(model, recorded_shapes=True, inplace=inplace, arena=arena)
            print(f"{'in place' if inplace else 'two sets':9s} {arena:16s} {g(r.persistent_bytes)} {g(r.output_bytes)} "
                  f" {g(r.first_step_arena_bytes)} {g(r.peak_without_pattern_bytes)}        {g(r.cuda_state_arena_bytes)} "
                  f"{g(r.cuda_state_arena_bytes + r.first_step_arena_bytes)}  {g(r.pattern_block_bytes)}  "
                  f"{g(r.transient_peak_bytes)}   {g(r.saved_for_backward_bytes)}"
                  + (f"  refused: {len(r.inplace_refused)}" if inplace else ""))
    peak, where, parts = live_at_peak(model)
    print(f"live at the transient peak, {g(peak)} GiB at {where}:")
    for role, nbytes in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {role:32s} {g(nbytes)}")
    print(f"({time.perf_counter() - start:.0f} s; unknown shapes: {r.unknown_shapes})")


if __name__ == "__main__":
    main()
