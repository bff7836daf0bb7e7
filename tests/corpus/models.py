"""Tiny real architectures built from library configs with random weights (nothing downloaded).

Each builder returns a :class:`Case`: a ``torch.nn.Module`` whose forward takes the batch
(inputs and labels) and returns the scalar loss, plus one fixed batch. Configs are tiny (hidden
32-64, small vocabularies and images) so that an export and a step graph take a few seconds;
dropout is off everywhere so torch's train mode is deterministic and matches the exported graph
(BatchNorm still uses batch statistics in train mode, as the step graph does).

Depth is the least a model needs to show each of its patterns once: a transformer layer repeats
the same ops, so the text and ViT models have one (Swin two in its first stage: only the second
shifts its windows), and a second copy would double the graph that every check serializes,
converts and loads into ONNX Runtime without adding an op type or exporter pattern (each
export's op types, and their attributes' kinds, are those of the deeper configs they replace).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BATCH = 2
SEQ = 8
VOCAB = 64
IMAGE = 32


@dataclass(frozen=True)
class Case:
    """A model wrapped so that its only output is the loss, with one batch."""

    name: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]


class LossOnly(torch.nn.Module):
    """Calls a Hugging Face model with keyword inputs and returns ``.loss``."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, args, strict=True))).loss


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(seed: int, shape=(BATCH, SEQ)) -> torch.Tensor:
    # Token 0 is the padding token of BERT, DistilBERT and T5: torch zeroes the gradient of an
    # embedding's padding_idx row by convention, which no exported graph knows about (a Gather
    # has no padding index), so batches leave it out.
    return torch.randint(1, VOCAB, shape, generator=_generator(seed))


def _image(seed: int, channels: int = 3, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=_generator(seed))


def _classes(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, n, (BATCH,), generator=_generator(seed))


def _hf(name: str, model: torch.nn.Module, **batch: torch.Tensor) -> Case:
    keys = tuple(batch)
    return Case(name, LossOnly(model, keys), tuple(batch.values()), keys)


def bert() -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=SEQ * 2, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _hf("bert", BertForSequenceClassification(cfg), input_ids=_tokens(1), labels=_classes(2, 3))


def distilbert() -> Case:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=64,
                           max_position_embeddings=SEQ * 2, num_labels=3, dropout=0.0,
                           attention_dropout=0.0, seq_classif_dropout=0.0)
    return _hf("distilbert", DistilBertForSequenceClassification(cfg), input_ids=_tokens(1), labels=_classes(2, 3))


def llama() -> Case:
    """Rotary embeddings, grouped-query attention (4 query heads over 2 key/value heads), SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
                      attention_dropout=0.0, tie_word_embeddings=False,
                      attn_implementation="eager")
    ids = _tokens(1)
    return _hf("llama", LlamaForCausalLM(cfg), input_ids=ids, labels=ids)


def qwen2() -> Case:
    """Rotary embeddings, grouped-query attention with q/k/v biases, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=SEQ * 2,
                      attention_dropout=0.0, tie_word_embeddings=True,
                      attn_implementation="eager")
    ids = _tokens(1)
    return _hf("qwen2", Qwen2ForCausalLM(cfg), input_ids=ids, labels=ids)


def gpt2() -> Case:
    """Learned positions, Conv1D projections, lm_head tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=32, n_layer=1, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = _tokens(1)
    return _hf("gpt2", GPT2LMHeadModel(cfg), input_ids=ids, labels=ids)


def t5() -> Case:
    """Encoder-decoder with relative position buckets and cross-attention."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return _hf("t5", T5ForConditionalGeneration(cfg), input_ids=_tokens(1), labels=_tokens(2, (BATCH, SEQ // 2)))


def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=4, intermediate_size=64, num_labels=5,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _hf("vit", ViTForImageClassification(cfg), pixel_values=_image(1, size=16), labels=_classes(2, 5))


def swin() -> Case:
    """Shifted windows (Roll, window partition reshapes, attention masks), patch merging."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 1],
                     num_heads=[2, 4], window_size=4, mlp_ratio=2.0, num_labels=5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _hf("swin", SwinForImageClassification(cfg), pixel_values=_image(1), labels=_classes(2, 5))


def resnet() -> Case:
    """Bottleneck blocks with BatchNorm (train mode: batch statistics) and a shortcut projection."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                       layer_type="bottleneck", num_labels=5)
    return _hf("resnet", ResNetForImageClassification(cfg), pixel_values=_image(1), labels=_classes(2, 5))


def convnext() -> Case:
    """Depthwise 7x7 convs, channels-last LayerNorm, GELU, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                         num_labels=5, drop_path_rate=0.0)
    return _hf("convnext", ConvNextForImageClassification(cfg), pixel_values=_image(1), labels=_classes(2, 5))


def mobilenet_v2() -> Case:
    """Inverted residuals, depthwise convs (dilated past stride 8), ReLU6, BatchNorm, and the
    TensorFlow "SAME" padding the TorchScript exporter writes as shape arithmetic before a Pad.

    ``output_stride=8`` keeps the last feature maps at 4x4: at 1x1 (stride 32 on a 32x32
    image) a train-mode BatchNorm over a batch of two sees two values per channel, its
    output is ±1 whatever the input, and every gradient below it is rounding noise.

    The first 8 of its 16 inverted residual blocks, then a new ``conv_1x1`` for their width:
    they hold every block kind (stride 2, residual, and from ``layer[6]`` on dilated), and the
    other 8 repeat them at 46% of the step graph's nodes. With 7 blocks a bias gradient that is
    zero in exact arithmetic is 2.4x further from float64 than torch's and fails the grad check
    (rounding noise against rounding noise, see ``check.GradError``); with 8 the worst such
    ratio is 1.6."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = MobileNetV2Config(num_channels=3, image_size=IMAGE, depth_multiplier=0.25, min_depth=4, finegrained_output=False, output_stride=8,
                            num_labels=5, classifier_dropout_prob=0.0)
    model = MobileNetV2ForImageClassification(cfg)
    body = model.mobilenet_v2
    head = body.conv_1x1
    del body.layer[8:]  # forward() loops over the list, so the rest of the model is unchanged
    body.conv_1x1 = type(head)(cfg, in_channels=body.layer[-1].reduce_1x1.convolution.out_channels,
                               out_channels=head.convolution.out_channels, kernel_size=1)
    body.conv_1x1.apply(model._init_weights)
    return _hf("mobilenet_v2", model, pixel_values=_image(1), labels=_classes(2, 5))


def efficientnet() -> Case:
    """Depthwise convs, SiLU, squeeze-excitation, BatchNorm."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    cfg = EfficientNetConfig(num_channels=3, image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25,
                             hidden_dim=320, num_labels=5, dropout_rate=0.0, drop_connect_rate=0.0,
                             kernel_sizes=[3, 3], in_channels=[32, 16], out_channels=[16, 24],
                             depthwise_padding=[], strides=[1, 2], num_block_repeats=[1, 1],
                             expand_ratios=[1, 6])
    model = EfficientNetForImageClassification(cfg)
    # Its init draws BatchNorm scales from N(0, 0.02): after a dozen of them the logits are
    # ~1e-14 and every gradient but the classifier's vanishes, which would test nothing.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
    return _hf("efficientnet", model, pixel_values=_image(1), labels=_classes(2, 5))


def segformer() -> Case:
    """Segmentation: a hierarchical transformer encoder (overlapping patch convs, reduced-key
    attention, Mix-FFN depthwise conv) and an all-MLP decode head; the loss upsamples the logits
    bilinearly to the label map and takes a per-pixel cross-entropy."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                          hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                          mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0, drop_path_rate=0.0)
    labels = torch.randint(0, 4, (BATCH, IMAGE, IMAGE), generator=_generator(2))
    return _hf("segformer", SegformerForSemanticSegmentation(cfg), pixel_values=_image(1), labels=labels)


class WindowAttention(torch.nn.Module):
    """Multi-head self-attention inside windows, with a relative position bias gathered from a
    learned table by an index buffer, and the shifted windows' mask added."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads = heads
        self.table = torch.nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", (rel[..., 0] * (2 * window - 1) + rel[..., 1]).view(-1), persistent=False)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        scores = scores + self.table[self.index].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            scores = (scores.view(-1, windows, self.heads, n, n) + mask.view(1, windows, 1, n, n)).view(b, self.heads, n, n)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class SwinBlock(torch.nn.Module):
    """timm's Swin v1 block, channels last: windows by reshape and permute, ``torch.roll``."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, size: int) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        mask = None
        if shift:
            region = torch.zeros(1, size, size, 1)
            cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
            for i, (h, w) in enumerate((h, w) for h in cuts for w in cuts):
                region[:, h, w, :] = i
            ids = self._partition(region).squeeze(-1)
            mask = (ids.unsqueeze(1) != ids.unsqueeze(2)).float() * -100.0
        self.register_buffer("mask", mask, persistent=False)

    def _partition(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x.view(b, h // self.window, self.window, w // self.window, self.window, c)
        return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, self.window * self.window, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = torch.roll(self.norm1(x), (-self.shift, -self.shift), (1, 2)) if self.shift else self.norm1(x)
        y = self.attn(self._partition(y), self.mask)
        y = y.view(b, h // self.window, w // self.window, self.window, self.window, c)
        y = y.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + (torch.roll(y, (self.shift, self.shift), (1, 2)) if self.shift else y)
        return x + self.mlp(self.norm2(x))


class WindowedSwin(torch.nn.Module):
    """A Swin written as timm writes it (channels last; transformers' Swin keeps (B, L, C)):
    patch embedding, two blocks (the second shifted), patch merging by reshape and permute,
    mean pooling, a linear head and cross-entropy."""

    def __init__(self, dim: int = 16, window: int = 4, size: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Conv2d(3, dim, 4, 4)
        self.norm = torch.nn.LayerNorm(dim)
        self.blocks = torch.nn.Sequential(SwinBlock(dim, 2, window, 0, size), SwinBlock(dim, 2, window, window // 2, size))
        self.merge_norm = torch.nn.LayerNorm(4 * dim)
        self.reduction = torch.nn.Linear(4 * dim, 2 * dim, bias=False)
        self.head = torch.nn.Linear(2 * dim, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.norm(self.embed(pixels).permute(0, 2, 3, 1)))
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        logits = self.head(self.reduction(self.merge_norm(x)).mean((1, 2)))
        return torch.nn.functional.cross_entropy(logits, labels)


def windowed_swin() -> Case:
    """Not in ``BUILDERS``: ``tests/test_dynamo_vision.py`` trains it from the dynamo exporter
    (its step graph is where ONNX Runtime's transpose optimizer met a Pad with ``axes``)."""
    return Case("windowed_swin", WindowedSwin(), (_image(1), _classes(2, 5)), ("pixels", "labels"))


class DenoiseLoss(torch.nn.Module):
    """A diffusers model's noise prediction against the noise: mean squared error."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(sample, timestep).sample, noise)


def unet2d() -> Case:
    """A diffusers ``UNet2DModel``: sinusoidal timestep embedding, GroupNorm, SiLU, resnet blocks
    with a time projection, self-attention at the lower resolution, strided-conv downsampling,
    nearest upsampling and skip concatenations. Not in ``BUILDERS`` (the corpus's checks over
    both exporters): ``tests/test_dynamo_vision.py`` trains it from torch's dynamo exporter."""
    from diffusers import UNet2DModel

    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                        norm_num_groups=4, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    timestep = torch.tensor([3, 17])
    return Case("unet2d", DenoiseLoss(model), (_image(1, size=8), timestep, _image(2, size=8)),
                ("sample", "timestep", "noise"))


class ConvSegmenter(torch.nn.Module):
    """A small encoder-decoder segmentation net: strided convs with BatchNorm down, a
    ConvTranspose up, a skip connection by concatenation, per-pixel cross-entropy."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        block = lambda i, o, s: torch.nn.Sequential(  # noqa: E731
            torch.nn.Conv2d(i, o, 3, s, 1, bias=False), torch.nn.BatchNorm2d(o), torch.nn.ReLU())
        self.down1 = block(3, 8, 2)
        self.down2 = block(8, 16, 2)
        self.up = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.fuse = block(16, 8, 1)
        self.head = torch.nn.Conv2d(8, classes, 1)
        self.upsample = torch.nn.ConvTranspose2d(classes, classes, 2, stride=2)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        skip = self.down1(pixels)
        fused = self.fuse(torch.cat([skip, self.up(self.down2(skip))], dim=1))
        return torch.nn.functional.cross_entropy(self.upsample(self.head(fused)), labels)


def conv_seg() -> Case:
    labels = torch.randint(0, 4, (BATCH, IMAGE, IMAGE), generator=_generator(2))
    return Case("conv_seg", ConvSegmenter(), (_image(1), labels), ("pixels", "labels"))


class LSTMClassifier(torch.nn.Module):
    """Embedding, a bidirectional LSTM, a GRU on top (reading both directions' outputs, as a second
    LSTM layer would), and a linear head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.lstm = torch.nn.LSTM(16, 16, num_layers=1, batch_first=True, bidirectional=True)
        self.gru = torch.nn.GRU(32, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        hidden, _ = self.gru(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden[:, -1]), labels)


def lstm() -> Case:
    """Three time steps (a first, a middle and a last): the step graph unrolls every recurrent
    node per step (``mpgraph/autodiff/lower_recurrent.py``), so its size grows with the length."""
    return Case("lstm", LSTMClassifier(), (_tokens(1, (BATCH, 3)), _classes(2, 3)), ("tokens", "labels"))


BUILDERS: dict[str, Callable[[], Case]] = {
    f.__name__: f
    for f in (bert, distilbert, llama, qwen2, gpt2, t5, vit, swin, resnet, convnext, mobilenet_v2,
              efficientnet, segformer, conv_seg, lstm)
}


def build(name: str, seed: int = 0) -> Case:
    """The case ``name`` with weights drawn from ``torch.manual_seed(seed)``, in train mode."""
    torch.manual_seed(seed)
    case = BUILDERS[name]()
    case.module.train()
    return case
