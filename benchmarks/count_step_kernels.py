"""Node counts and bytes moved of a GPT training step graph, fp32 and bf16, on the CPU.

On ORT CUDA nearly every node of the step graph is one kernel launch (issue 11: 2,093 nodes,
1,805 kernels for the big GPT in bf16), so the node count of the graph ORT actually runs is
the kernel budget this script tracks without a GPU. For each model it builds the AdamW step
graph (``build_training_graph``) and its native bf16 conversion (``mpgraph.convert(step,
"bf16")``, the graph the GPU runs) and prints:

- nodes by role (``mpgraph.role``) and by op type;
- backward nodes per differentiated op type of the deny ops and GELU pieces
  (``mpgraph.grad_of``), with the count per forward node;
- the node count after ONNX Runtime's graph optimizer on the CPU provider
  (``ORT_ENABLE_EXTENDED`` and ``ORT_ENABLE_ALL``, saved with ``optimized_model_filepath``),
  by op type where it changes; ORT's CPU provider has no bfloat16 MatMul, so the bf16 graph
  gets no CPU session and says so;
- an estimate of the bytes moved per step: the sum over nodes of the sizes of their input
  and output tensors, from ONNX shape inference with the batch fixed to ``--batch``; nodes
  that move no data on ORT (shape reads, and Reshape/Flatten/Squeeze/Unsqueeze/Identity,
  which alias their input) are left out.

Models: ``models/onnx/gpt.loss.onnx`` (the zoo GPT), and with ``--big`` the GPT of issue 11
(vocab 8192, d 1024, 16 heads, 8 layers, T 512; exported from ``models.zoo.GPT`` as
``models/build_zoo.py`` does, about a minute and 3 GB of memory). Parameter initializers are
dropped before ORT sees the graph (they are graph inputs, so ORT never folds them anyway).

    .venv/bin/python benchmarks/count_step_kernels.py [--big] [--batch 8]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mpgraph  # noqa: E402
from mpgraph._ir.meta import NODE_GRAD_OF, NODE_INSERTED, NODE_ROLE  # noqa: E402

ZOO_GPT = ROOT / "models" / "onnx" / "gpt.loss.onnx"
# Forward ops whose backward this script itemises (the deny ops and the erf-GELU pieces).
ITEMISED = ("LayerNormalization", "Softmax", "LogSoftmax", "Erf", "Gelu", "Where", "Mul", "Div")
# Ops that move no tensor data on ORT: shape reads and views that alias their input.
NO_DATA = frozenset({"Shape", "Size", "Constant", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def big_gpt_forward() -> onnx.ModelProto:
    """The issue-11 GPT with its loss, exported like ``models/build_zoo.py`` exports the zoo."""
    import torch

    from models.zoo import GPT
    from mpgraph.export import export_module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = GPT(vocab=8192, seq=512, d_model=1024, heads=16, layers=8).train()
    tokens = torch.randint(0, 8192, (2, 512), generator=torch.Generator().manual_seed(0))
    return export_module(module, tokens, loss="cross_entropy")


def step_graph(forward: onnx.ModelProto | Path, policy: str) -> ir.Model:
    """The AdamW step graph, converted to ``policy`` natively unless it is ``fp32``."""
    step = mpgraph.build_training_graph(forward, optimizer="adamw", optimizer_options={"weight_decay": 0.01},
                                        validate=False)
    if policy != "fp32":
        step = mpgraph.convert(step, policy, emulate=False, validate=False)
    return step


def strip_parameters(model: ir.Model) -> None:
    """Drop initializers that are also graph inputs (weights, optimizer state): ORT treats
    them as runtime inputs either way, and the big GPT's would be 1.4 GB."""
    graph = model.graph
    for value in graph.inputs:
        if value.name in graph.initializers:
            graph.initializers.pop(value.name)
            value.const_value = None


def forward_ops(model: ir.Model) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph if n.metadata_props.get(NODE_ROLE) == "forward"}


def table(counter: collections.Counter, indent: str = "    ", width: int = 6) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    return "\n".join(f"{indent}{name:<28}{count:>{width}}" for name, count in items)


def itemised_backward(model: ir.Model) -> list[str]:
    forward = forward_ops(model)
    per_op: collections.Counter = collections.Counter()
    sources: dict[str, set[str]] = collections.defaultdict(set)
    for node in model.graph:
        twin = node.metadata_props.get(NODE_GRAD_OF)
        if twin is None or node.metadata_props.get(NODE_ROLE) != "backward":
            continue
        op = forward.get(twin)
        if op in ITEMISED:
            per_op[op] += 1
            sources[op].add(twin)
    forward_count = collections.Counter(forward.values())
    lines = []
    for op in ITEMISED:
        if forward_count[op]:
            emitted = per_op[op]
            lines.append(f"    {op:<20} {forward_count[op]:>4} forward nodes, {emitted:>5} backward nodes "
                         f"({emitted / forward_count[op]:.1f} each; {len(sources[op])} of them emit any)")
    return lines


def ort_optimized(proto: onnx.ModelProto, level: str) -> collections.Counter | str:
    """Op-type counts of the graph ORT's CPU provider runs after optimization at ``level``."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "step.onnx"), os.path.join(tmp, "step.opt.onnx")
        onnx.save(proto, src)
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        options.optimized_model_filepath = dst
        options.log_severity_level = 4
        options.intra_op_num_threads = 1
        try:
            ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - report why there is no count
            return str(exc).splitlines()[0][:160]
        optimized = onnx.load(dst, load_external_data=False)
    return collections.Counter(
        f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type for n in optimized.graph.node)


def _dims_fixed(type_proto: onnx.TypeProto, batch: int) -> None:
    if type_proto.HasField("tensor_type") and type_proto.tensor_type.HasField("shape"):
        for dim in type_proto.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_value = batch


def bytes_moved(proto: onnx.ModelProto, batch: int) -> tuple[dict[str, int], int, int]:
    """Bytes read plus written per role, the number of tensors of unknown size, and of nodes."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    del model.graph.value_info[:]
    for value in list(model.graph.input) + list(model.graph.output):
        _dims_fixed(value.type, batch)
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    sizes: dict[str, int | None] = {}
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        tensor = value.type.tensor_type
        if not tensor.HasField("shape") or any(not d.HasField("dim_value") for d in tensor.shape.dim):
            sizes[value.name] = None
            continue
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize
        sizes[value.name] = int(np.prod([d.dim_value for d in tensor.shape.dim], dtype=np.int64)) * itemsize
    for init in model.graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        sizes[init.name] = int(np.prod(init.dims, dtype=np.int64)) * itemsize
    per_role: dict[str, int] = collections.Counter()
    unknown: set[str] = set()
    for node in model.graph.node:
        if node.op_type in NO_DATA:
            continue
        role = _role({p.key: p.value for p in node.metadata_props})
        for name in _names(node.input, node.output):
            size = sizes.get(name)
            if size is None:
                unknown.add(name)
            else:
                per_role[role] += size
    return dict(per_role), len(unknown), len(model.graph.node)


def _role(metadata: dict[str, str]) -> str:
    """The node's role, or ``cast`` for the policy's inserted casts (they carry none)."""
    if NODE_ROLE in metadata:
        return metadata[NODE_ROLE]
    return "cast" if NODE_INSERTED in metadata else "other"


def _names(*groups: Iterable[str]) -> Iterable[str]:
    for group in groups:
        yield from (name for name in group if name)


def report(label: str, model: ir.Model, batch: int) -> None:
    nodes = list(model.graph)
    print(f"\n== {label}: {len(nodes)} nodes")
    print("  by role:")
    print(table(collections.Counter(_role(dict(n.metadata_props)) for n in nodes)))
    print("  backward of the deny ops and GELU pieces (mpgraph.grad_of):")
    print("\n".join(itemised_backward(model)))
    print("  by op type:")
    print(table(collections.Counter(n.op_type for n in nodes)))
    strip_parameters(model)
    proto = ir.to_proto(model)
    t0 = time.perf_counter()
    per_role, unknown, _ = bytes_moved(proto, batch)
    total = sum(per_role.values())
    roles = ", ".join(f"{role} {size / 1e6:,.1f}" for role, size in sorted(per_role.items()))
    print(f"  bytes moved per step (batch {batch}, inputs + outputs of every data-moving node): {total / 1e6:,.1f} MB "
          f"({roles}); {unknown} tensors of unknown size not counted [{time.perf_counter() - t0:.0f} s]")
    before = collections.Counter(n.op_type for n in nodes)
    for level in ("ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"):
        t0 = time.perf_counter()
        optimized = ort_optimized(proto, level)
        if isinstance(optimized, str):
            print(f"  ORT CPU {level}: no session: {optimized}")
            continue
        changed = collections.Counter({op: optimized.get(op, 0) - before.get(op, 0)
                                       for op in set(optimized) | set(before)
                                       if optimized.get(op, 0) != before.get(op, 0)})
        print(f"  ORT CPU {level}: {sum(optimized.values())} nodes [{time.perf_counter() - t0:.0f} s]; "
              "change by op type:")
        print(table(changed, indent="      ", width=6))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also the issue-11 GPT (d1024, 8 layers, T512)")
    parser.add_argument("--batch", type=int, default=8, help="batch size for the bytes estimate")
    args = parser.parse_args(argv)
    print(f"# onnxruntime {__import__('onnxruntime').__version__}, onnx {onnx.__version__}")
    models: list[tuple[str, Any]] = [("zoo GPT (models/onnx/gpt.loss.onnx)", ZOO_GPT)]
    if args.big:
        t0 = time.perf_counter()
        models.append(("issue-11 GPT (vocab 8192, d 1024, 16 heads, 8 layers, T 512)", big_gpt_forward()))
        print(f"# exported the issue-11 GPT in {time.perf_counter() - t0:.0f} s")
    for name, forward in models:
        for policy in ("fp32", "bf16"):
            t0 = time.perf_counter()
            step = step_graph(forward, policy)
            print(f"\n# {name}, {policy} step graph built in {time.perf_counter() - t0:.0f} s")
            report(f"{name} {policy}", step, args.batch)
            del step
            gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
