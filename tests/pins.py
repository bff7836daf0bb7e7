"""Byte pins of what mpgraph writes: step graphs and converted models, as sha256 of their bytes.

A refactor that claims "behaviour unchanged" proves it here: every case below must produce the
same bytes before and after. ``tests/test_pins.py`` checks the table in ``tests/pins.json``;
after a change that is meant to alter graphs, regenerate it and say why in the commit::

    .venv/bin/python -m tests.pins            # rewrites tests/pins.json, prints what changed
    .venv/bin/python -m tests.pins --check convert/ step/gpt   # compares cases whose id
                                              # contains any of the words; writes nothing

The cases: every zoo model converted under every preset (native and emulated); the onnx wheel's
nine light models under every preset (native, and emulated for the low-precision ones); every
zoo step graph with every optimizer, and the option variants (flat, pack, BatchNorm forms,
target, freeze); and the adamw step graphs converted under every preset.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from tests.helpers import shared_range_checks

ROOT = Path(__file__).resolve().parents[1]
ZOO_DIR = ROOT / "models" / "onnx"
PINS = Path(__file__).with_name("pins.json")
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"

ZOO = ("tiny_mlp", "wide_mlp", "dqn_cnn", "resnet", "gpt")
PRESETS = ("fp32", "tf32", "bf16", "fp16", "tf-amp", "torch-autocast")
LOW_PRESETS = ("bf16", "fp16", "tf-amp", "torch-autocast")
OPTIMIZERS = ("sgd", "adam", "adamw", None)
# (case suffix, build_training_graph keyword arguments), on every zoo model.
STEP_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("adamw-flat", {"optimizer": "adamw", "optimizer_options": {"flat": True}}),
    ("adam-pack", {"optimizer": "adam", "optimizer_options": {"pack": True}}),
    ("sgd-momentum-nesterov", {"optimizer": "sgd", "optimizer_options": {"momentum": 0.9, "nesterov": True}}),
    ("adamw-train-ops", {"optimizer": "adamw", "batchnorm": "train-ops"}),
    ("adamw-bn-eval", {"optimizer": "adamw", "batchnorm": "eval"}),
    ("adamw-cuda", {"optimizer": "adamw", "target": "cuda"}),
)


#: Fields of ``mpgraph.calibration`` that are statistics of ORT CPU's float32 outputs, not
#: decisions: how many values have entries under float16's smallest subnormal, and the worst
#: five. Outputs that sit at that threshold cross it with another CPU's summation order (the
#: zoo GPT's fp16-family step graphs pinned on an AVX-512 machine differed on an AVX2 one), so
#: the pins leave them out; what the calibration decided (``kept_float32``) is in the graph.
MEASURED_CALIBRATION_FIELDS = ("values_flushing", "worst_flushing")


def _digest(model: ir.Model) -> str:
    proto = ir.serde.serialize_model(model)
    for prop in proto.metadata_props:
        if prop.key == "mpgraph.calibration":
            summary = json.loads(prop.value)
            prop.value = json.dumps({k: v for k, v in summary.items() if k not in MEASURED_CALIBRATION_FIELDS},
                                    sort_keys=True)
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


@functools.cache
def _zoo_bytes(name: str, with_loss: bool) -> bytes:
    return (ZOO_DIR / f"{name}{'.loss' if with_loss else ''}.onnx").read_bytes()


def _zoo(name: str, with_loss: bool) -> onnx.ModelProto:
    return onnx.load_from_string(_zoo_bytes(name, with_loss))


def _light_models() -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(LIGHT_DIR / "light_*.onnx")))


@functools.cache
def _adamw_step(name: str) -> ir.Model:
    """The zoo model's AdamW step graph: case ``step/<name>/adamw``, and (a copy) the input of
    its ten conversions, built once per process instead of eleven times."""
    import mpgraph

    return mpgraph.build_training_graph(_zoo(name, True), optimizer="adamw")


@functools.cache
def _adamw_step_bytes(name: str) -> bytes:
    return ir.to_proto(_adamw_step(name)).SerializeToString()


def cases() -> Iterator[tuple[str, Callable[[], ir.Model]]]:
    """Every pinned case as (id, build), in a fixed order."""
    import mpgraph

    def convert(load: Callable[[], object], preset: str, emulate: bool) -> Callable[[], ir.Model]:
        return lambda: mpgraph.convert(load(), preset, emulate=emulate)

    def step(name: str, **kwargs: object) -> Callable[[], ir.Model]:
        if kwargs == {"optimizer": "adamw"}:
            return lambda: _adamw_step(name)
        return lambda: mpgraph.build_training_graph(_zoo(name, True), **kwargs)

    def adamw_step_copy(name: str) -> onnx.ModelProto:
        # convert rewrites its input in place; the cached step graph must stay as built.
        return onnx.load_from_string(_adamw_step_bytes(name))

    for name in ZOO:
        for preset in PRESETS:
            for emulate in (False, True):
                yield f"convert/{name}/{preset}/{'emulated' if emulate else 'native'}", convert(
                    functools.partial(_zoo, name, False), preset, emulate
                )
    for path in _light_models():
        for preset in PRESETS:
            for emulate in (False, True) if preset in LOW_PRESETS else (False,):
                yield f"convert/{path.stem}/{preset}/{'emulated' if emulate else 'native'}", convert(
                    functools.partial(onnx.load, str(path)), preset, emulate
                )
    for name in ZOO:
        for optimizer in OPTIMIZERS:
            yield f"step/{name}/{optimizer or 'grad'}", step(name, optimizer=optimizer)
        for suffix, kwargs in STEP_VARIANTS:
            yield f"step/{name}/{suffix}", step(name, **kwargs)
        yield f"step/{name}/adamw-freeze", step(name, optimizer="adamw", freeze=["*bias*"])
        for preset in PRESETS:
            for emulate in (False, True) if preset in LOW_PRESETS else (False,):
                yield f"step/{name}/adamw/{preset}/{'emulated' if emulate else 'native'}", convert(
                    functools.partial(adamw_step_copy, name), preset, emulate
                )


def compute(only: Callable[[str], bool] = lambda case: True) -> dict[str, str]:
    """sha256 of every case's bytes (or the first line of its error, so refusals are pinned too)."""
    out: dict[str, str] = {}
    # The range check's float32 run is shared by every float16-family case of one model.
    with shared_range_checks():
        for case, build in cases():
            if not only(case):
                continue
            try:
                out[case] = _digest(build())
            except Exception as e:  # noqa: BLE001 - a refusal is behaviour too, and is pinned
                out[case] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def load() -> dict[str, str]:
    return json.loads(PINS.read_text())


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    old = load() if PINS.exists() else {}
    if argv[:1] == ["--check"]:
        words = argv[1:]
        got = compute(lambda case: not words or any(w in case for w in words))
        bad = sorted(k for k in got if old.get(k) != got[k])
        for case in bad:
            print(f"changed: {case}")
        print(f"{len(got)} cases checked, {len(bad)} changed")
        return 1 if bad else 0
    new = compute()
    changed = sorted(k for k in new if old.get(k) != new[k])
    for case in changed:
        print(f"{'changed' if case in old else 'new'}: {case}")
    for case in sorted(set(old) - set(new)):
        print(f"gone: {case}")
    PINS.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    print(f"{len(new)} cases, {len(changed)} changed; wrote {PINS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
