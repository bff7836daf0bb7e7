"""Export a PyTorch module to an ONNX model that mpgraph can compile and train.

The exported model follows one contract that the rest of mpgraph relies on:

1. Data inputs come first (named after the parameters of ``module.forward``), then the
   optional ``label``, then one graph input per parameter, named exactly as
   ``module.named_parameters()`` names it (``fc1.weight``; the dots stay).
2. Every parameter input has an fp32 initializer of the same name holding the parameter's
   current value, so the file runs standalone in ONNX Runtime and a training graph can read
   the initial weights. Graph inputs backed by an initializer are the trainable parameters;
   initializers that are not graph inputs (buffers such as BatchNorm running statistics,
   folded constants) are constants.
3. The batch dimension (dim 0 of every data input, of the label and of the outputs) is the
   symbolic dimension ``batch``.
4. Outputs: ``logits`` without a loss; ``loss`` (a scalar, mean reduction) then ``logits``
   with one.
5. Default-domain opset ``opset`` (18 to 22), IR version 10, no functions, no other domains;
   the model passes ``onnx.checker.check_model(full_check=True)``.

Why the parameters are inputs: the dynamo exporter treats parameters as constants, so its
optimizer folds ``Transpose(weight)`` into a pre-transposed initializer and merges
parameters that happen to hold equal values (two fresh LayerNorm weights become one
tensor). Exporting ``torch.func.functional_call(module, params, inputs)`` with the
parameters as arguments keeps every parameter a distinct, untransformed tensor.

Why BatchNorm needs help: torchlib (onnxscript 0.7) lowers train-mode
``aten._native_batch_norm_legit_functional`` to an *inference* ``BatchNormalization``
(it hard-codes ``training = False``), so a module exported in train mode silently
normalises with its running statistics. ``export_module`` registers its own lowering:

- ``batch_norm="node"`` (default): ``BatchNormalization(training_mode=1)``, fed by the
  running statistics as constants named after their buffers (``bn.running_mean``), so
  ``mpgraph.training`` can carry them as training state. ONNX Runtime's CPU provider
  runs it with batch statistics, exactly as torch does. ONNX Runtime 1.31's CUDA provider
  refuses it when the session is created ("Training mode does not support BN opset 14 (or
  higher) yet"), loudly, never silently; a graph meant for CUDA needs it decomposed.
- ``batch_norm="ops"``: explicit ops over the batch statistics (``ReduceMean``, ``Sub``,
  ``Mul``, ``ReduceMean``, ``Add(eps)``, ``Sqrt``, ``Reciprocal``, ``Mul``, then the affine
  ``Mul``/``Add``), which every provider runs (checked on CPU and on CUDA, 2e-7 from
  torch); the running statistics are dropped.

The exported forward graph never updates running statistics (it has no outputs for
them). An eval-mode BatchNorm is an inference ``BatchNormalization`` over the running
statistics.

The exporter is ``torch.onnx.export(dynamo=True)`` (``torch.export`` in non-strict mode,
then torchlib and the onnxscript optimizer). The legacy TorchScript exporter is not used.
Output is deterministic: exporting the same module with the same values twice gives the
same bytes (node metadata such as source stack traces, which embed file paths, is dropped).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import onnx
import onnx_ir as ir

from mpgraph.errors import ExportError, MpgraphError, first_line
from mpgraph.export_batchnorm import batch_norm_translation
from mpgraph.export_contract import (
    BATCH_DIM,
    LABEL_NAME,
    LOGITS_NAME,
    LOSS_NAME,
    finish_export,
    validate_export,
)
from mpgraph.io import save_model

if TYPE_CHECKING:
    import torch

__all__ = [
    "ExportError",
    "LossKind",
    "BatchNormLowering",
    "LOSS_KINDS",
    "BATCH_DIM",
    "LABEL_NAME",
    "LOGITS_NAME",
    "LOSS_NAME",
    "export_module",
    "export_file",
]

logger = logging.getLogger(__name__)

LossKind = Literal["cross_entropy", "mse"]
BatchNormLowering = Literal["ops", "node"]
LOSS_KINDS: tuple[str, ...] = ("cross_entropy", "mse")

_MIN_OPSET = 18
_MAX_OPSET = 22  # opset 23 needs IR version 11; we promise IR <= 10 (export_contract.IR_VERSION).


def export_module(
    module: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    path: str | os.PathLike[str] | None = None,
    *,
    loss: LossKind | None = None,
    label_shape: Sequence[int] | None = None,
    dynamic_batch: bool = True,
    opset: int = 18,
    input_names: Sequence[str] | None = None,
    batch_norm: BatchNormLowering = "node",
) -> onnx.ModelProto:
    """Export ``module`` to ONNX with its parameters as explicit, initialised graph inputs.

    The module is exported in its current mode: a module in train mode gives a graph with
    train-mode semantics (BatchNorm normalises with batch statistics), one in eval mode an
    inference graph. The module and its buffers are not modified.

    Args:
        module: The module. ``forward`` takes tensors and returns one tensor, the logits
            (class scores in the last dimension).
        example_inputs: One tensor or a sequence of tensors passed to ``forward``. Their
            shapes fix every dimension of the graph except the batch dimension.
        path: Where to write the model (atomically, one file, no external data). ``None``
            only returns it.
        loss: ``None``; ``"cross_entropy"`` (adds an int64 ``label`` input of class indices
            shaped like the logits without their last dimension; logits with more than two
            dimensions, such as a language model's ``[batch, seq, vocab]``, are flattened to
            ``[-1, classes]`` first); or ``"mse"`` (a float ``label`` shaped like the logits).
            The loss is the mean over all elements and becomes output ``loss``.
        label_shape: The label's shape without the batch dimension; defaults to the shape
            implied by ``loss`` as described above.
        dynamic_batch: Make dim 0 of inputs, label and outputs the symbolic dim ``batch``.
            Needs an example batch of at least 2 (torch specialises sizes 0 and 1).
        opset: Default-domain opset, 18 to 22.
        input_names: Names of the data inputs; defaults to the names of ``forward``'s
            parameters.
        batch_norm: How a train-mode BatchNorm is written: ``"node"``
            (``BatchNormalization(training_mode=1)``; ORT's CUDA provider refuses it) or
            ``"ops"`` (ReduceMean, Sub, Mul, Sqrt, Reciprocal, Add; runs everywhere, drops
            the running statistics). Eval-mode BatchNorm is always an inference
            ``BatchNormalization``.

    Returns:
        The model: IR version 10, checked with ``onnx.checker.check_model(full_check=True)``.

    Raises:
        ExportError: A bad argument, or torch cannot export the module.
        ModelSaveError: ``path`` cannot be written.
    """
    torch = _import_torch()
    _check_arguments(torch, module, loss, batch_norm, opset)
    inputs = _as_tensor_tuple(torch, example_inputs)
    names = _data_input_names(module, len(inputs), input_names)
    if dynamic_batch:
        _check_batch_sizes(names, inputs)
    params, buffers = _named_state(module, names)
    param_values = tuple(p.detach().to(torch.float32) for p in params.values())
    buffer_values = tuple(b.detach() for b in buffers.values())
    logits = _example_logits(torch, module, buffers, inputs)
    label: tuple[Any, ...] = ()
    if loss is not None:
        label = (_example_label(torch, loss, logits, label_shape),)

    wrapper = _make_wrapper(torch, module, len(inputs), list(params), list(buffers), loss)
    args = (*inputs, *label, *param_values, *buffer_values)
    data_names = [*names, *([LABEL_NAME] if label else [])]
    output_names = [LOSS_NAME, LOGITS_NAME] if loss else [LOGITS_NAME]
    dynamic = _dynamic_shapes(torch, len(args), len(data_names), dynamic_batch)
    arg_names = [*data_names, *params, *buffers]
    model = _torch_export(torch, wrapper, args, arg_names, output_names, dynamic, opset, batch_norm)
    finish_export(model, params, buffers, dynamic_batch)
    proto = ir.serde.serialize_model(model)
    validate_export(proto, [*data_names, *params], output_names, dynamic_batch, len(data_names), model)
    logger.debug("exported %s: %d nodes", type(module).__name__, len(proto.graph.node))
    if path is not None:
        save_model(model, path, external_data=False)
    return proto


def _check_arguments(torch: Any, module: Any, loss: str | None, batch_norm: str, opset: int) -> None:
    if loss is not None and loss not in LOSS_KINDS:
        raise ExportError(f"unknown loss {loss!r}; valid choices: {', '.join(LOSS_KINDS)}")
    if batch_norm not in ("ops", "node"):
        raise ExportError(f"unknown batch_norm {batch_norm!r}; valid choices: ops, node")
    if not _MIN_OPSET <= opset <= _MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported; use {_MIN_OPSET} to {_MAX_OPSET}")
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"expected a torch.nn.Module, got {type(module).__name__}")


def _check_batch_sizes(names: list[str], inputs: tuple[Any, ...]) -> None:
    """A dynamic batch needs an example batch of at least 2: torch specialises 0 and 1."""
    for name, tensor in zip(names, inputs, strict=True):
        if tensor.dim() == 0 or tensor.shape[0] < 2:
            raise ExportError(
                f"input {name!r} needs a batch dimension of size >= 2 to export a dynamic"
                f" batch; got shape {tuple(tensor.shape)}"
            )


def _named_state(module: Any, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The module's parameters and buffers by name; no name may clash with a graph input or
    output, and every parameter is a float."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    taken = [*names, LABEL_NAME, LOGITS_NAME, LOSS_NAME]
    clash = sorted(set(taken) & (set(params) | set(buffers)))
    if clash or len(set(names)) != len(names):
        raise ExportError(f"input, parameter or buffer names collide: {clash or names}")
    for name, param in params.items():
        if not param.dtype.is_floating_point:
            raise ExportError(f"parameter {name!r} has dtype {param.dtype}; expected a float")
    return params, buffers


def _example_logits(torch: Any, module: Any, buffers: dict[str, Any], inputs: tuple[Any, ...]) -> Any:
    """``forward`` on the example inputs, which must give one tensor (the logits)."""
    # Cloned buffers: a train-mode forward must not update the module's running statistics.
    state = {name: buffer.clone() for name, buffer in buffers.items()}
    try:
        with torch.no_grad():
            logits = torch.func.functional_call(module, state, inputs)
    except Exception as e:
        raise ExportError(f"forward fails on the example inputs: {first_line(e)}") from e
    if not isinstance(logits, torch.Tensor):
        raise ExportError(
            f"forward must return one tensor (the logits); got {type(logits).__name__}"
        )
    return logits


def _dynamic_shapes(torch: Any, num_args: int, num_batched: int, dynamic_batch: bool) -> list[dict[int, Any] | None]:
    """torch.export's dynamic shape per argument: dim 0 of the data inputs and label is ``batch``."""
    dynamic: list[dict[int, Any] | None] = [None] * num_args
    if dynamic_batch:
        batch = torch.export.Dim(BATCH_DIM)
        for i in range(num_batched):
            dynamic[i] = {0: batch}
    return dynamic


def export_file(
    target: str,
    inputs: Sequence[tuple[Sequence[int], str]],
    path: str | os.PathLike[str],
    *,
    loss: LossKind | None = None,
    train: bool = True,
    opset: int = 18,
    seed: int = 0,
) -> onnx.ModelProto:
    """Export the module class ``FILE.py:ClassName`` names (what ``mpgraph export`` runs).

    FILE.py is imported, so its code runs with your permissions: export only code you trust.
    The class is constructed without arguments after ``torch.manual_seed(seed)``, put in
    train or eval mode, and exported with ``export_module`` on example inputs drawn next:
    ``randn`` for ``float32``, zeros for ``int64``. Any failure of the user's code,
    ``sys.exit`` included, becomes one ``ExportError`` line.

    Args:
        target: ``path/to/model.py:Net``.
        inputs: ``(shape, dtype)`` per data input, batch first; dtype ``float32`` or ``int64``.
        path: Where to write the model.
        loss: As ``export_module``.
        train: Export train-mode behaviour (BatchNorm batch statistics) or eval mode.
        opset: Default-domain opset, 18 to 22.
        seed: ``torch.manual_seed`` before constructing the module.

    Returns:
        The written model.

    Raises:
        ExportError: The file, the class, its construction or its export fails.
    """
    torch = _import_torch()
    cls = _load_module_class(target)
    if not issubclass(cls, torch.nn.Module):
        raise ExportError(f"{target}: '{cls.__name__}' is not a torch.nn.Module subclass")
    torch.manual_seed(seed)
    module = _user_code("constructing the module", target, cls)
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"{target}: constructing it gave a {type(module).__name__}, not a torch.nn.Module")
    module.train(train)
    examples = [torch.zeros(list(shape), dtype=torch.int64) if dtype == "int64" else torch.randn(list(shape))
                for shape, dtype in inputs]
    return _user_code("exporting (running forward)", target,
                      lambda: export_module(module, examples, path, loss=loss, opset=opset))


def _load_module_class(target: str) -> type:
    """``path/to/model.py:Net`` -> the class ``Net`` defined in that file."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise ExportError(f"{target}: expected FILE.py:ClassName")
    path = Path(path_text)
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"mpgraph_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ExportError(f"{path}: cannot import as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise ExportError(f"{path}: importing it called sys.exit({e.code!r}); the file must define the class "
                          "without running a program (guard it with if __name__ == '__main__')") from None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        raise ExportError(f"{path}: importing it failed: {type(e).__name__}: {first_line(e)}") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ExportError(f"{path}: defines no class '{name}'")
    return cls


def _user_code(what: str, target: str, call: Callable[[], Any]) -> Any:
    """Run user code (a constructor, an export that runs ``forward``): any failure, including
    ``sys.exit``, becomes one line."""
    try:
        return call()
    except MpgraphError:
        raise
    except SystemExit as e:
        raise ExportError(f"{target}: {what} called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        raise ExportError(f"{target}: {what} failed: {type(e).__name__}: {first_line(e)}") from e


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ExportError(
            "exporting needs PyTorch; install it with `pip install mpgraph[torch]`"
        ) from e
    return torch


def _as_tensor_tuple(torch: Any, example_inputs: Any) -> tuple[Any, ...]:
    items = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    try:
        items = tuple(items)
    except TypeError:
        items = (example_inputs,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ExportError("example_inputs must be a tensor or a non-empty sequence of tensors")
    return items


def _data_input_names(module: Any, count: int, input_names: Sequence[str] | None) -> list[str]:
    if input_names is not None:
        names = list(input_names)
        if len(names) != count:
            raise ExportError(f"got {len(names)} input names for {count} example inputs")
        return names
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        signature = inspect.signature(module.forward)
        names = [p.name for p in signature.parameters.values() if p.kind in kinds]
    except (TypeError, ValueError):
        names = []
    if len(names) < count:
        return ["input"] if count == 1 else [f"input{i}" for i in range(count)]
    return names[:count]


def _example_label(torch: Any, loss: str, logits: Any, label_shape: Sequence[int] | None) -> Any:
    batch = logits.shape[0]
    generator = torch.Generator().manual_seed(0)
    if loss == "cross_entropy":
        if logits.dim() < 2:
            raise ExportError(
                f"cross_entropy needs logits of rank >= 2; got shape {tuple(logits.shape)}"
            )
        shape = tuple(label_shape) if label_shape is not None else tuple(logits.shape[1:-1])
        classes = int(logits.shape[-1])
        return torch.randint(0, classes, (batch, *shape), generator=generator)
    shape = tuple(label_shape) if label_shape is not None else tuple(logits.shape[1:])
    return torch.randn((batch, *shape), generator=generator, dtype=logits.dtype)


def _make_wrapper(
    torch: Any,
    module: Any,
    num_inputs: int,
    param_names: list[str],
    buffer_names: list[str],
    loss: str | None,
) -> Any:
    """Builds the module torch exports: data, label, parameters and buffers in; loss, logits out.

    Buffers are arguments too, so the exporter's optimizer cannot fold or merge them (two
    fresh BatchNorms hold equal running statistics); ``finish_export`` turns them back into
    constants. They are cloned before use because a train-mode forward updates running
    statistics in place, and torch.export refuses to mutate a user input.
    """
    functional_call = torch.func.functional_call
    functional = torch.nn.functional
    num_params = len(param_names)
    has_label = loss is not None

    class Wrapper(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            # Not a registered submodule: its own parameters would become dead initializers.
            self.__dict__["inner"] = module
            # Not self.train(): that would reset the modes of the user's submodules.
            self.training = module.training

        def forward(self, *args: Any) -> Any:
            inputs = args[:num_inputs]
            label: Any = args[num_inputs] if has_label else None
            rest = args[num_inputs + int(has_label) :]
            state = dict(zip(param_names, rest[:num_params], strict=True))
            state.update(
                (n, b.clone()) for n, b in zip(buffer_names, rest[num_params:], strict=True)
            )
            logits = functional_call(self.inner, state, tuple(inputs))
            if loss is None:
                return logits
            if loss == "cross_entropy":
                classes = logits.shape[-1]
                value = functional.cross_entropy(logits.reshape(-1, classes), label.reshape(-1))
            else:
                value = functional.mse_loss(logits, label)
            return value, logits

    return Wrapper()


def _torch_export(
    torch: Any,
    wrapper: Any,
    args: tuple[Any, ...],
    arg_names: list[str],
    output_names: list[str],
    dynamic: list[dict[int, Any] | None],
    opset: int,
    batch_norm: str,
) -> ir.Model:
    # torch.onnx prints progress, warns about train mode and logs about torchvision, and a
    # failing torch.export prints the traced graph to stderr; the library stays quiet (a
    # failure becomes an ExportError).
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        _quiet_torch(),
    ):
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(
                wrapper, args, dynamic_shapes=(tuple(dynamic),), strict=False
            )
        except Exception as e:
            raise ExportError(f"torch.export failed: {first_line(e)}") from e
        try:
            onnx_program = torch.onnx.export(
                program,
                (),
                dynamo=True,
                input_names=arg_names,
                output_names=output_names,
                opset_version=opset,
                custom_translation_table=batch_norm_translation(torch, batch_norm),
                optimize=True,
                verbose=False,
            )
        except Exception as e:
            raise ExportError(f"torch.onnx.export failed: {first_line(e)}") from e
    return onnx_program.model


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    names = ("torch", "torch.onnx", "torch.export", "torch.fx", "torch._dynamo")
    quiet = [logging.getLogger(name) for name in names]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
