"""How much of ``audit --memory``'s error is ORT's graph optimizations? The zoo GPT's step graph,
walked as written and as ORT CPU optimizes it.

ORT fuses and removes nodes before it plans memory (``Transpose`` folded into ``FusedMatMul``,
the loss function inlined, constants folded). This script saves the graph ORT CPU runs
(``SessionOptions.optimized_model_filepath``, every dimension fixed to the batch so that ORT's
shapes are concrete), sizes its values (ORT's value_info, then ONNX shape inference for the rest)
and walks it with the estimator's own liveness (views, transient peak, pattern block): the
graph as written in ``ort_order``, ORT's graph in the order ORT saved it, its execution order.
It prints them next to each other, float32 only: ORT CPU runs no bf16 graph. A third row keeps
the batch symbolic, as the Trainer's session does (ORT then cannot fold the ``Shape`` nodes).

    python3 benchmarks/memory_ort_graph.py --batch 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpgraph._ir import meta as md  # noqa: E402
from mpgraph.audit import memory  # noqa: E402
from mpgraph.training import build_training_graph  # noqa: E402


def ort_graph(step: ir.Model, batch: int | None, level: str) -> onnx.ModelProto:
    """The graph ORT CPU runs for ``step`` (state as inputs, as the Trainer gives it), shapes
    inferred; ``batch=None`` keeps the symbolic batch, as the Trainer does."""
    proto = ir.to_proto(step)
    state = {a for a, _ in json.loads(step.metadata_props[md.MODEL_STATE_PAIRS])}
    kept = [t for t in proto.graph.initializer if t.name not in state]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    for value in (*proto.graph.input, *proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value") and batch is not None:
                dim.dim_value = batch
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level.upper()}")
        ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.shape_inference.infer_shapes(onnx.load(options.optimized_model_filepath), data_prop=True)


def sizes_of(proto: onnx.ModelProto) -> dict[str, int | None]:
    """Bytes per value from the shapes the model carries (ORT's value_info kept, unlike
    ``memory._concrete``, which infers afresh and cannot size ORT's contrib ops)."""
    sizes: dict[str, int | None] = {}
    for info in (*proto.graph.value_info, *proto.graph.output, *proto.graph.input):
        t = info.type.tensor_type
        item = memory._itemsize(t.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        known = item is not None and t.HasField("shape") and None not in dims
        sizes[info.name] = int(np.prod(dims, dtype=np.int64)) * item if known else None
    return sizes


def walk(model: ir.Model, sizes: dict[str, int | None], nodes: list[ir.Node]) -> tuple[int, int, int, int]:
    """Transient peak, pattern block, intermediates of unknown size, nodes."""
    buffers, _, _, unknown = memory._walk(nodes, sizes, {v.name for v in model.graph.outputs})
    return memory._peak(buffers, nodes)[0], memory._pattern_block(buffers), unknown, len(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--level", default="extended", choices=("basic", "extended", "all"))
    args = parser.parse_args()
    step = build_training_graph("models/onnx/gpt.loss.onnx", optimizer="adamw", optimizer_options={"weight_decay": 0.01})
    as_written = walk(step, memory._concrete(ir.to_proto(step), args.batch, {}), memory.ort_order(step))
    optimized = ort_graph(step, args.batch, args.level)
    run = ir.from_proto(optimized)
    as_run = walk(run, sizes_of(optimized), list(run.graph))  # ORT saves its nodes in its execution order
    # With the symbolic batch ORT cannot fold the Shape nodes; its values are sized by name from
    # the two graphs above (the names ORT keeps).
    symbolic = ir.from_proto(ort_graph(step, None, args.level))
    by_name = {**memory._concrete(ir.to_proto(step), args.batch, {}),
               **{k: v for k, v in sizes_of(optimized).items() if v is not None}}
    as_trained = walk(symbolic, by_name, list(symbolic.graph))
    print(f"zoo GPT fp32 step graph, batch {args.batch}, ORT {ort.__version__} CPU, optimization level {args.level}")
    print(f"{'graph':34s} {'nodes':>6s} {'transient MB':>13s} {'pattern block MB':>17s} {'unknown':>8s}")
    for name, (peak, block, unknown, nodes) in (("as written", as_written), ("as ORT optimizes it, batch fixed", as_run),
                                                ("as ORT optimizes it, batch symbolic", as_trained)):
        print(f"{name:34s} {nodes:6d} {peak / 1e6:13.1f} {block / 1e6:17.1f} {unknown:8d}")


if __name__ == "__main__":
    main()
