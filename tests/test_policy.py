"""The policy loader and the presets in rules/.

Error cases are one table: each row is a policy file and what its error must say -- the file,
the line, the key path, and the bad value and valid choices where there are any.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx_ir as ir
import pytest

from mpgraph.errors import MpgraphError, PolicyError
from mpgraph.policy import CATEGORIES, Policy, list_presets, load_policy, parse_policy, preset_path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "policies.md"

# preset -> (dtype, default category, loss-scaling mode, initial scale)
PRESETS = {
    "fp32": (ir.DataType.FLOAT, "deny", "none", 65536.0),
    "tf32": (ir.DataType.FLOAT, "deny", "none", 65536.0),
    "fp16": (ir.DataType.FLOAT16, "deny", "dynamic", 65536.0),
    "bf16": (ir.DataType.BFLOAT16, "deny", "none", 65536.0),
    "torch-autocast": (ir.DataType.FLOAT16, "infer", "dynamic", 65536.0),
    "tf-amp": (ir.DataType.FLOAT16, "deny", "dynamic", 32768.0),
}

# Parity presets: every reason starts by naming the framework list its category comes from.
REASON_PREFIXES: dict[str, dict[str, tuple[str, ...]]] = {
    "torch-autocast": {
        "allow": ("autocast lower_precision_fp list",),
        "deny": ("autocast fp32",),
        "infer": ("on no autocast list", "autocast promote list"),
        "clear": ("on no autocast list",),
    },
    "tf-amp": {
        "allow": ("AllowList",),
        "infer": ("InferList",),
        "clear": ("ClearList",),
        "deny": ("DenyList",),
    },
}

# (preset, op type, category): the mapping decisions a reviewer should not see flip silently.
PARITY = [
    ("torch-autocast", "MatMul", "allow"),
    ("torch-autocast", "PRelu", "allow"),
    ("torch-autocast", "LSTM", "allow"),
    ("torch-autocast", "Attention", "allow"),
    ("torch-autocast", "Softmax", "deny"),
    ("torch-autocast", "ReduceSum", "deny"),
    ("torch-autocast", "RMSNormalization", "deny"),
    ("torch-autocast", "Resize", "deny"),
    ("torch-autocast", "ReduceMean", "infer"),
    ("torch-autocast", "BatchNormalization", "infer"),
    ("torch-autocast", "Concat", "infer"),
    ("torch-autocast", "ScatterND", "infer"),
    ("torch-autocast", "Reshape", "clear"),
    ("torch-autocast", "Sin", "infer"),  # unlisted -> default infer
    ("tf-amp", "MatMul", "allow"),
    ("tf-amp", "Einsum", "allow"),
    ("tf-amp", "Softmax", "infer"),
    ("tf-amp", "LogSoftmax", "infer"),
    ("tf-amp", "Log", "infer"),
    ("tf-amp", "BatchNormalization", "infer"),
    ("tf-amp", "Sum", "infer"),  # ONNX Sum is TF's AddN
    ("tf-amp", "ReduceSum", "deny"),  # TF's Sum
    ("tf-amp", "ReduceMean", "deny"),
    ("tf-amp", "Exp", "deny"),
    ("tf-amp", "Pow", "deny"),
    ("tf-amp", "SoftmaxCrossEntropyLoss", "deny"),
    ("tf-amp", "Relu", "clear"),
    ("tf-amp", "Concat", "clear"),
    ("tf-amp", "Sin", "deny"),  # unlisted -> default deny
]

DTYPES = "valid: float16, fp16, half, bfloat16, bf16, float32, fp32, float"
TOP_KEYS = (
    "valid: name, extends, description, dtype, default, ops, overrides, pins, keep_io_types, "
    "initializers, loss_scaling"
)
LOSS_KEYS = "valid: mode, init, growth_interval, growth_factor, backoff_factor, min, max"

# id -> (policy text, line, key path or None for YAML syntax errors, fragments of the message)
ERRORS: dict[str, tuple[str, int, str | None, list[str]]] = {
    "invalid_yaml": (
        "dtype: float16\nops: {allow: [MatMul}\n",
        2, None, ["invalid YAML", "expected ',' or ']'"],
    ),
    "invalid_yaml_tab": (
        "dtype: float16\n\tops: {}\n",
        2, None, ["invalid YAML", "'\\t'"],
    ),
    "unknown_yaml_tag": (
        "name: x\ndtype: !half float16\n",
        2, None, ["invalid YAML", "'!half'"],
    ),
    "not_a_mapping": (
        "- MatMul\n- Conv\n",
        1, "<top>", ["a policy is a YAML mapping with keys name, extends"],
    ),
    "duplicate_key": (
        "dtype: float16\ndtype: bfloat16\n",
        2, "dtype", ["duplicate key"],
    ),
    "unknown_top_key": (
        "dtype: float16\nopz:\n  allow: [MatMul]\n",
        2, "opz", ["unknown key (did you mean 'ops'?)", TOP_KEYS],
    ),
    "bad_dtype": (
        "name: x\ndtype: float8\n",
        2, "dtype", ["invalid value 'float8'", DTYPES],
    ),
    "missing_dtype": (
        "name: x\n",
        1, "dtype", ["missing required key", DTYPES],
    ),
    "bad_default": (
        "dtype: float16\ndefault: allowed\n",
        2, "default", ["invalid value 'allowed' (did you mean 'allow'?)", "valid: allow, infer, clear, deny"],
    ),
    "unknown_op_type": (
        "dtype: float16\nops:\n  allow:\n    MatMull: typo\n",
        4, "ops.allow.MatMull", ["unknown op type 'MatMull' (did you mean 'MatMul'?)", "'domain.Op'"],
    ),
    "unknown_op_type_in_list": (
        "dtype: float16\nops:\n  infer: [Add, Relux]\n",
        3, "ops.infer.Relux", ["unknown op type 'Relux' (did you mean 'Relu'?)"],
    ),
    "op_in_two_categories": (
        "dtype: float16\nops:\n  allow:\n    MatMul: fast\n  deny:\n    MatMul: exact\n",
        6, "ops.deny.MatMul", ["op type listed twice (also in ops.allow)"],
    ),
    "bad_category": (
        "dtype: float16\nops:\n  alow:\n    MatMul: fast\n",
        3, "ops.alow", ["unknown key (did you mean 'allow'?)", "valid: allow, infer, clear, deny"],
    ),
    "category_not_a_mapping": (
        "dtype: float16\nops:\n  allow: MatMul\n",
        3, "ops.allow", ["expected a mapping of op type to reason or a list", "'MatMul'"],
    ),
    "bad_override_precision": (
        "dtype: float16\noverrides:\n  - match: /head/*\n    precision: fp16\n",
        4, "overrides.0.precision", ["invalid value 'fp16'", "valid: low, float32"],
    ),
    "override_unknown_key": (
        "dtype: float16\noverrides:\n  - match: /head/*\n    precision: low\n    why: exact\n",
        5, "overrides.0.why", ["unknown key", "valid: match, precision, reason"],
    ),
    "override_missing_match": (
        "dtype: float16\noverrides:\n  - precision: low\n",
        3, "overrides.0.match", ["missing or non-string node-name pattern"],
    ),
    "overrides_not_a_list": (
        "dtype: float16\noverrides: {match: x, precision: low}\n",
        2, "overrides", ["expected a list of {match, precision, reason}"],
    ),
    "bad_pin_inputs_negative": (
        "dtype: float16\npins:\n  - op: Resize\n    inputs: [1, -2]\n",
        4, "pins.0.inputs", ["invalid value [1, -2]", "expected a list of input indices >= 0"],
    ),
    "bad_pin_inputs_scalar": (
        "dtype: float16\npins:\n  - op: Resize\n    inputs: 1\n",
        4, "pins.0.inputs", ["invalid value 1", "expected a list of input indices >= 0"],
    ),
    "bad_pin_inputs_bool": (
        "dtype: float16\npins:\n  - op: Resize\n    inputs: [true]\n",
        4, "pins.0.inputs", ["invalid value [True]", "expected a list of input indices >= 0"],
    ),
    "pin_unknown_op_type": (
        "dtype: float16\npins:\n  - op: Resise\n    inputs: [1]\n",
        3, "pins.0.op", ["unknown op type 'Resise' (did you mean 'Resize'?)"],
    ),
    "pin_unknown_key": (
        "dtype: float16\npins:\n  - op: Resize\n    slots: [1]\n",
        4, "pins.0.slots", ["unknown key", "valid: op, inputs, reason"],
    ),
    "bad_keep_io_types": (
        "dtype: float16\nkeep_io_types: sometimes\n",
        2, "keep_io_types", ["invalid value 'sometimes'", "expected true, false or a list of names"],
    ),
    "bad_keep_io_types_list": (
        "dtype: float16\nkeep_io_types: [input, 3]\n",
        2, "keep_io_types", ["invalid value ['input', 3]", "expected true, false or a list of names"],
    ),
    "bad_initializers_overflow": (
        "dtype: float16\ninitializers:\n  overflow: saturate\n",
        3, "initializers.overflow", ["invalid value 'saturate'", "valid: keep_fp32, clamp, error"],
    ),
    "bad_initializers_underflow": (
        "dtype: float16\ninitializers:\n  underflow: flush\n",
        3, "initializers.underflow", ["invalid value 'flush'", "valid: keep, keep_fp32, error"],
    ),
    "initializers_unknown_key": (
        "dtype: float16\ninitializers:\n  overflw: clamp\n",
        3, "initializers.overflw", ["unknown key (did you mean 'overflow'?)", "valid: overflow, underflow"],
    ),
    "growth_factor_one": (
        "dtype: float16\nloss_scaling:\n  mode: dynamic\n  growth_factor: 1.0\n",
        4, "loss_scaling.growth_factor", ["invalid value 1.0", "expected > 1"],
    ),
    "growth_factor_below_one": (
        "dtype: float16\nloss_scaling:\n  growth_factor: 0.5\n",
        3, "loss_scaling.growth_factor", ["invalid value 0.5", "expected > 1"],
    ),
    "backoff_factor_one": (
        "dtype: float16\nloss_scaling:\n  backoff_factor: 1\n",
        3, "loss_scaling.backoff_factor", ["invalid value 1.0", "expected in (0, 1)"],
    ),
    "backoff_factor_zero": (
        "dtype: float16\nloss_scaling:\n  backoff_factor: 0\n",
        3, "loss_scaling.backoff_factor", ["invalid value 0.0", "expected in (0, 1)"],
    ),
    "backoff_factor_above_one": (
        "dtype: float16\nloss_scaling:\n  mode: dynamic\n  backoff_factor: 2.0\n",
        4, "loss_scaling.backoff_factor", ["invalid value 2.0", "expected in (0, 1)"],
    ),
    "init_below_min": (
        "dtype: float16\nloss_scaling:\n  min: 4\n  init: 2\n",
        4, "loss_scaling.init", ["invalid value 2.0", "expected within [min, max] = [4.0, 16777216.0]"],
    ),
    "init_above_max": (
        "dtype: float16\nloss_scaling:\n  init: 1e9\n",
        3, "loss_scaling.init", ["invalid value 1000000000.0", "expected within [min, max] = [1.0, 16777216.0]"],
    ),
    "init_not_positive": (
        "dtype: float16\nloss_scaling:\n  init: -1\n",
        3, "loss_scaling.init", ["invalid value -1.0", "expected > 0"],
    ),
    "min_above_max": (
        "dtype: float16\nloss_scaling:\n  min: 10\n  max: 5\n  init: 7\n",
        3, "loss_scaling.min", ["invalid bounds min=10.0, max=5.0", "expected 0 < min <= max"],
    ),
    "loss_scaling_unknown_key": (
        "dtype: float16\nloss_scaling:\n  mode: dynamic\n  grow_factor: 3\n",
        4, "loss_scaling.grow_factor", ["unknown key (did you mean 'growth_factor'?)", LOSS_KEYS],
    ),
    "loss_scaling_bad_mode": (
        "dtype: float16\nloss_scaling:\n  mode: dynamik\n",
        3, "loss_scaling.mode", ["invalid value 'dynamik' (did you mean 'dynamic'?)", "valid: none, static, dynamic"],
    ),
    "loss_scaling_not_a_number": (
        "dtype: float16\nloss_scaling:\n  init: lots\n",
        3, "loss_scaling.init", ["invalid value 'lots'", "expected a number"],
    ),
    "loss_scaling_bool_is_not_a_number": (
        "dtype: float16\nloss_scaling:\n  max: true\n",
        3, "loss_scaling.max", ["invalid value True", "expected a number"],
    ),
    "growth_interval_not_integer": (
        "dtype: float16\nloss_scaling:\n  growth_interval: 2.5\n",
        3, "loss_scaling.growth_interval", ["invalid value 2.5", "expected an integer"],
    ),
    "growth_interval_zero": (
        "dtype: float16\nloss_scaling:\n  growth_interval: 0\n",
        3, "loss_scaling.growth_interval", ["invalid value 0", "expected an integer >= 1"],
    ),
    "loss_scaling_not_a_mapping": (
        "dtype: float16\nloss_scaling: dynamic\n",
        2, "loss_scaling", ["expected a mapping with keys mode, init", "got 'dynamic'"],
    ),
    "extends_unknown_preset": (
        "extends: bf17\n",
        1, "extends", ["unknown preset 'bf17' (did you mean 'bf16'?)", "(or a path ending in .yaml)"],
    ),
    "extends_not_a_string": (
        "extends: [fp16, bf16]\n",
        1, "extends", ["invalid value ['fp16', 'bf16']", "expected a preset name or path"],
    ),
    "extends_missing_file": (
        "extends: missing.yaml\n",
        1, "extends", ["policy file not found", "missing.yaml"],
    ),
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path.resolve()


def _override_precision(policy: Policy, node_name: str) -> str | None:
    override = policy.override_for(node_name)
    return override.precision if override else None


# --- presets -------------------------------------------------------------------------------


def test_preset_table_matches_rules_dir() -> None:
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", sorted(set(PRESETS) | set(list_presets())))
def test_preset_loads_with_a_reason_for_every_op(name: str) -> None:
    policy = load_policy(name)
    assert policy.name == name
    assert policy.description, "every preset explains itself"
    assert all(category in CATEGORIES for category, _ in policy.ops.values())
    missing = [op for op, (_, reason) in policy.ops.items() if not reason.strip()]
    assert not missing, f"{name}: ops without a reason: {missing}"
    multiline = [op for op, (_, reason) in policy.ops.items() if "\n" in reason]
    assert not multiline, f"{name}: reasons must be one line: {multiline}"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_settings(name: str) -> None:
    dtype, default, mode, init = PRESETS[name]
    policy = load_policy(name)
    assert policy.dtype == dtype
    assert policy.default_category == default
    assert policy.loss_scaling.mode == mode
    assert policy.loss_scaling.init == init
    assert (policy.loss_scaling.growth_interval, policy.loss_scaling.growth_factor) == (2000, 2.0)
    assert policy.loss_scaling.backoff_factor == 0.5
    assert policy.keep_io_types is True
    assert policy.is_identity == (name in ("fp32", "tf32"))


def test_fp32_lists_no_ops() -> None:
    assert dict(load_policy("fp32").ops) == {}


@pytest.mark.parametrize("name", sorted(REASON_PREFIXES))
def test_parity_reasons_name_their_list(name: str) -> None:
    prefixes = REASON_PREFIXES[name]
    wrong = {
        op: (category, reason)
        for op, (category, reason) in load_policy(name).ops.items()
        if not reason.startswith(prefixes[category])
    }
    assert not wrong


@pytest.mark.parametrize(("name", "op_type", "category"), PARITY, ids=[f"{p}-{o}" for p, o, _ in PARITY])
def test_parity_mapping(name: str, op_type: str, category: str) -> None:
    assert load_policy(name).category(op_type)[0] == category


@pytest.mark.parametrize("name", sorted(REASON_PREFIXES))
def test_parity_presets_pin_batchnorm_parameters(name: str) -> None:
    assert load_policy(name).pinned_slots("BatchNormalization").keys() == {1, 2, 3, 4}


def test_load_policy_accepts_path_and_policy() -> None:
    by_name = load_policy("fp16")
    assert load_policy(preset_path("fp16")) == by_name
    assert load_policy(str(preset_path("fp16"))) == by_name
    assert load_policy(by_name) is by_name


# --- extends -------------------------------------------------------------------------------


def test_bf16_extends_fp16() -> None:
    fp16, bf16 = load_policy("fp16"), load_policy("bf16")
    assert bf16.dtype == ir.DataType.BFLOAT16
    # Presets carry numerics only: which ops a provider has no bfloat16 kernel for is the
    # target's business (mpgraph.targets, tests/test_targets.py), so bf16's lists are fp16's.
    assert {op: category for op, (category, _) in bf16.ops.items()} == {op: category for op, (category, _) in fp16.ops.items()}
    assert not any("no bfloat16 kernel" in why for _, why in bf16.ops.values())
    assert bf16.pins == fp16.pins
    assert bf16.default_category == fp16.default_category
    assert bf16.initializers == fp16.initializers
    assert bf16.loss_scaling.mode == "none"
    # Keys bf16 does not set in loss_scaling keep fp16's values.
    assert bf16.loss_scaling.max == fp16.loss_scaling.max
    assert bf16.description != fp16.description


def test_bf16_reasons_are_its_own() -> None:
    """``policy show bf16`` and the audit of a bf16 model say why in bfloat16's terms: no reason
    speaks of fp16's range (overflow above 65504, -inf logs), which bfloat16 does not share."""
    bf16 = load_policy("bf16")
    assert not {op: why for op, (_, why) in bf16.ops.items() if re.search(r"fp16|float16", why)}
    assert "bf16" in bf16.ops["ReduceSum"][1] and "28%" in bf16.ops["Exp"][1]


def test_extends_merges_and_overrides(tmp_path: Path) -> None:
    base = _write(
        tmp_path,
        "base.yaml",
        "dtype: bf16\n"
        "ops:\n  allow: {MatMul: fast}\n  deny: {Softmax: exact}\n"
        "overrides:\n  - {match: '/head/*', precision: float32, reason: head}\n"
        "pins:\n  - {op: Resize, inputs: [1]}\n"
        "loss_scaling: {mode: dynamic, init: 1024}\n",
    )
    (tmp_path / "sub").mkdir()
    child = _write(
        tmp_path,
        "sub/child.yaml",
        "extends: ../base.yaml\n"
        "ops:\n  infer: {Softmax: bf16 has fp32's range}\n  clear: [Reshape]\n"
        "overrides:\n  - {match: '/head/out', precision: low}\n"
        "pins:\n  - {op: Upsample, inputs: [1]}\n"
        "loss_scaling: {growth_interval: 100}\n",
    )
    policy = load_policy(child)
    assert policy.name == "child"
    assert policy.dtype == ir.DataType.BFLOAT16
    assert dict(policy.ops) == {"MatMul": ("allow", "fast"), "Softmax": ("infer", "bf16 has fp32's range"), "Reshape": ("clear", "")}
    assert _override_precision(policy, "/head/out") == "low"  # the child's override wins
    assert _override_precision(policy, "/head/fc") == "float32"
    assert _override_precision(policy, "/body/fc") is None
    assert [p.op_type for p in policy.pins] == ["Resize", "Upsample"]
    assert (policy.loss_scaling.mode, policy.loss_scaling.init, policy.loss_scaling.growth_interval) == ("dynamic", 1024.0, 100)
    assert load_policy(base).loss_scaling.growth_interval == 2000


@pytest.mark.parametrize("files", [("a.yaml", "b.yaml"), ("self.yaml",)], ids=["two-files", "self"])
def test_extends_cycle(tmp_path: Path, files: tuple[str, ...]) -> None:
    paths = [(tmp_path / f).resolve() for f in files]
    for path, parent in zip(paths, [*paths[1:], paths[0]], strict=True):
        path.write_text(f"extends: {parent.name}\ndtype: float16\n", encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(paths[0])
    cycle = " -> ".join(str(p) for p in [*paths, paths[0]])
    assert str(info.value) == f"{paths[-1]}:1: extends: cycle {cycle}"


def test_docs_example_policy_loads(tmp_path: Path) -> None:
    text = DOCS.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/policies.md has an example policy"
    policy = load_policy(_write(tmp_path, "example.yaml", blocks[0]))
    assert policy.dtype == ir.DataType.BFLOAT16
    assert policy.category("Softmax")[0] == "infer"
    assert policy.category("MatMul")[0] == "allow"
    assert _override_precision(policy, "/head/fc/Gemm") == "float32"
    assert policy.loss_scaling.mode == "static"


def test_docs_list_every_preset() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in text for name in PRESETS)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_error(tmp_path: Path, case: str) -> None:
    text, line, keypath, fragments = ERRORS[case]
    path = _write(tmp_path, "mine.yaml", text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    prefix = f"{path}:{line}: " + ("invalid YAML: " if keypath is None else f"{keypath}: ")
    assert message.startswith(prefix), message
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message


def test_errors_are_mpgraph_errors() -> None:
    assert issubclass(PolicyError, MpgraphError)


def test_parse_policy_names_the_given_path() -> None:
    with pytest.raises(PolicyError, match=r"^policies/mine\.yaml:2: dtype: invalid value 'fp8'"):
        parse_policy("name: x\ndtype: fp8\n", "policies/mine.yaml")


def test_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "empty.yaml", "")
    with pytest.raises(PolicyError, match=r"a policy is a YAML mapping"):
        load_policy(path)


def test_unknown_preset() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy("bf17")
    message = str(info.value)
    assert message.startswith("unknown preset 'bf17' (did you mean 'bf16'?); ")
    assert f"valid presets: {', '.join(list_presets())}" in message
    for name in PRESETS:
        assert name in message


def test_missing_file(tmp_path: Path) -> None:
    path = (tmp_path / "nope.yaml").resolve()
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == f"{path}: policy file not found"


def test_number_spellings(tmp_path: Path) -> None:
    # YAML 1.2 spellings that PyYAML (YAML 1.1) would leave as strings.
    path = _write(tmp_path, "n.yaml", "dtype: float16\nloss_scaling: {init: 1e3, max: 1.0e6, min: .5}\n")
    loss = load_policy(path).loss_scaling
    assert (loss.init, loss.max, loss.min) == (1000.0, 1e6, 0.5)


def test_list_form_and_null_reason() -> None:
    policy = parse_policy("dtype: fp16\nops:\n  allow: [MatMul, Gemm]\n  deny:\n    Softmax:\n")
    assert dict(policy.ops) == {"MatMul": ("allow", ""), "Gemm": ("allow", ""), "Softmax": ("deny", "")}


def test_other_domain_op_types_are_not_checked() -> None:
    policy = parse_policy("dtype: fp16\nops:\n  allow: {com.microsoft.FusedMatMul: contrib op}\n")
    assert policy.category("FusedMatMul", "com.microsoft") == ("allow", "contrib op")
    assert policy.category("FusedMatMul")[0] == "deny"


def test_tf32_preset_differs_from_fp32_only_in_the_tf32_flag(tmp_path):
    """tf32 lowers nothing (the graph equals fp32's) and records the runtime flag; fp32 says strict."""
    import mpgraph
    from mpgraph._ir import meta as md

    src = Path(__file__).resolve().parents[1] / "models" / "onnx" / "tiny_mlp.loss.onnx"
    strict, loose = mpgraph.convert(str(src), "fp32"), mpgraph.convert(str(src), "tf32")
    assert strict.metadata_props[md.MODEL_TF32] == "false"
    assert loose.metadata_props[md.MODEL_TF32] == "true"
    assert load_policy("tf32").tf32 and not load_policy("fp32").tf32 and not load_policy("bf16").tf32
    for m in (strict, loose):
        del m.metadata_props[md.MODEL_TF32]
        del m.metadata_props[md.MODEL_POLICY]
    assert ir.to_proto(strict).SerializeToString() == ir.to_proto(loose).SerializeToString()


def test_tf32_must_be_a_bool(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nextends: fp32\ntf32: yes please\n")
    with pytest.raises(PolicyError, match="tf32"):
        load_policy(str(path))
