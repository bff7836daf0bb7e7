"""The model zoo: small PyTorch models that cover the op families mpgraph must handle.

``ZOO`` maps a name to a ``ZooEntry`` (constructor, example input shape without the batch
dimension, loss kind). Every entry is exported twice by ``models/build_zoo.py`` into
``models/onnx/``: ``<name>.onnx`` (output ``logits``) and ``<name>.loss.onnx`` (outputs
``loss`` and ``logits``, extra input ``label``). All modules are exported in train mode, so
the resnet's BatchNorm normalises with batch statistics: it is
``BatchNormalization(training_mode=1)``, which ONNX Runtime's CPU provider runs and its CUDA
provider (1.31) refuses; see ``mpgraph.export``.

========  =====================================================================  =============
name      what                                                                   loss
========  =====================================================================  =============
tiny_mlp  4-64-64-2, ReLU                                                         cross_entropy
wide_mlp  1024-1024-1024-10, ReLU                                                 cross_entropy
dqn_cnn   Nature DQN: 4x84x84, conv 8x8/4 32, 4x4/2 64, 3x3/1 64, fc 512, 18 out  mse
gpt       vocab 64, seq 16, d_model 64, 4 heads, 2 pre-LN blocks, GELU MLP        cross_entropy
resnet    3x32x32, stem + 3 basic blocks with BatchNorm, global avg pool, 10 out  cross_entropy
========  =====================================================================  =============

The DQN's outputs are Q-values, not class scores, so its loss is a mean squared error
against a float target of shape ``[batch, 18]``. The gpt loss is next-token cross entropy:
its ``label`` holds int64 tokens shaped like the input, ``label[b, t]`` being the token
that follows ``tokens[b, t]``; the loss is the mean over all ``batch * 16`` positions.

Example:
    >>> entry = ZOO["tiny_mlp"]
    >>> entry.input_shape, entry.loss
    ((4,), 'cross_entropy')
    >>> tuple(entry.build()(entry.example_input(3)).shape)
    (3, 2)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import onnx
import torch
from torch import nn
from torch.nn import functional

from mpgraph.export import LossKind, export_module

__all__ = [
    "ZOO",
    "ZooEntry",
    "TinyMLP",
    "WideMLP",
    "NatureDQN",
    "GPT",
    "ResNet",
    "export_zoo_model",
    "zoo_filename",
]

GPT_VOCAB = 64
GPT_SEQ = 16


class TinyMLP(nn.Module):
    """4-64-64-2 with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class WideMLP(nn.Module):
    """1024 inputs, two hidden layers of 1024 (ReLU), 10 classes."""

    def __init__(self, width: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class NatureDQN(nn.Module):
    """The Nature DQN (Mnih et al. 2015) Q-network for 4 stacked 84x84 frames, 18 actions."""

    def __init__(self, actions: int = 18) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 32, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, stride=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 512)
        self.fc2 = nn.Linear(512, actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with explicit matmuls and softmax."""

    causal: torch.Tensor

    def __init__(self, d_model: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, seq, d_model = x.shape
        head_dim = d_model // self.heads
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.reshape(-1, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        scores = scores.masked_fill(~self.causal[:seq, :seq], float("-inf"))
        y = torch.matmul(functional.softmax(scores, dim=-1), v)
        return self.proj(y.transpose(1, 2).reshape(-1, seq, d_model))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then a 4x GELU MLP, both residual."""

    def __init__(self, d_model: int, heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: token + learned position embeddings, pre-LN blocks, final LayerNorm."""

    def __init__(
        self,
        vocab: int = GPT_VOCAB,
        seq: int = GPT_SEQ,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + BatchNorm, identity or 1x1 projection shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR-style ResNet: 3x32x32 in, stem, 3 basic blocks, global avg pool, 10 out."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.layer3 = BasicBlock(32, 64, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.pool(x).flatten(1))


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model.

    Attributes:
        constructor: Builds the module (call ``build`` for seeded weights).
        input_shape: The example input's shape without the batch dimension.
        loss: The loss kind of the ``.loss.onnx`` variant (see ``mpgraph.export``).
        vocab: For token models, the vocabulary size: the input is int64 tokens in
            ``[0, vocab)``. ``None``: the input is float32.
    """

    constructor: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    loss: LossKind
    vocab: int | None = None

    def build(self, seed: int = 0) -> nn.Module:
        """The module with weights drawn from ``seed``, in train mode; global RNG untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.constructor().train()

    def example_input(self, batch: int, seed: int = 0) -> torch.Tensor:
        """A deterministic input batch."""
        generator = torch.Generator().manual_seed(seed)
        shape = (batch, *self.input_shape)
        if self.vocab is not None:
            return torch.randint(0, self.vocab, shape, generator=generator)
        return torch.randn(shape, generator=generator)

    def example_label(self, batch: int, seed: int = 0) -> torch.Tensor:
        """A deterministic label batch for the loss variant."""
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            logits = self.build()(self.example_input(batch))
        if self.loss == "cross_entropy":
            classes = logits.shape[-1]
            return torch.randint(0, classes, logits.shape[:-1], generator=generator)
        return torch.randn(logits.shape, generator=generator)


ZOO: dict[str, ZooEntry] = {
    "tiny_mlp": ZooEntry(TinyMLP, (4,), "cross_entropy"),
    "wide_mlp": ZooEntry(WideMLP, (1024,), "cross_entropy"),
    "dqn_cnn": ZooEntry(NatureDQN, (4, 84, 84), "mse"),
    "gpt": ZooEntry(GPT, (GPT_SEQ,), "cross_entropy", vocab=GPT_VOCAB),
    "resnet": ZooEntry(ResNet, (3, 32, 32), "cross_entropy"),
}

_EXPORT_BATCH = 2
_EXPORT_SEED = 0


def zoo_filename(name: str, with_loss: bool) -> str:
    """``<name>.onnx`` or ``<name>.loss.onnx``."""
    return f"{name}.loss.onnx" if with_loss else f"{name}.onnx"


def export_zoo_model(
    name: str, with_loss: bool, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """Exports zoo model ``name`` with seed-0 weights, deterministically.

    Args:
        name: A key of ``ZOO``.
        with_loss: Add the entry's loss (input ``label``, output ``loss``).
        path: Where to write the model (atomically); ``None`` only returns it.

    Returns:
        The model, as ``models/build_zoo.py`` writes it.
    """
    entry = ZOO[name]
    module = entry.build(_EXPORT_SEED)
    example = entry.example_input(_EXPORT_BATCH, _EXPORT_SEED)
    return export_module(module, example, path, loss=entry.loss if with_loss else None)
