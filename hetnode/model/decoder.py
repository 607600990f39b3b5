"""The decoder as a stack of contiguous stages.

One class, `DecoderStage`, holds any contiguous slice of the model: the first stage owns the token
embedding, the last owns the final norm, the head and the loss, and the whole model is simply the
stage that is both first and last. Parameter names are the *global* names (`blocks.3.attn.wq.weight`),
so a chain stage's state dict is a slice of the full model's, and sync rounds address layers the
same way on anchors and chains. Initialisation is seeded per parameter name, so a stage built alone
holds exactly the values the full model would hold for those parameters.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from hetnode.algo.random import portable_normal
from hetnode.config import ModelConfig
from hetnode.model.layers import Block, RMSNorm, rotary_tables


class DecoderStage(nn.Module):
    """Layers `layers` of the decoder; embedding if `first`, norm + head + loss if `last`."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool, seed: int = 0) -> None:
        super().__init__()
        if len(layers) == 0 and not (first and last):
            raise ValueError("a stage needs at least one layer")
        if layers.step != 1 or layers.start < 0 or layers.stop > cfg.n_layers:
            raise ValueError(f"layers {layers} are not a contiguous slice of 0..{cfg.n_layers - 1}")
        self.cfg = cfg
        self.layers = layers
        self.first = first
        self.last = last
        # A tied last stage that is not also first keeps its own copy of the embedding for the head;
        # the pipeline must then add both stages' gradients for `embed.weight` (same global name).
        needs_embed = first or (last and cfg.tie_embeddings)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if needs_embed else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if last else None
        self.head = (
            nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last and not cfg.tie_embeddings else None
        )
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Frozen random embedding T_fix added at the input when activations are subspace-compressed.
        self.fixed_embedding: torch.Tensor | None = None
        init_parameters(self, cfg, seed)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.first:
            raise RuntimeError("only the first stage embeds tokens")
        x = self.embed(tokens)
        return x if self.fixed_embedding is None else x + self.fixed_embedding[tokens]

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.last:
            raise RuntimeError("only the last stage has a head")
        x = self.norm(x)
        weight = self.embed.weight if self.cfg.tie_embeddings else self.head.weight
        return F.linear(x, weight)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) in; hidden states or logits out,
        or, on a last stage given `targets`, the mean next-token cross-entropy."""
        x = self.embed_tokens(inputs) if self.first else inputs
        x = self.run_blocks(x)
        if not self.last:
            return x
        logits = self.logits(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; only on a last stage."""
        if not self.last:
            raise RuntimeError("only the last stage computes the loss")
        return self(inputs, targets)


def build_model(cfg: ModelConfig, seed: int = 0) -> DecoderStage:
    """The whole decoder: the stage that is both first and last."""
    return DecoderStage(cfg, range(cfg.n_layers), first=True, last=True, seed=seed)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model and its shape, built on the meta device (no memory, no
    initialisation): what a checkpoint or an export of it must hold."""
    with torch.device("meta"):
        model = DecoderStage(cfg, range(cfg.n_layers), first=True, last=True)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def build_stages(cfg: ModelConfig, splits: list[range], seed: int = 0) -> list[DecoderStage]:
    """One module per contiguous layer range; ranges must cover 0..n_layers-1 in order."""
    check_splits(cfg, splits)
    last = len(splits) - 1
    return [DecoderStage(cfg, r, first=i == 0, last=i == last, seed=seed) for i, r in enumerate(splits)]


def build_stage(cfg: ModelConfig, splits: list[range], index: int, seed: int = 0) -> DecoderStage:
    """Stage `index` of a chain over `splits` alone, initialised exactly as in the whole model."""
    check_splits(cfg, splits)
    return DecoderStage(cfg, splits[index], first=index == 0, last=index == len(splits) - 1, seed=seed)


def check_splits(cfg: ModelConfig, splits: list[range]) -> None:
    expected = 0
    for layers in splits:
        if layers.start != expected or len(layers) == 0:
            raise ValueError(f"stage ranges must be contiguous, non-empty and start at 0: {splits}")
        expected = layers.stop
    if expected != cfg.n_layers:
        raise ValueError(f"stage ranges cover {expected} of {cfg.n_layers} layers")


def _param_generator(seed: int, name: str) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return generator


def init_parameters(module: DecoderStage, cfg: ModelConfig, seed: int) -> None:
    """Normal(0, std) weights, residual-writing projections scaled by 1/sqrt(2L) (GPT-2), norms at 1."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("attn.wo.weight", "mlp.w_down.weight")) else cfg.init_std
            param.copy_(portable_normal(param.shape, _param_generator(seed, name), std))


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model, computed from the config without building it."""
    d, f, v = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size
    per_block = 4 * d * d + 3 * d * f + 2 * d
    head = 0 if cfg.tie_embeddings else v * d
    return v * d + cfg.n_layers * per_block + d + head


def layer_of(name: str) -> str:
    """The layer key a parameter belongs to: "embed", "head" or the block index as a string."""
    if name.startswith("blocks."):
        return name.split(".")[1]
    if name.startswith("embed."):
        return "embed"
    return "head"  # final norm and head travel together with the last layer group
