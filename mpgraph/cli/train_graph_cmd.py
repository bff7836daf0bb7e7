"""``mpgraph train-graph``: forward model in, one training-step graph out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mpgraph.cli.paths import output_path
from mpgraph.errors import MpgraphError

__all__ = ["train_graph_command"]


def train_graph_command(
    model: Annotated[Path, typer.Argument(help="Forward .onnx model.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", parser=output_path, metavar="PATH", help="Output path; default IN.train.onnx.")] = None,
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd, adam or adamw.")] = "adamw",
    loss: Annotated[str | None, typer.Option("--loss", help="cross_entropy, mse, or the name of a loss output (default: the output named 'loss', else the only output when it is a float scalar).")] = None,
    freeze: Annotated[list[str] | None, typer.Option("--freeze", help="fnmatch pattern of parameters to keep fixed (repeatable).")] = None,
    params: Annotated[list[str] | None, typer.Option("--params", help="fnmatch pattern of float initializers to train (repeatable); given, nothing is inferred. Default: graph inputs with initializers, else what torch's dynamo exporter marks as parameters, else every float initializer of rank >= 1.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Default learning rate (the graph input 'lr' overrides it per step).")] = None,
    momentum: Annotated[float | None, typer.Option("--momentum", help="SGD momentum.")] = None,
    nesterov: Annotated[bool, typer.Option("--nesterov", help="SGD Nesterov momentum.")] = False,
    weight_decay: Annotated[float | None, typer.Option("--weight-decay", help="Weight decay (L2 for sgd/adam, decoupled for adamw).")] = None,
    amsgrad: Annotated[bool, typer.Option("--amsgrad", help="Adam/AdamW: divide by the running maximum of the second moment.")] = False,
    batchnorm: Annotated[str, typer.Option("--batchnorm", help="train (batch statistics as a BatchNormalization node: fastest on ORT CPU), train-ops (the same as explicit ops: needed on ORT CUDA) or eval.")] = "train",
    overwrite_input: Annotated[bool, typer.Option("--overwrite-input", help="Allow -o to name the input file.")] = False,
    flat_optimizer: Annotated[bool, typer.Option("--flat-optimizer", help="Update all float32 parameters as one flat buffer (a constant optimizer node count; slower on ORT CUDA for large models today, see docs/performance.md).")] = False,
    target: Annotated[str, typer.Option("--target", help="cpu or cuda: where the step will run; picks the conv weight-gradient forms that measured fastest there (same math).")] = "cpu",
    canonical_ops: Annotated[bool | None, typer.Option("--canonical-ops/--no-canonical-ops", help="By default written-out GELU (erf, tanh), LayerNorm and RMSNorm become the standard ONNX ops Gelu, LayerNormalization, RMSNormalization before differentiating (opset raised to 20 or 23 as they need), and with --target cuda attention becomes Attention (cuDNN's fused attention on CUDA); --canonical-ops rewrites attention for any target; --no-canonical-ops rewrites nothing.")] = None,
) -> None:
    """Build the training step of MODEL: forward, backward and optimizer in one ONNX graph."""
    from mpgraph.cli.checks import check_output_path, finite
    from mpgraph.io import load_model, save_model
    from mpgraph.training import (
        build_training_graph,
        optimizer_options,
        refuse_step_graph,
        state_pairs,
        training_batchnorms,
    )

    if lr is not None:
        finite(lr, "--lr", low=0.0)
    if weight_decay is not None:
        finite(weight_decay, "--weight-decay", low=0.0)
    if momentum is not None:
        finite(momentum, "--momentum", low=0.0, high=1.0)
    out = output or model.with_suffix(".train.onnx")
    if out.resolve() == model.resolve() and not overwrite_input:
        raise MpgraphError(f"{out}: refusing to overwrite the input model (pass --overwrite-input)")
    check_output_path(out, "-o")
    forward = load_model(model, ordered=True)
    refuse_step_graph(forward, model)
    options = optimizer_options(optimizer, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                amsgrad=amsgrad, flat=flat_optimizer)
    step = build_training_graph(
        forward, optimizer=optimizer, loss=loss, freeze=freeze or (), params=params or (), lr=lr,
        optimizer_options=options, batchnorm=batchnorm, target=target, canonicalize=canonical_ops,
    )
    save_model(step, out)
    typer.echo(f"{out}: {len(step.graph)} nodes, {len(state_pairs(step))} state inputs paired with updated outputs "
               f"(parameters, optimizer state, running statistics), optimizer {optimizer}")
    batchnorms = training_batchnorms(step)
    if batchnorms:
        # ORT's CUDA provider refuses BatchNormalization(training_mode=1) at opset >= 14.
        typer.echo(f"note: {batchnorms} BatchNormalization nodes in training mode run on ORT CPU only; "
                   "for CUDA build with --batchnorm train-ops")
