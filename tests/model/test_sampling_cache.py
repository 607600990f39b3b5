"""The KV-cached sampler computes what the whole forward computes: the same logits at every step, and so
the same text, inside the trained context and past it (where the context is cropped, as in training)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetnode.algo.subspace import frozen_embedding
from hetnode.config import Config
from hetnode.model.decoder import DecoderStage, build_model
from hetnode.model.sampling import CachedDecoder, sample_tokens


def _model(config: Config, tied: bool, fixed: bool, max_seq_len: int = 32) -> DecoderStage:
    cfg = dataclasses.replace(
        config.model, d_model=64, n_layers=2, ffn_hidden=96, max_seq_len=max_seq_len, tie_embeddings=tied
    )
    model = build_model(cfg, seed=3)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():  # far from the initialisation: logits of order 1
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    if fixed:
        model.fixed_embedding = frozen_embedding(cfg.vocab_size, cfg.d_model, 3, 0.1)
    return model.eval()


@pytest.mark.parametrize(("tied", "fixed"), [(False, False), (True, False), (False, True)])
def test_cached_logits_are_the_whole_forwards(tiny_config: Config, tied: bool, fixed: bool):
    model = _model(tiny_config, tied, fixed)
    ids = torch.randint(0, 257, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    cached = CachedDecoder(model)
    with torch.no_grad():
        for n in range(5, 33):  # a prompt of 5, then one token at a time to max_seq_len
            whole = model(torch.tensor([ids[:n]]))[0, -1]
            torch.testing.assert_close(cached.next_logits(ids[:n]), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one new id at a time"):
        cached.next_logits([*ids, 1])  # past max_seq_len


def test_a_sample_is_the_one_the_whole_forward_gives(tiny_config: Config):
    """Greedy, in float64 (no near-tie can flip an argmax), over 40 tokens of a 16-token model: the cache
    for the first 12, then the cropped window read whole."""
    model = _model(tiny_config, tied=False, fixed=False, max_seq_len=16).double()
    prompt = [10, 20, 30, 40]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(40):  # the sampler before the cache: the whole (cropped) context at every step
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert sample_tokens(model, prompt, 40, temperature=0) == ids[len(prompt) :]
