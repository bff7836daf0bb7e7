"""``plan_session``: a step graph in, what one ORT session runs out (the lowering's one door).

The runtime calls nothing else of this package. A plan is made in three steps:

1. With ``PlanOptions.shapes``, the graph is specialised to those input shapes first
   (``specialize.specialize_shapes``: shape arithmetic folds away, which CUDA graph capture
   needs). Specialising must come before the rules: a fused op has no ONNX shape inference, so
   a ``Shape`` read after one cannot fold (the bench GPT kept 17 of them when lowered first).
2. The kernel library is chosen (``PlanOptions.kernels``): ``True`` builds it or fails;
   ``None`` builds it where it can and otherwise keeps the rules that need none
   (``kernels_reason`` says why); ``False`` runs no kernel rule.
3. The registered rules for the provider and scope run in ``RULES`` order, then, for a
   deterministic CUDA session, the deterministic rules.

An evaluation session's plan (``PlanOptions.forward_of``) is the forward part of the graph
instead (``forward.forward_part``; on CUDA its ``Attention`` nodes written out first): the
runtime cuts no graph either.

Each session graph is lowered exactly once: a CUDA trainer has two (the graph for any batch
shape and the one specialised to its batch for CUDA graph capture), each planned once.

Example:
    >>> from mpgraph.training import build_training_graph
    >>> step = build_training_graph("models/onnx/tiny_mlp.loss.onnx", optimizer="adamw")
    >>> plan = plan_session(step, "cpu", PlanOptions(kernels=True))
    >>> plan.kernels_fused, [name for name, n in plan.applied if n]
    (6, ['adamw', 'adam_scalars', 'cross_entropy', 'relu_grad', 'pointwise'])
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mpgraph.io import ModelLike, as_model
from mpgraph.lowering.build import KernelBuildError, build_library
from mpgraph.lowering.forward import forward_part
from mpgraph.lowering.match import is_op
from mpgraph.lowering.registry import RULES, SCOPES, Target
from mpgraph.lowering.specialize import specialize_shapes

__all__ = ["PlanOptions", "SessionPlan", "has_sdpa", "library", "library_facts", "lower", "plan_session"]

logger = logging.getLogger(__name__)


@functools.cache
def library(provider: str) -> Path:
    """The kernel library for ``provider`` (``cpu`` or ``cuda``), built on first use.

    Raises:
        KernelBuildError: It cannot be built here.
    """
    path = build_library(cuda=provider == "cuda")
    lib = ctypes.CDLL(str(path))
    if provider == "cuda" and not lib.MpgraphKernelsHaveCuda():
        raise KernelBuildError(f"{path} was built without CUDA kernels")
    return path


@functools.cache
def has_sdpa(path: str | None) -> bool:
    """Whether the library at ``path`` has the CUDA fused attention (an older one, without the
    ``MpgraphKernelsHaveSdpa`` symbol, has not)."""
    if path is None:
        return False
    return bool(getattr(ctypes.CDLL(path), "MpgraphKernelsHaveSdpa", lambda: 0)())


@functools.cache
def has_gemm_bias(path: str | None) -> bool:
    """Whether the library at ``path`` has the CUDA ``GemmBias`` (cuBLASLt's bias epilogue)."""
    if path is None:
        return False
    return bool(getattr(ctypes.CDLL(path), "MpgraphKernelsHaveGemmBias", lambda: 0)())


def library_facts(cuda: bool) -> dict[str, Any]:
    """What ``plan_session`` would load for ``cuda`` (building it first where the cache lacks it):
    the path, whether it is prebuilt (``$MPGRAPH_CUDA_LIBRARY``), its CUDA kernels, the fused
    attention and GemmBias (each with why not), and whether GemmBias runs on CUDA.

    Raises:
        KernelBuildError: No compiler here, or it failed, or the variable names no file.
    """
    from mpgraph.lowering.build import PREBUILT, cublaslt_flags, cudnn_flags, prebuilt_library
    from mpgraph.lowering.gemm_bias import gemm_bias_on_cuda

    prebuilt = prebuilt_library(cuda)
    path = prebuilt if prebuilt is not None else build_library(cuda)
    facts: dict[str, Any] = {"path": str(path), "bytes": path.stat().st_size,
                             "prebuilt": f"${PREBUILT[cuda]}" if prebuilt is not None else None,
                             "cuda_kernels": bool(ctypes.CDLL(str(path)).MpgraphKernelsHaveCuda())}
    if cuda:
        facts["fused_attention"] = has_sdpa(str(path))
        facts["gemm_bias"] = has_gemm_bias(str(path))
        facts["gemm_bias_runs"] = facts["gemm_bias"] and gemm_bias_on_cuda()
        if not facts["fused_attention"]:
            facts["fused_attention_why_not"] = _why_not_built(cudnn_flags, prebuilt is not None)
        if not facts["gemm_bias"]:
            facts["gemm_bias_why_not"] = _why_not_built(cublaslt_flags, prebuilt is not None)
    return facts


def _why_not_built(flags: Any, prebuilt: bool) -> str:
    """Why the CUDA library lacks what ``flags`` (``build.cudnn_flags`` or ``cublaslt_flags``)
    compiles in: the headers or libraries this machine lacks, or, for a ``prebuilt`` library
    (``$MPGRAPH_CUDA_LIBRARY``), that it was built without it."""
    return (flags()[1] if not prebuilt else "") or "built without it"


@dataclass(frozen=True)
class PlanOptions:
    """What a session plan is asked for."""

    #: ``True``: every kernel rule (the library must build); ``None``: the provider's default;
    #: ``False``: none.
    kernels: bool | None = None
    #: Add the deterministic rules (CUDA only: ORT CPU's adds are in order already).
    deterministic: bool = False
    #: Data input name -> fixed shape: specialise the graph first.
    shapes: Mapping[str, Sequence[int]] | None = None
    #: ORT CPU's NCHWc channel block here (0: none); measured by the runtime's probe.
    nchwc_block: int = 0
    #: A ``lower`` scope instead of the one ``kernels`` picks (``native`` needs no library).
    scope: str | None = None
    #: Plan an evaluation session instead: the forward part computing this value (the
    #: contract's logits) as float32, no kernel rule (``forward.forward_part``).
    forward_of: str | None = None


@dataclass(frozen=True)
class SessionPlan:
    """One session's graph and what its session must load."""

    graph: bytes  # the serialized ONNX model the session loads
    provider: str
    custom_ops: str | None  # the kernel library to register (None: none)
    scope: str | None  # the kernel scope that ran (None: no kernel rule)
    kernels_reason: str  # why less than the provider's default ran ("" when it all did)
    applied: tuple[tuple[str, int], ...] = field(default=())  # (rule, rewrites), in order
    #: Why the training session's Attentions run unfused on CUDA ("" when none does).
    attention_reason: str = ""

    @property
    def unfused_attention(self) -> int:
        """The training session's Attentions written out as ORT's ops on CUDA (the scores
        materialised): where the kernel library has no fused attention (``attention_reason``)."""
        return dict(self.applied).get("attention_expand", 0) if self.attention_reason else 0

    @property
    def kernels_fused(self) -> int:
        """Rewrites made by the kernel rules (the deterministic ones not counted)."""
        return sum(n for name, n in self.applied if not _deterministic(name))

    @property
    def deterministic_rewrites(self) -> int:
        return sum(n for name, n in self.applied if _deterministic(name))


def _deterministic(name: str) -> bool:
    return any(r.name == name and r.scope == "deterministic" for r in RULES)


def _kernels(provider: str, options: PlanOptions) -> tuple[str | None, str | None, str]:
    """The kernel library to load (``None``: none), the scope to run (``None``: none) and,
    when less than the provider's default runs, why."""
    if options.scope is not None:
        if options.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {options.scope!r}")
        return (None if options.scope == "native" else str(library(provider))), options.scope, ""
    if options.kernels is False:
        return None, None, "kernels=False"
    scope = "all" if options.kernels else "default"
    try:
        return str(library(provider)), scope, ""
    except KernelBuildError as e:
        if options.kernels:
            raise
        logger.warning("mpgraph kernels off: %s", e)
        # The rules onto ORT's own ops need no library (CPU: the blocked convolutions; CUDA: an
        # Attention as standard ops, so no node is left to the CPU provider).
        return None, "native", str(e)


def _apply(model: ir.Model, target: Target, deterministic: bool) -> list[tuple[str, int]]:
    applied = []
    for rule in RULES:
        if rule.runs(target.provider, target.scope) or (
                deterministic and rule.scope == "deterministic" and target.provider in rule.providers):
            applied.append((rule.name, rule.apply(model, target)))
    return applied


def lower(model: ir.Model, provider: str = "cpu", scope: str = "all", *, nchwc_block: int = 0) -> int:
    """Rewrite ``model`` in place with the registered rules ``scope`` runs on ``provider``
    (``registry.RULES``; ``nchwc_block`` is ORT CPU's channel block, 0: no NCHWc rewrite); how
    many rewrites they made."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    return sum(n for _, n in _apply(model, Target(provider, scope, nchwc_block), False))


def plan_session(step_graph: ModelLike, provider: str, options: PlanOptions = PlanOptions()) -> SessionPlan:
    """The graph one session on ``provider`` runs, lowered as ``options`` ask (see the module).

    ``step_graph`` itself is never changed.

    Raises:
        KernelBuildError: ``kernels=True`` and the library cannot be built.
        MpgraphError: ``shapes`` names no graph input or contradicts a static dim.
    """
    if options.forward_of is not None:
        return _forward_plan(step_graph, provider, options.forward_of)
    custom_ops, scope, reason = _kernels(provider, options)
    deterministic = options.deterministic and provider == "cuda"
    model: ir.Model | None = None
    if options.shapes is not None:
        model = specialize_shapes(as_model(step_graph), options.shapes)
    applied: list[tuple[str, int]] = []
    wide = 0
    if scope is not None or deterministic:
        model = model or as_model(step_graph, copy=True)
        target = Target(provider, scope or "", options.nchwc_block, sdpa=has_sdpa(custom_ops),
                        gemm_bias=has_gemm_bias(custom_ops))
        wide = _float32_attentions(model) if provider == "cuda" else 0
        applied = _apply(model, target, deterministic)
    if model is not None:
        graph = ir.to_proto(model).SerializeToString()
    elif isinstance(step_graph, bytes):
        graph = step_graph
    else:
        graph = ir.to_proto(as_model(step_graph)).SerializeToString()
    unfused = dict(applied).get("attention_expand", 0) if provider == "cuda" else 0
    low = unfused - min(unfused, wide) if unfused else 0  # float16/bfloat16 ones: the fused kernel's types
    why = ("" if not unfused else _FLOAT32_ATTENTION if not low
           else "the fused attention does not take their form (mask, layout or type)"
           if has_sdpa(custom_ops) else _no_fused_attention(custom_ops, reason))
    if low:
        _warn_once(f"{low} Attention(s) run unfused on CUDA, their scores written out (about 2x the "
                   f"step time and memory on GPT-2 small): {why}; `mpgraph kernels` says what the library has")
    elif unfused:
        logger.info("%d float32 Attention(s) run unfused on CUDA: %s", unfused, why)
    return SessionPlan(graph, provider, custom_ops, scope, reason, tuple(applied), why)


#: Why a float32 step's Attentions are written out on CUDA whatever the library holds.
_FLOAT32_ATTENTION = "float32 attention (cuDNN's fused attention takes float16 and bfloat16)"


def _float32_attentions(model: ir.Model) -> int:
    """The standard ``Attention`` nodes whose Q is float32 (none of them the fused rule takes on CUDA)."""
    return sum(1 for n in model.graph if is_op(n, "Attention")
               and n.inputs and n.inputs[0] is not None and n.inputs[0].dtype == ir.DataType.FLOAT)


def _no_fused_attention(custom_ops: str | None, reason: str) -> str:
    """Why a CUDA plan has no fused attention: no library (``reason``), or one built without it."""
    if custom_ops is None:
        return f"no kernel library ({reason or 'kernels off'})"
    from mpgraph.lowering.build import cudnn_flags, prebuilt_library

    return f"the kernel library has no fused attention ({_why_not_built(cudnn_flags, prebuilt_library(True) is not None)})"


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _forward_plan(step_graph: ModelLike, provider: str, target: str) -> SessionPlan:
    """The evaluation session's plan: the forward part computing ``target``. On CUDA an
    ``Attention`` is first written out as its function body (``attention_expand``, no library),
    on the step graph, whose values still carry their types: ORT's CUDA provider lacks many of
    Attention's configurations, and its CPU provider has no bfloat16 Attention to fall back to."""
    applied: tuple[tuple[str, int], ...] = ()
    if provider == "cuda":
        model = as_model(step_graph, copy=True)
        rule = next(r for r in RULES if r.name == "attention_expand")
        applied = ((rule.name, rule.apply(model, Target(provider, "native"))),)
        step_graph = model
    graph = ir.to_proto(forward_part(step_graph, target)).SerializeToString()
    return SessionPlan(graph, provider, None, None, "", applied)
