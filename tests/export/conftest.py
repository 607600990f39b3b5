"""A small model saved as a real checkpoint, with weights far from their initialisation (norm gains ≠ 1,
logits of order 1), so that a wrong mapping, a missing T_fix or a mis-tied head shows in the logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetnode.config import Config, config_from_dict
from hetnode.data.tokenizer import BpeTokenizer
from hetnode.model.decoder import build_model
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import CheckpointManifest, save_checkpoint

_WORDS = ["the", "a", "river", "mountain", "city", "old", "new", "north"]
_WORDS += ["south", "king", "queen", "war", "peace", "music", "art", "science"]


def small_config(base: Config, compression: str, tied: bool, tokenizer: str = "bytes") -> Config:
    raw = base.to_dict()
    raw["model"].update(
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=176,
        max_seq_len=64,
        tie_embeddings=tied,
        init_std=0.1,  # T_fix is drawn with this std: large enough that leaving it out shows
        rope_theta=5000.0,  # not transformers' default, so a dropped rope_theta shows
        norm_eps=1e-6,
    )
    raw["data"].update(seq_len=64, tokenizer=tokenizer, bpe_vocab_size=300)
    raw["pipeline"].update(compression=compression, subspace_rank=8)
    return config_from_dict(raw)


def perturbed_params(config: Config, seed: int = 1) -> dict[str, torch.Tensor]:
    model = build_model(config.model, seed=config.run.seed)
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.3 * noise
        else:
            params[name] = noise / p.shape[-1] ** 0.5 * (4.0 if name.startswith(("embed", "head")) else 1.0)
    return params


@pytest.fixture
def small(tiny_config: Config) -> Callable[..., Config]:
    """small(compression, tied, tokenizer="bytes"): the tiny config shrunk for these tests."""
    return lambda compression, tied, tokenizer="bytes": small_config(
        tiny_config, compression, tied, tokenizer
    )


@pytest.fixture
def write_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Save `params` (default: perturbed) of `config` as a checkpoint folder; the folder."""

    def write(config: Config, params: dict[str, torch.Tensor] | None = None, round_: int = 7) -> Path:
        params = params if params is not None else perturbed_params(config)
        manifest = CheckpointManifest.of(config, round_, "seal", layer_digests(params), run="test-run")
        return save_checkpoint(tmp_path / "checkpoints" / f"round-{round_:06d}", params, manifest)

    return write


@pytest.fixture(scope="session")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE (vocab 300) trained on a few hundred short texts, saved as its tokenizers JSON."""
    texts = [
        f"{_WORDS[i % 16]} {_WORDS[(i * 7) % 16]} {_WORDS[(i * 3) % 16]} number {i}. Ünïcödé {i % 5}"
        for i in range(400)
    ]
    tokenizer = BpeTokenizer.train(texts, 300, name="bpe-test")
    path = tmp_path_factory.mktemp("bpe") / "bpe-test.json"
    tokenizer.save(path)
    return path
