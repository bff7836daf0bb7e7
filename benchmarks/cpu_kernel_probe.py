"""Which ONNX ops ORT's CPU provider runs in float16 / bfloat16, and how.

For every op of onnx's single-node backend test models (``onnx.backend.test.case.node``),
per opset (18, 21, 22 like ``cuda_kernel_probe.py``, and 23, 24 for the ops those opsets
added: Attention, RotaryEmbedding, RMSNormalization) and dtype, the probe takes the op's
first test case whose float32 version ORT CPU loads and runs at that opset, lowers the slots
that carry the op's compute type (as ``mpgraph convert`` would: ``mpgraph.optypes``), opens it
on ORT CPU and runs it on the test's inputs. Each cell is:

* ``ok``: a kernel in that dtype ran;
* ``fp32``: it ran, but ORT inserted Casts around the node (it computes in float32; ORT does
  this for float16 only);
* ``no: <ORT's first line>``: the session or the run failed;
* ``n/a: ...``: no test case of the op loads in float32 at that opset (the cell says nothing
  about the low dtype).

The JSON it writes is the format of ``cuda_kernel_probe.py``'s (``onnxruntime``, ``table``,
``missing``), which ``mpgraph/kernel_table.py`` is generated from (``--table``)::

    .venv/bin/python benchmarks/cpu_kernel_probe.py --out benchmarks/results \\
        --table mpgraph/kernel_table.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections import defaultdict

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto

from mpgraph.optypes import node_typing

DTYPES = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
HERE = os.path.dirname(os.path.abspath(__file__))


def cases() -> dict[str, list[tuple[onnx.ModelProto, list[np.ndarray]]]]:
    """Op type -> (model, inputs) of single-node, default-domain test models without subgraphs.

    The onnx wheel ships no ``backend/test/data/node`` directory; the generators that write it
    (``onnx.backend.test.case.node.collect_testcases``) build the same models in memory.
    """
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow on purpose (cast tests)
        collected = node.collect_testcases(None)
    found: dict[str, list[tuple[onnx.ModelProto, list[np.ndarray]]]] = defaultdict(list)
    for case in sorted(collected, key=lambda c: c.name):
        model = case.model
        if model is None or not case.data_sets or len(model.graph.node) != 1:
            continue
        only = model.graph.node[0]
        if only.domain not in ("", "ai.onnx") or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in only.attribute
        ):
            continue
        inputs = list(case.data_sets[0][0])
        if all(isinstance(a, np.ndarray) for a in inputs):
            found[only.op_type].append((model, inputs))
    return found


def lowered(
    case: tuple[onnx.ModelProto, list[np.ndarray]], opset: int, dtype: str
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The case's model at ``opset`` with its compute-typed float slots in ``dtype``; None if none."""
    model = onnx.ModelProto()
    model.CopyFrom(case[0])
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", opset))
    model.ir_version = 10
    feeds = dict(zip([i.name for i in model.graph.input], case[1]))
    node = ir.from_proto(model).graph.node(0)
    typing = node_typing(node, {"": opset})
    if typing.schema is None or not typing.compute_vars:
        return None
    slots = {node.inputs[i].name for i in typing.compute_inputs() if node.inputs[i] is not None}
    slots |= {node.outputs[i].name for i in typing.compute_outputs()}
    changed = False
    # Cases written in float64 probe the same kernels once made float32.
    for info in (*model.graph.input, *model.graph.output):
        tensor_type = info.type.tensor_type
        if info.name in slots and tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE):
            tensor_type.elem_type = DTYPES[dtype]
            changed = True
    if not changed:
        return None
    numpy_types = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}
    names = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    typed = {
        name: array.astype(numpy_types[names[name]]) if name in slots and names.get(name) in numpy_types else array
        for name, array in feeds.items()
    }
    return model, typed


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[str, int]:
    """``ok`` or the first line of ORT's error, and how many Casts ORT added."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "opt.onnx")
        try:
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            added = sum(n.op_type == "Cast" for n in onnx.load(options.optimized_model_filepath).graph.node)
            inputs = {}
            for name, array in feeds.items():
                if array.dtype == ml_dtypes.bfloat16:
                    inputs[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        array.view(np.uint16), TensorProto.BFLOAT16
                    )
                else:
                    inputs[name] = ort.OrtValue.ortvalue_from_numpy(array)
            binding = session.io_binding()
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, value)
            for out in session.get_outputs():
                binding.bind_output(out.name, "cpu")
            session.run_with_iobinding(binding)
        except Exception as e:  # noqa: BLE001 - the probe reports whatever ORT says
            return (str(e).strip().splitlines() or [type(e).__name__])[0][:160], 0
    return "ok", added


def probe(op: str, dirs: list[tuple[onnx.ModelProto, list[np.ndarray]]], opset: int) -> dict[str, str]:
    """The op's cells at one opset, from its first test case that runs in float32."""
    try:
        onnx.defs.get_schema(op, opset)
    except onnx.defs.SchemaError:
        return {d: f"n/a: no {op} schema at opset {opset}" for d in DTYPES}
    first_error = "no test case"
    for case in dirs:
        base = lowered(case, opset, "float")
        if base is None:
            first_error = "no test case with a float compute slot"
            continue
        status, _ = run(*base)
        if status != "ok":
            first_error = first_error if first_error != "no test case" else status
            continue
        made = {dtype: lowered(case, opset, dtype) for dtype in ("float16", "bfloat16")}
        if any(m is None for m in made.values()):
            first_error = "no test case with a float compute slot"
            continue  # e.g. an integer case of an op that also takes floats
        row = {"float": "ok", "case": case[0].graph.name}
        for dtype, (model, feeds) in made.items():  # type: ignore[misc]
            status, casts = run(model, feeds)
            row[dtype] = ("fp32" if casts else "ok") if status == "ok" else f"no: {status}"
        return row
    return {d: f"n/a: {first_error}" for d in DTYPES}


def probe_generic(op: str, opset: int) -> dict[str, str]:
    """The op's cells from ``cuda_kernel_probe.py``'s hand-built one-node model (inputs of ones)."""
    import cuda_kernel_probe

    row = {"case": f"cuda_kernel_probe.model({op!r})"}
    for dtype, elem in DTYPES.items():
        proto, floats, extra = cuda_kernel_probe.model(op, elem, opset)
        np_type = {"float": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
        feeds = {x: np.ones(cuda_kernel_probe.SHAPE, np_type) for x in floats}
        feeds.update({name: value for name, _, value in extra})
        status, casts = run(proto, feeds)
        row[dtype] = ("fp32" if casts else "ok") if status == "ok" else f"no: {status}"
    if row["float"] != "ok":
        return {d: f"n/a: {row['float']}" for d in DTYPES}
    return row


#: CUDA facts measured outside cuda_kernel_probe.py, with where: a bfloat16 ConvTranspose
#: (the data gradient of a strided Conv) failed to load on ORT 1.31.1 CUDA
#: (benchmarks/results/gpu_train.md: "Provider type for ConvTranspose node ... is not set").
CUDA_OBSERVED = {"ConvTranspose": {f"bfloat16@{o}": "no" for o in (18, 21, 22)}}


def write_table(path: str, cpu: dict, cuda_path: str) -> None:
    """Generate ``mpgraph/kernel_table.py`` from the CPU probe and the committed CUDA probe."""
    with open(cuda_path) as f:
        cuda = json.load(f)

    def compact(data: dict) -> dict:
        out: dict[str, dict[str, str]] = {}
        for op, row in sorted(data["table"].items()):
            cells = {}
            for column, status in row.items():
                if column == "case":
                    continue
                kind = status.split(":")[0] if status not in ("ok", "fp32") else status
                cells[column] = {"ok": "ok", "fp32": "fp32", "n/a": "n/a"}.get(kind, "no")
            out[op] = cells
        return out

    tables = {
        "cpu": {"onnxruntime": cpu["onnxruntime"], "probe": "benchmarks/cpu_kernel_probe.py", "ops": compact(cpu)},
        "cuda": {
            "onnxruntime": cuda["onnxruntime"],
            "probe": "benchmarks/cuda_kernel_probe.py",
            "ops": dict(sorted({**compact(cuda), **CUDA_OBSERVED}.items())),
        },
    }
    with open(path, "w") as f:
        f.write(
            '"""Kernel tables of ORT providers, generated by benchmarks/cpu_kernel_probe.py --table.\n\n'
            "Do not edit: rerun the probes (benchmarks/cpu_kernel_probe.py here, benchmarks/cuda_kernel_probe.py\n"
            "on a GPU machine, whose JSON lands in benchmarks/results/cuda_kernels.json) and regenerate.\n"
            "Cells per op and ``dtype@opset``: ``ok`` (kernel), ``fp32`` (runs behind Casts ORT inserts),\n"
            '``no`` (ORT refuses), ``n/a`` (the probe could not build a float32 case at that opset).\n"""\n\n'
            "TABLES = {\n"
        )
        for provider, data in tables.items():
            f.write(f"    {provider!r}: {{\n        'onnxruntime': {data['onnxruntime']!r},\n")
            f.write(f"        'probe': {data['probe']!r},\n        'ops': {{\n")
            for op, cells in data["ops"].items():
                f.write(f"            {op!r}: {dict(sorted(cells.items()))!r},\n")
            f.write("        },\n    },\n")
        f.write("}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for cpu_kernels.json")
    parser.add_argument("--opsets", default="18,21,22,23,24")
    parser.add_argument("--table", help="also regenerate this kernel_table.py module")
    parser.add_argument("--cuda-json", default=os.path.join(HERE, "results", "cuda_kernels.json"))
    args = parser.parse_args()
    print("onnxruntime", ort.__version__, ort.get_available_providers(), "onnx", onnx.__version__)
    opsets = [int(o) for o in args.opsets.split(",")]
    sys.path.insert(0, HERE)
    from cuda_kernel_probe import OPS as generic_ops

    table: dict[str, dict[str, str]] = {}
    for op, dirs in sorted(cases().items()):
        row: dict[str, str] = {}
        for opset in opsets:
            cells = probe(op, dirs, opset)
            row.update({f"{d}@{opset}": cells[d] for d in DTYPES})
            if "case" in cells:
                row.setdefault("case", cells["case"])
        if all(v.startswith("n/a") for c, v in row.items() if c != "case") and op in generic_ops:
            row = {}
            for opset in opsets:  # no node test case in float: the CUDA probe's model
                cells = probe_generic(op, opset)
                row.update({f"{d}@{opset}": cells[d] for d in DTYPES})
                row.setdefault("case", cells.get("case", ""))
        table[op] = row
        print(f"{op:28s} " + "  ".join(f"{c}: {r.split(':')[0]}" for c, r in row.items() if c != "case"))
    columns = [f"{d}@{o}" for o in opsets for d in DTYPES]
    missing = {c: [op for op, row in table.items() if row[c].startswith("no")] for c in columns}
    print("no kernel:", json.dumps(missing))
    data = {"onnxruntime": ort.__version__, "table": table, "missing": missing}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_kernels.json"), "w") as f:
            json.dump(data, f, indent=1)
    if args.table:
        write_table(args.table, data, args.cuda_json)


if __name__ == "__main__":
    main()
