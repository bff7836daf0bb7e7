"""A seeded mutation fuzzer over the zoo models: no mutant may end in a traceback.

Every mutant is a zoo model (or a step graph built from one) with one seeded corruption: bytes
truncated or flipped, names made invalid UTF-8, unknown element types on values, Casts and
initializers, initializers whose bytes disagree with their shape, dangling or duplicated
names, broken ``mpgraph.*`` metadata, external data that is missing, absolute or escaping the
folder, bad opsets and IR versions, nodes out of topological order, Cast ``to`` attributes of
another type, negative or huge input dimensions. Each mutant goes through ``audit`` and ``convert`` (and
``train`` for step graphs) in-process against the real Typer app.

Rules checked for every run:
    1. The exit code is 0 or 2: never 1 (an unforeseen exception, i.e. a bug) nor anything else.
    2. No traceback, and at most one ``error:`` line.
    3. A model that ``convert`` writes passes ``onnx.checker`` (full check).

Mutant ``i`` is drawn from its own generator, ``random.Random(i)``, so any slice of the range
runs alone: mutants 0-239 run in two chunks on every run, 240-739 in four chunks under
``--runslow`` (the slow range continues the quick one, so no mutant number runs twice, and
pytest-xdist spreads the chunks). ``MPGRAPH_FUZZ_MUTANTS`` moves the end of the quick range
(default 240). All 740 take about 27 s of CPU on the 2-core machine.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.test_faults import run

ZOO = Path(__file__).resolve().parents[1] / "models" / "onnx"
MODELS = ("tiny_mlp.onnx", "tiny_mlp.loss.onnx", "wide_mlp.onnx", "dqn_cnn.onnx", "dqn_cnn.loss.onnx",
          "gpt.loss.onnx")
BAD_TYPES = (0, 99, 999, 17, 30)
Mutation = Callable[[onnx.ModelProto, random.Random, Path], "bytes | onnx.ModelProto | None"]


def _node(m: onnx.ModelProto, rng: random.Random) -> onnx.NodeProto:
    return m.graph.node[rng.randrange(len(m.graph.node))]


def _init(m: onnx.ModelProto, rng: random.Random) -> onnx.TensorProto | None:
    inits = list(m.graph.initializer)
    return inits[rng.randrange(len(inits))] if inits else None


def truncate(m: onnx.ModelProto, rng: random.Random, d: Path) -> bytes:
    data = m.SerializeToString()
    return data[: rng.randrange(1, len(data))]


def flip_bytes(m: onnx.ModelProto, rng: random.Random, d: Path) -> bytes:
    data = bytearray(m.SerializeToString())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def invalid_utf8_name(m: onnx.ModelProto, rng: random.Random, d: Path) -> bytes:
    node = _node(m, rng)
    target = rng.choice([node.name, *node.output]) or node.name
    if not target:
        return m.SerializeToString()
    raw = target.encode()
    bad = bytes([0xFF]) + raw[1:]
    return m.SerializeToString().replace(raw, bad, rng.randint(1, 2))


def bad_value_type(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    values = [*m.graph.input, *m.graph.output, *m.graph.value_info]
    values[rng.randrange(len(values))].type.tensor_type.elem_type = rng.choice(BAD_TYPES)
    return m


def bad_cast_to(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    node = onnx.helper.make_node("Cast", [m.graph.input[0].name], ["fuzz/cast"], name="fuzz/cast",
                                 to=rng.choice(BAD_TYPES))
    m.graph.node.insert(0, node)
    m.graph.output.append(onnx.helper.make_tensor_value_info("fuzz/cast", onnx.TensorProto.FLOAT, None))
    return m


def bad_initializer_type(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    t = _init(m, rng)
    if t is not None:
        t.data_type = rng.choice(BAD_TYPES)
    return m


def initializer_bytes_mismatch(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    t = _init(m, rng)
    if t is None:
        return m
    choice = rng.randrange(3)
    if choice == 0 and t.dims:
        t.dims[rng.randrange(len(t.dims))] += rng.randint(1, 3)
    elif choice == 1 and t.HasField("raw_data") and len(t.raw_data) > 1:
        t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data))]
    else:
        t.data_type = onnx.TensorProto.DOUBLE if t.data_type == onnx.TensorProto.FLOAT else onnx.TensorProto.FLOAT16
    return m


def dangling_input(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    node = _node(m, rng)
    if node.input:
        node.input[rng.randrange(len(node.input))] = "fuzz/nowhere"
    return m


def duplicate_output(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    if len(m.graph.node) > 1:
        a, b = rng.sample(range(len(m.graph.node)), 2)
        m.graph.node[b].output[0] = m.graph.node[a].output[0]
    return m


def delete_node(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    del m.graph.node[rng.randrange(len(m.graph.node))]
    return m


def bad_attribute(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    nodes = [n for n in m.graph.node if n.attribute]
    if nodes:
        attr = rng.choice(nodes).attribute[0]
        kind = rng.randrange(3)
        if kind == 0:
            attr.type = onnx.AttributeProto.STRING
            attr.s = b"\xff\xfe"
        elif kind == 1:
            attr.i = rng.choice([-(2**40), 2**40, -1])
        else:
            attr.name = "fuzz_unknown"
    return m


def bad_metadata(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    keys = ["mpgraph.state_pairs", "mpgraph.gradients", "mpgraph.loss", "mpgraph.initializer_range",
            "mpgraph.training", "mpgraph.weight_bytes_before", "mpgraph.emulated", "mpgraph.grad_seed"]
    values = ["{", "[[1, 2]]", '[["nope", "nada"]]', "nope", "[1]", "maybe", "-3", '{"a": 1}', "[[\"x\"]]"]
    existing = [p for p in m.metadata_props if p.key.startswith("mpgraph.")]
    if existing and rng.random() < 0.6:
        rng.choice(existing).value = rng.choice(values)
    else:
        onnx.helper.set_model_props(m, {**{p.key: p.value for p in m.metadata_props},
                                        rng.choice(keys): rng.choice(values)})
    return m


def bad_external_data(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    t = _init(m, rng)
    if t is None:
        return m
    (d / "weights.bin").write_bytes(b"\0" * 16)
    (d / "sub").mkdir(exist_ok=True)
    if not (d / "link.bin").exists():
        (d / "link.bin").symlink_to(d / "weights.bin")
    location = rng.choice(["missing.bin", "/etc/hostname", "../outside.bin", "sub/../../x.bin", "link.bin",
                           "weights.bin", ""])
    t.ClearField("raw_data")
    del t.float_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    del t.external_data[:]
    entries = {"location": location, "offset": rng.choice(["0", "8", "-1", "x"]), "length": rng.choice(["4", "64", ""])}
    for k, v in entries.items():
        if v or k == "location":
            t.external_data.add(key=k, value=v)
    return m


def bad_opset(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    choice = rng.randrange(3)
    if choice == 0:
        m.opset_import[0].version = rng.choice([1, 5, 40, 999])
    elif choice == 1:
        del m.opset_import[:]
    else:
        m.ir_version = rng.choice([0, 1, 99])
    return m


def drop_outputs(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    del m.graph.output[:]
    return m


def reverse_nodes(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    """The nodes in reverse order (onnx-ir's ``clone_graph`` once failed on it: an internal error)."""
    nodes = list(m.graph.node)[::-1]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def cast_to_of_another_type(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    """A Cast whose ``to`` is a STRING, FLOAT, INTS or TENSOR attribute, its int field still 1."""
    node = onnx.helper.make_node("Cast", [m.graph.input[0].name], ["fuzz/cast"], name="fuzz/cast", to=1)
    attr = node.attribute[0]
    attr.type = rng.choice([onnx.AttributeProto.STRING, onnx.AttributeProto.FLOAT, onnx.AttributeProto.INTS,
                            onnx.AttributeProto.TENSOR])
    if attr.type == onnx.AttributeProto.STRING:
        attr.s = b"float"
    elif attr.type == onnx.AttributeProto.FLOAT:
        attr.f = 1.0
    elif attr.type == onnx.AttributeProto.INTS:
        attr.ints.extend([1, 10])
    else:
        attr.t.CopyFrom(onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT, [], [1.0]))
    m.graph.node.insert(0, node)
    m.graph.output.append(onnx.helper.make_tensor_value_info("fuzz/cast", onnx.TensorProto.FLOAT, None))
    return m


def bad_input_dim(m: onnx.ModelProto, rng: random.Random, d: Path) -> onnx.ModelProto:
    """A data input declares a negative or huge dimension (the range check's random inputs once
    ran out of memory or into numpy's size limit)."""
    inits = {t.name for t in m.graph.initializer}
    dims = [dim for v in m.graph.input if v.name not in inits for dim in v.type.tensor_type.shape.dim]
    if dims:
        rng.choice(dims).dim_value = rng.choice([-1, -3, 2**31, 2**40, 2**62, 2**63 - 1])
    return m


MUTATIONS: tuple[Mutation, ...] = (
    truncate, flip_bytes, invalid_utf8_name, bad_value_type, bad_cast_to, bad_initializer_type,
    initializer_bytes_mismatch, dangling_input, duplicate_output, delete_node, bad_attribute, bad_metadata,
    bad_external_data, bad_opset, drop_outputs, reverse_nodes, cast_to_of_another_type, bad_input_dim,
)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, onnx.ModelProto]:
    from mpgraph.io import save_model
    from mpgraph.training import build_training_graph

    out = {name: onnx.load(str(ZOO / name)) for name in MODELS}
    step = tmp_path_factory.mktemp("fuzz") / "tiny.step.onnx"
    save_model(build_training_graph(str(ZOO / "tiny_mlp.loss.onnx"), optimizer="adamw"), step)
    out["tiny.step.onnx"] = onnx.load(str(step))
    return out


def _write(mutant: bytes | onnx.ModelProto, path: Path) -> None:
    path.write_bytes(mutant if isinstance(mutant, bytes) else mutant.SerializeToString())


def _check_run(args: list[str], label: str) -> tuple[int, str]:
    code, text = run(*args)
    assert code in (0, 2), f"{label}: {args[0]} exit {code}: {text[-600:]}"
    assert "Traceback" not in text, f"{label}: {text[-600:]}"
    assert text.count("error:") <= 1, f"{label}: {text[-600:]}"
    return code, text


def run_mutants(mutants: range, bases: dict[str, onnx.ModelProto], root: Path) -> dict[str, int]:
    """Mutate and run the models numbered ``mutants``; returns exit-code counts (assertions fail
    on the first bad one)."""
    names = sorted(bases)
    data = root / "tiny.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32),
             label=np.arange(16, dtype=np.int64) % 2)
    counts = {"mutants": 0, "rejected": 0, "converted": 0}
    for i in mutants:
        rng = random.Random(i)
        base_name = names[i % len(names)]
        mutation = MUTATIONS[rng.randrange(len(MUTATIONS))]
        folder = root / f"m{i}"
        folder.mkdir()
        model = onnx.ModelProto()
        model.CopyFrom(bases[base_name])
        mutant = mutation(model, rng, folder)
        path = folder / "model.onnx"
        _write(mutant if mutant is not None else model, path)
        label = f"mutant {i} ({mutation.__name__} of {base_name})"
        code, _ = _check_run(["audit", str(path), "--json"], label)
        out = folder / "out.onnx"
        code, _ = _check_run(["convert", str(path), "-p", rng.choice(["fp16", "bf16"]), "-o", str(out), "-q"]
                             + (["--emulate"] if rng.random() < 0.5 else []), label)
        counts["mutants"] += 1
        if code == 0:
            counts["converted"] += 1
            onnx.checker.check_model(str(out), full_check=True)
        else:
            counts["rejected"] += 1
            assert not out.exists(), f"{label}: a failed convert left {out}"
        if base_name == "tiny.step.onnx" and code == 0:
            _check_run(["train", str(path), "--data", str(data), "--steps", "2", "-q", "--no-eval"], label)
        shutil.rmtree(folder)
    return counts


def _chunks(start: int, stop: int, n: int) -> list[range]:
    """``range(start, stop)`` cut into ``n`` consecutive pieces."""
    edges = [start + (stop - start) * k // n for k in range(n + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


QUICK = _chunks(0, int(os.environ.get("MPGRAPH_FUZZ_MUTANTS", "240")), 2)
SLOW = _chunks(QUICK[-1].stop, QUICK[-1].stop + 500, 4)


@pytest.mark.parametrize("mutants", QUICK, ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_mutants_never_end_in_a_traceback(mutants: range, bases: dict[str, onnx.ModelProto], tmp_path: Path):
    counts = run_mutants(mutants, bases=bases, root=tmp_path)
    assert counts["mutants"] == len(mutants)
    # Both outcomes occur: the table is not all-rejecting (a broken loader) nor all-accepting.
    assert counts["rejected"] > len(mutants) // 4 and counts["converted"] > len(mutants) // 20, counts


@pytest.mark.slow
@pytest.mark.parametrize("mutants", SLOW, ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_500_more_mutants_never_end_in_a_traceback(mutants: range, bases: dict[str, onnx.ModelProto], tmp_path: Path):
    counts = run_mutants(mutants, bases=bases, root=tmp_path)
    assert counts["mutants"] == len(mutants)


def test_every_mutation_is_exercised():
    """The quick range draws every mutation (mutant ``i`` picks it with ``random.Random(i)``)."""
    picked = {MUTATIONS[random.Random(i).randrange(len(MUTATIONS))] for i in range(QUICK[0].start, QUICK[-1].stop)}
    assert picked == set(MUTATIONS)
