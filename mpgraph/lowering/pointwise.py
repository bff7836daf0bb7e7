"""Run each chain of elementwise ops the other rules left as one ``Pointwise`` kernel.

The symptom: a bf16 training step keeps its residual stream in float32, so around every fused
op sit small elementwise kernels, each writing and re-reading a whole activation (GPT-2 small,
batch 8, T 1024: 25 MB a float32 [8, 1024, 768]): ``Add(x, Cast(gemm_out, float))`` per
residual, ``Cast(LayerNorm_out, bfloat16)`` before each GEMM, the backward's
``Sum(g, Cast(dx, float))`` gradient accumulations, bias adds, products with constants.

The rewrite, applied last (after every other rule, so it takes what they left)::

    x_f32 ─┐                           x_f32 ─┐
    y_bf16 ─Cast(f32)─Add─┬─ r_f32      y_bf16 ─┼─ Pointwise ─┬─ r_f32
                          └─Cast(bf16)─ c_bf16   ...           └─ c_bf16

1. **Members.** An ONNX ``Cast`` between float32/float16/bfloat16, ``Add``, ``Sub``, ``Mul``,
   ``Neg``, a two-input ``Sum`` (any float type), and in float32 only ``Div``,
   ``Sqrt``, ``Reciprocal`` and a ``Sum`` of up to eight inputs, whose output has a static
   shape S and whose inputs each have shape S, or are one element (a scalar), or a vector
   along S's last axis (a bias: ``[N]`` or ``[1, ..., N]``); and a ``Reshape`` keeping the
   element count and the last dim (a view: no instruction, the same register). A group's
   members share the element count and the last dim.
2. **Groups.** In graph order a member joins the groups of its producers, merging them, when
   no input from outside their union is computed from it (the group stays convex: no path
   leaves it and comes back); else the first producer's group it may join alone; else it starts
   a group. Groups with fewer than two computing members are left alone, as are groups beyond
   the kernel's limits (``MAX_INPUTS`` inputs, ``MAX_OUTPUTS`` outputs,
   ``MAX_PROGRAM`` instructions, ``MAX_REGISTERS`` registers).
3. **Outputs.** Each group value read outside the group (or a graph output) is an output of
   the fused node, in its own dtype; a member Reshape read outside stays in the graph as a
   view of the fused node's output of its input.
4. **Program.** The group's nodes in order, one instruction each (a Sum one per addition), as
   a string attribute ``program``: ``op dst a b t`` separated by ``;``, registers 0.. holding
   the inputs, ``t`` the ONNX dtype the op's output rounds to (1: float32, none), registers
   reused once dead; ``outputs``: ``reg:d0,d1,...`` per output.

Exactness: **bit-identical**. The kernel loads each input as float32 (exact), computes each op
in float32 and rounds to the op's output dtype after it (round to nearest even), which is what
ORT's kernels compute: a float32 op is the same IEEE operation, and a bf16/fp16 add, subtract or
multiply in float32 rounded once equals the correctly rounded low-precision op (float32 has more
than 2p + 2 bits, so the double rounding is innocuous). Low-precision ``Div``/``Sqrt`` and
``Sum`` of more than two inputs (ORT's CPU and CUDA kernels do not round those alike) and every
transcendental op (ORT's Exp, Tanh and Erf are not libm's) are left alone. On ORT CPU only
float32 ops and Casts join (``low=False``): it has no bfloat16 kernels, and runs a float16 op in
float32 behind Casts it inserts, then removes the Cast pairs, so a float16 Mul there is not
rounded to float16 (measured: a float16 LayerNorm output's product differed in the loss by
2.7e-5 relative); on CUDA the ops run natively and round.

Measured (CPU-only, the byte counting of a census of every node's inputs and outputs) on the
full bf16 CUDA plans at batch 8, T 1024, shapes specialised, every other CUDA rule applied
first: HF GPT-2 small (torchscript export) 49 Pointwise kernels replace 125 nodes (24 residual
``Add(x, Cast(.))``, 23 ``Sum(g, dx) -> Reshape -> Cast(bf16)`` of the backward's residual
gradient, 2 others), 49.90 -> 47.38 GB a step (0.63 GB of it Reshape views, free in ORT);
Llama-style 125M (dynamo export) 25 kernels replace 50 nodes, 40.59 -> 39.38 GB. Left alone,
since no elementwise op is on both sides: the Casts to bf16 right after a LayerNorm or
RMSNorm (GPT-2 0.91 GB, Llama 0.94 + 0.87 GB) and the weight gradients' Casts to float32 before
the multi-tensor AdamW (0.51 GB, 0.60 GB): those belong in the norm and AdamW kernels.

Example:
    >>> import onnx_ir as ir
    >>> f32, bf16 = ir.DataType.FLOAT, ir.DataType.BFLOAT16
    >>> x = ir.Value(name="x", type=ir.TensorType(f32), shape=ir.Shape([2, 4]))
    >>> y = ir.Value(name="y", type=ir.TensorType(bf16), shape=ir.Shape([2, 4]))
    >>> cast = ir.node("Cast", [y], {"to": f32.value}, name="cast")
    >>> add = ir.node("Add", [x, cast.outputs[0]], name="add")
    >>> for v, t in ((cast.outputs[0], f32), (add.outputs[0], f32)):
    ...     v.dtype, v.shape = t, ir.Shape([2, 4])
    >>> add.outputs[0].name = "r"
    >>> model = ir.Model(ir.Graph([x, y], add.outputs, nodes=[cast, add]), ir_version=9)
    >>> fuse_pointwise(model), [n.op_type for n in model.graph]
    (1, ['Pointwise'])
    >>> model.graph.node(0).attributes["program"].as_string()
    'cvt 0 0 -1 1;add 1 1 0 1'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx_ir as ir

from mpgraph._ir.names import NameScope
from mpgraph.lowering.match import DOMAIN

__all__ = ["MAX_INPUTS", "MAX_OUTPUTS", "MAX_PROGRAM", "MAX_REGISTERS", "fuse_pointwise"]

logger = logging.getLogger(__name__)

#: The kernel's limits (``csrc/pointwise.h``).
MAX_INPUTS, MAX_OUTPUTS, MAX_PROGRAM, MAX_REGISTERS = 12, 8, 32, 24

_F32, _F16, _BF16 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16
_FLOATS = (_F32, _F16, _BF16)
#: ONNX op -> the program's op (exact in every float type, or only in float32).
#: (Abs is left out: which zero ORT CUDA's Abs gives for +0.0 is not checked; the kernel has it.)
_ANY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Neg": "neg", "Cast": "cvt", "Sum": "add"}
_F32_ONLY = {"Div": "div", "Sqrt": "sqrt", "Reciprocal": "rcp"}
_UNARY = ("Neg", "Cast", "Sqrt", "Reciprocal")


def _static(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return [int(d) for d in value.shape]  # type: ignore[arg-type]


def _fits(value: ir.Value | None, shape: list[int]) -> bool:
    """``value`` is of shape ``shape``, one element, or a vector along its last axis."""
    dims = _static(value)
    if dims is None or value is None or value.dtype not in _FLOATS:
        return False
    count = _count(dims)
    if dims == shape or count == 1:
        return True
    return len(dims) <= len(shape) and bool(shape) and dims[-1] == shape[-1] and count == shape[-1]


def _count(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _key(shape: list[int]) -> tuple[int, int]:
    """What members of one group share: the element count and the last dim (a bias's length)."""
    return _count(shape), shape[-1] if shape else 1


def _member(node: ir.Node, low: bool) -> tuple[int, int] | None:
    """The group key of ``node`` when it may join a group (rule 1; ``low``: ops computing in
    float16/bfloat16 too), else ``None``."""
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    op, out = node.op_type, node.outputs[0]
    if not low and op not in ("Cast", "Reshape") and out.dtype != _F32:
        return None
    if op == "Reshape":
        source, shape = _static(node.inputs[0]), _static(out)
        if source is None or shape is None or out.dtype not in _FLOATS or _key(source) != _key(shape):
            return None
        return _key(shape)
    if op not in _ANY and not (op in _F32_ONLY and out.dtype == _F32):
        return None
    shape = _static(out)
    if shape is None or out.dtype not in _FLOATS or not node.inputs:
        return None
    if op == "Sum" and not (2 <= len(node.inputs) <= (8 if out.dtype == _F32 else 2)):
        return None
    if op in _UNARY and len(node.inputs) != 1 or op in ("Add", "Sub", "Mul", "Div") and len(node.inputs) != 2:
        return None
    if not all(_fits(v, shape) for v in node.inputs) or not any(_static(v) == shape for v in node.inputs):
        return None
    return _key(shape)


def _data(node: ir.Node) -> list[ir.Value]:
    """The inputs a member computes with (a Reshape's shape is none of them)."""
    inputs = node.inputs[:1] if node.op_type == "Reshape" else node.inputs
    return [v for v in inputs if v is not None]


@dataclass(eq=False)
class _Group:
    nodes: list[ir.Node] = field(default_factory=list)
    made: set[ir.Value] = field(default_factory=set)
    first: int = 0  # graph position of its first node

    def inputs(self) -> list[ir.Value]:
        return list(dict.fromkeys(v for node in self.nodes for v in _data(node) if v not in self.made))

    def computes(self) -> int:
        return sum(1 for node in self.nodes if node.op_type != "Reshape")


def _descends(value: ir.Value, group: _Group, order: dict[ir.Node, int]) -> bool:
    """``value`` is computed from one of ``group``'s values (a backward walk that stops at
    nodes placed before the group's first node)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in group.made:
            return True
        node = v.producer()
        if node is None or node in seen or order.get(node, -1) < group.first:
            continue
        seen.add(node)
        stack.extend(i for i in node.inputs if i is not None)
    return False


def _convex_with(groups: list[_Group], node: ir.Node, order: dict[ir.Node, int]) -> bool:
    """``groups`` (each convex) and ``node`` (after all of them) make one convex group: no
    input from outside the union is computed from it."""
    union = _Group(made=set().union(*(g.made for g in groups)), first=min(g.first for g in groups))
    outside = [v for g in groups for n in g.nodes for v in _data(n) if v not in union.made]
    outside += [v for v in _data(node) if v not in union.made]
    return not any(_descends(v, union, order) for v in dict.fromkeys(outside))


def _groups(graph: ir.Graph, low: bool) -> list[_Group]:
    order = {node: i for i, node in enumerate(graph)}
    key_of: dict[ir.Node, tuple[int, int]] = {}
    group_of: dict[ir.Node, _Group] = {}
    groups: list[_Group] = []
    for node in graph:
        key = _member(node, low)
        if key is None:
            continue
        key_of[node] = key
        near = list(dict.fromkeys(
            group_of[p] for v in _data(node) if (p := v.producer()) in group_of and key_of[p] == key))
        near = [g for g in near if len(g.nodes) < MAX_PROGRAM]
        if len(near) > 1 and _convex_with(near, node, order):  # the producers' groups merge through node
            joined = near[0]
            for other in near[1:]:
                joined.nodes, joined.made = joined.nodes + other.nodes, joined.made | other.made
                joined.first = min(joined.first, other.first)
                for n in other.nodes:
                    group_of[n] = joined
                groups.remove(other)
            joined.nodes.sort(key=order.__getitem__)
        else:
            joined = next((g for g in near if _convex_with([g], node, order)), None)
        if joined is None:
            joined = _Group(first=order[node])
            groups.append(joined)
        joined.nodes.append(node)
        joined.made.add(node.outputs[0])
        group_of[node] = joined
    return [g for g in groups if g.computes() >= 2]


def _outputs(group: _Group, graph_outputs: set[ir.Value]) -> tuple[list[ir.Value], list[ir.Node]]:
    """The group values read outside it (rule 3), and the Reshapes that stay (views of an
    output, read outside): a Reshape's value is its input's, so its input is the output."""
    members = set(group.nodes)
    read_outside = [n for n in group.nodes
                    if n.outputs[0] in graph_outputs or any(u.node not in members for u in n.outputs[0].uses())]
    views = [n for n in read_outside if n.op_type == "Reshape"]
    outputs: dict[ir.Value, None] = {}
    for node in read_outside:
        value = node.outputs[0]
        while value.producer() in members and value.producer().op_type == "Reshape":  # type: ignore[union-attr]
            value = value.producer().inputs[0]  # type: ignore[union-attr,assignment]
        if value in group.made:
            outputs.setdefault(value)
    return list(outputs), views


def _program(group: _Group, inputs: list[ir.Value], outputs: list[ir.Value]) -> tuple[str, str] | None:
    """The group's instructions and output registers with their dims (rule 4), registers
    reused once dead; ``None`` beyond the kernel's limits."""
    last_use: dict[ir.Value, int] = {}
    for i, node in enumerate(group.nodes):
        for v in _data(node):
            last_use[v] = i
    reg = {v: r for r, v in enumerate(inputs)}
    views: dict[ir.Value, ir.Value] = {}  # a Reshape's output -> the value whose register it shares
    free: list[int] = []
    top, code, keep = len(inputs), [], set(outputs)
    for i, node in enumerate(group.nodes):
        out = node.outputs[0]
        if node.op_type == "Reshape":  # a view: the same register, live as long as any view of it
            root = views.get(node.inputs[0], node.inputs[0])  # type: ignore[arg-type]
            views[out], reg[out] = root, reg[root]
            last_use[root] = max(last_use.get(out, i), last_use[root])
            continue
        t = out.dtype.value  # type: ignore[union-attr]
        op = _ANY.get(node.op_type) or _F32_ONLY[node.op_type]
        args = [reg[v] for v in _data(node)]
        roots = dict.fromkeys(views.get(v, v) for v in _data(node))
        dying = [reg[v] for v in roots if last_use.get(v) == i and v not in keep and reg[v] not in free]
        if len(args) <= 2:  # read before written: the result may take a dying operand's register
            free += dying
        dst = free.pop(0) if free else top
        if len(args) > 2:  # a Sum's later operands are read after its first addition is written
            free += dying
        top = max(top, dst + 1)
        if op == "cvt" or len(args) == 1:
            code.append(f"{op} {dst} {args[0]} -1 {t}")
        else:
            acc = args[0]
            for a in args[1:]:  # a Sum adds in its input order, each addition rounded to t
                code.append(f"{op} {dst} {acc} {a} {t}")
                acc = dst
        reg[out] = dst
    if top > MAX_REGISTERS or len(code) > MAX_PROGRAM:
        return None
    return ";".join(code), " ".join(f"{reg[v]}:{','.join(map(str, _static(v) or []))}" for v in outputs)


def _ordered_inputs(group: _Group) -> list[ir.Value]:
    """External inputs, the full-size ones first."""
    inputs = group.inputs()
    count = _count(_static(group.nodes[0].outputs[0]) or [])
    full = [v for v in inputs if _count(_static(v) or []) == count]
    return full + [v for v in inputs if v not in full]


def fuse_pointwise(model: ir.Model, low: bool = True) -> int:
    """Replace each elementwise group of ``model``'s main graph (rules 1-4) with one
    ``Pointwise`` node, in place; how many were made. ``low=False`` leaves out ops computing in
    float16 or bfloat16 (Casts stay members): ORT CPU runs those in float32 behind Casts it
    inserts and then drops, so its results are not the ops' roundings."""
    graph = model.graph
    graph_outputs = set(graph.outputs)
    names = NameScope(graph)
    fused = 0
    for group in _groups(graph, low):
        inputs = _ordered_inputs(group)
        outputs, views = _outputs(group, graph_outputs)
        program = _program(group, inputs, outputs)
        if program is None or len(inputs) > MAX_INPUTS or not 1 <= len(outputs) <= MAX_OUTPUTS:
            logger.debug("pointwise: left a group of %d nodes at %s (beyond the kernel's limits)",
                         len(group.nodes), group.nodes[0].name)
            continue
        last = group.nodes[-1]
        node = ir.node("Pointwise", inputs, {"program": program[0], "outputs": program[1]}, domain=DOMAIN,
                       num_outputs=len(outputs), name=names.fresh(f"{last.name}/Pointwise"),
                       metadata_props=dict(last.metadata_props))
        graph.insert_after(last, node)
        for old, new in zip(outputs, node.outputs):
            new.shape, new.type = old.shape, old.type
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            name, old.name = old.name, None
            new.name = name
        gone = [n for n in group.nodes if n not in views]
        for view in views:  # the kept Reshapes read the fused outputs; the group's readers of them go
            for use in list(view.outputs[0].uses()):
                if use.node in gone:
                    use.node.replace_input_with(use.idx, None)
        graph.remove(gone, safe=True)
        fused += 1
    if fused:
        model.opset_imports.setdefault(DOMAIN, 1)
        graph.sort()  # an early output's readers may sit before the group's last node
    return fused
