"""What an op's schema says about the types of its inputs and outputs.

The precision passes need, per node, which input and output slots share the op's *compute*
type variable (the ``T`` that ties ``MatMul``'s A, B and Y together) and whether the low dtype is
a legal binding for it in the model's opset. Slots with a fixed type (Resize's ``scales`` is
always ``tensor(float)``) or with an input-only type variable (Pow's exponent ``T1``) keep
their dtype when the node is lowered.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import onnx
import onnx_ir as ir

from mpgraph.dtypes import is_float

__all__ = [
    "NONDETERMINISTIC_OPS",
    "NodeTyping",
    "SHAPE_SLOTS",
    "CONTROL_FLOW_OPS",
    "node_typing",
    "opset_version",
    "type_string",
]

#: Ops whose outputs differ between runs on the same inputs: random generators, and Dropout
#: (random in training mode). Never folded to a constant, never taken for an equal value.
NONDETERMINISTIC_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                                  "Multinomial", "Bernoulli", "Dropout"})

#: Input slots that carry shapes, sizes, indices or coordinates. A float tensor feeding one of
#: them (and everything that computes it) is never lowered.
SHAPE_SLOTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "ConstantOfShape": (0,),
    "Tile": (1,),
    "Pad": (1,),
    "TopK": (1,),
    "OneHot": (1,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "CenterCropPad": (1,),
    "RoiAlign": (1,),
    "GridSample": (1,),
    "AffineGrid": (0, 1),
}

CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})

#: Type variables that an op's function body and ORT's kernels bind to one type although its
#: schema names them apart: Attention's V (``T2``) and a float ``attn_mask`` (``U``) meet Q and
#: K (``T1``) in its MatMul and Add. A lowered Attention with V left float32 passes the checker
#: but ORT refuses it (``Type parameter (T) of Optype (MatMul) bound to different types``).
TIED_VARS: dict[tuple[str, str], frozenset[str]] = {("", "Attention"): frozenset({"T1", "T2", "U"})}

_DTYPE_TYPE_STR = {
    ir.DataType.FLOAT: "tensor(float)",
    ir.DataType.FLOAT16: "tensor(float16)",
    ir.DataType.BFLOAT16: "tensor(bfloat16)",
    ir.DataType.DOUBLE: "tensor(double)",
}


def type_string(dtype: ir.DataType) -> str:
    """ONNX schema spelling of a tensor type: ``tensor(bfloat16)``."""
    return _DTYPE_TYPE_STR.get(dtype, f"tensor({dtype.name.lower()})")


def opset_version(node: ir.Node, opset_imports: dict[str, int]) -> int | None:
    """The opset version a node resolves against."""
    if node.version is not None:
        return node.version
    domain = "" if node.domain == "ai.onnx" else node.domain
    return opset_imports.get(domain)


@functools.lru_cache(maxsize=4096)
def _schema(op_type: str, version: int, domain: str) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


@dataclasses.dataclass(frozen=True)
class NodeTyping:
    """Type facts of one node.

    Attributes:
        schema: The op schema, or ``None`` for ops ONNX does not define.
        input_vars: Type variable of each actual input (``None``: fixed type or unknown).
        output_vars: Type variable of each actual output.
        compute_vars: Type variables bound to a float dtype here that type an output and an
            input, or two inputs (comparisons); lowering the node rebinds exactly these.
        allowed: Type variable -> allowed type strings in this opset.
        bound: Type variable -> the dtype it is bound to in this node.
    """

    schema: onnx.defs.OpSchema | None
    input_vars: tuple[str | None, ...]
    output_vars: tuple[str | None, ...]
    compute_vars: frozenset[str]
    allowed: dict[str, frozenset[str]]
    bound: dict[str, ir.DataType]

    def compute_inputs(self) -> list[int]:
        """Indices of inputs typed by a compute variable."""
        return [i for i, v in enumerate(self.input_vars) if v in self.compute_vars]

    def compute_outputs(self) -> list[int]:
        """Indices of outputs typed by a compute variable."""
        return [i for i, v in enumerate(self.output_vars) if v in self.compute_vars]

    def allows(self, dtype: ir.DataType) -> bool:
        """Whether every compute variable may be bound to ``dtype`` in this opset."""
        want = type_string(dtype)
        return all(want in self.allowed[v] for v in self.compute_vars)


@functools.lru_cache(maxsize=4096)
def _schema_facts(
    op_type: str, version: int, domain: str
) -> tuple[onnx.defs.OpSchema, dict[str, frozenset[str]], tuple, tuple] | None:
    """Schema, allowed types and formal (type_str, variadic) pairs, read once per op schema.

    Reading these through the pybind schema object costs more than the rest of
    ``node_typing``; graphs repeat a few dozen op types thousands of times.
    """
    schema = _schema(op_type, version, domain)
    if schema is None:
        return None
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    ins = tuple((f.type_str, f.option == variadic) for f in schema.inputs)
    outs = tuple((f.type_str, f.option == variadic) for f in schema.outputs)
    return schema, allowed, ins, outs


def _slot_vars(formals: tuple[tuple[str, bool], ...], count: int) -> list[str | None]:
    out: list[str | None] = []
    for i in range(count):
        if i < len(formals):
            out.append(formals[i][0])
        elif formals and formals[-1][1]:
            out.append(formals[-1][0])
        else:
            out.append(None)
    return out


@functools.lru_cache(maxsize=8192)
def _slots(
    op_type: str, version: int, domain: str, n_in: int, n_out: int
) -> tuple[onnx.defs.OpSchema, dict[str, frozenset[str]], tuple, tuple, frozenset[str]] | None:
    """Per (schema, arity): type variable of every input and output slot."""
    facts = _schema_facts(op_type, version, domain)
    if facts is None:
        return None
    schema, allowed, in_formals, out_formals = facts
    in_vars = tuple(s if s in allowed else None for s in _slot_vars(in_formals, n_in))
    out_vars = tuple(s if s in allowed else None for s in _slot_vars(out_formals, n_out))
    return schema, allowed, in_vars, out_vars, frozenset(v for v in in_vars if v is not None)


def node_typing(node: ir.Node, opset_imports: dict[str, int]) -> NodeTyping:
    """Type facts of ``node`` from its schema and the dtypes of its values."""
    version = opset_version(node, opset_imports)
    domain = "" if node.domain == "ai.onnx" else node.domain
    inputs, outputs = node.inputs, node.outputs
    slots = _slots(node.op_type, version, domain, len(inputs), len(outputs)) if version is not None else None
    if slots is None:
        return NodeTyping(None, (None,) * len(inputs), (None,) * len(outputs), frozenset(), {}, {})
    schema, allowed, in_vars, out_vars, input_var_set = slots
    bound: dict[str, ir.DataType] = {}
    for var, value in (*zip(in_vars, inputs), *zip(out_vars, outputs)):
        if var is not None and value is not None and var not in bound:
            dtype = value.dtype
            if dtype is not None and isinstance(value.type, ir.TensorType):
                bound[var] = dtype
    # A variable typing an output and an input, or typing two inputs (a comparison's operands
    # must agree even though its output is bool).
    present = collections.Counter(v for v, x in zip(in_vars, inputs) if v is not None and x is not None)
    shared = [v for v, count in present.items() if count > 1]
    compute = frozenset(
        v for v in (*out_vars, *shared) if v is not None and v in input_var_set and is_float(bound.get(v))
    )
    tied = TIED_VARS.get((domain, node.op_type), frozenset())
    if compute & tied:
        compute |= {v for v in tied if v in input_var_set and is_float(bound.get(v))}
    return NodeTyping(schema, in_vars, out_vars, compute, allowed, bound)
