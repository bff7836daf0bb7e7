"""``mpgraph train-graph``: forward model in, one training-step graph out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mpgraph.errors import MpgraphError

__all__ = ["register", "train_graph_command"]


def train_graph_command(
    model: Annotated[Path, typer.Argument(help="Forward .onnx model.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output path; default IN.train.onnx.")] = None,
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd, adam or adamw.")] = "adamw",
    loss: Annotated[str | None, typer.Option("--loss", help="cross_entropy, mse, or the name of a loss output (default: the output named 'loss', else the only output when it is a float scalar).")] = None,
    freeze: Annotated[list[str] | None, typer.Option("--freeze", help="fnmatch pattern of parameters to keep fixed (repeatable).")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Default learning rate (the graph input 'lr' overrides it per step).")] = None,
    momentum: Annotated[float | None, typer.Option("--momentum", help="SGD momentum.")] = None,
    nesterov: Annotated[bool, typer.Option("--nesterov", help="SGD Nesterov momentum.")] = False,
    weight_decay: Annotated[float | None, typer.Option("--weight-decay", help="Weight decay (L2 for sgd/adam, decoupled for adamw).")] = None,
    amsgrad: Annotated[bool, typer.Option("--amsgrad", help="Adam/AdamW: divide by the running maximum of the second moment.")] = False,
    batchnorm: Annotated[str, typer.Option("--batchnorm", help="train (batch statistics as a BatchNormalization node: fastest on ORT CPU), train-ops (the same as explicit ops: needed on ORT CUDA) or eval.")] = "train",
    overwrite_input: Annotated[bool, typer.Option("--overwrite-input", help="Allow -o to name the input file.")] = False,
    flat_optimizer: Annotated[bool, typer.Option("--flat-optimizer", help="Update all float32 parameters as one flat buffer (a constant optimizer node count; slower on ORT CUDA for large models today, see docs/performance.md).")] = False,
    target: Annotated[str, typer.Option("--target", help="cpu or cuda: where the step will run; picks the conv weight-gradient forms that measured fastest there (same math).")] = "cpu",
) -> None:
    """Build the training step of MODEL: forward, backward and optimizer in one ONNX graph."""
    from mpgraph._ir import meta as md
    from mpgraph.cli.checks import check_output_path, finite
    from mpgraph.errors import UnsupportedModelError
    from mpgraph.io import load_model, save_model
    from mpgraph.train_graph import build_training_graph, state_pairs

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
    forward = load_model(model)
    if md.MODEL_STATE_PAIRS in forward.metadata_props or forward.metadata_props.get(md.MODEL_TRAINING) == "true":
        raise UnsupportedModelError(f"{model}: is already a training step graph (built by `mpgraph train-graph`); "
                                    "give the forward model")
    options = {"momentum": momentum, "weight_decay": weight_decay}
    if nesterov:
        options["nesterov"] = True
    if optimizer.lower() != "sgd":
        options.pop("momentum")
        if nesterov:
            raise MpgraphError("--nesterov applies to --optimizer sgd only")
    if amsgrad:
        if optimizer.lower() == "sgd":
            raise MpgraphError("--amsgrad applies to --optimizer adam and adamw only")
        options["amsgrad"] = True
    if flat_optimizer:
        options["flat"] = True
    step = build_training_graph(
        forward, optimizer=optimizer, loss=loss, freeze=freeze or (), lr=lr,
        optimizer_options=options, batchnorm=batchnorm, target=target,
    )
    save_model(step, out)
    pairs = state_pairs(step)
    typer.echo(f"{out}: {len(step.graph)} nodes, {len(pairs)} state inputs paired with updated outputs "
               f"(parameters, optimizer state, running statistics), optimizer {optimizer}")
    batchnorms = sum(n.op_type == "BatchNormalization" for n in step.graph)
    if batchnorms and batchnorm == "train":
        # ORT's CUDA provider refuses BatchNormalization(training_mode=1) at opset >= 14.
        typer.echo(f"note: {batchnorms} BatchNormalization nodes in training mode run on ORT CPU only; "
                   "for CUDA build with --batchnorm train-ops")


def register(app: typer.Typer) -> None:
    """Add the ``train-graph`` command to ``app``."""
    command = train_graph_command
    try:  # the shared wrapper turns MpgraphError into one line and exit code 2
        from mpgraph.cli.main import handle_errors

        command = handle_errors(command)
    except ImportError:
        pass
    app.command("train-graph")(command)
