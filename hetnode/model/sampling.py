"""Text from the whole model: autoregressive sampling with a temperature, seeded so that a sample can be
repeated (the coordinator's per-round samples, `hetnode sample`).

Each layer's keys and values are kept as the text grows (a KV cache), so a new token costs one position
through the model, not the whole context again: on a busy 2-core machine re-reading the context made
`hetnode sample` several times slower than `transformers` on the same weights (issue 33). Past the
model's `max_seq_len` the context is cropped to its last `max_seq_len` tokens and read again whole at
every step, as in training, where positions never exceed it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetnode.model.decoder import DecoderStage
from hetnode.model.layers import Attention, apply_rotary


@torch.no_grad()
def sample_tokens(
    model: DecoderStage,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """The `max_new_tokens` ids that follow `prompt` (fewer if `stop_id` is drawn; it is not returned).
    Temperature 0 is greedy; a positive one divides the logits before a multinomial draw from a generator
    seeded with `seed`."""
    if not (model.first and model.last):
        raise ValueError("sampling needs the whole model, not a stage")
    if not prompt:
        raise ValueError("sampling needs a prompt of at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    ids = list(prompt)
    out: list[int] = []
    window = model.cfg.max_seq_len
    cached = CachedDecoder(model)
    try:
        for _ in range(max_new_tokens):
            if len(ids) <= window:
                logits = cached.next_logits(ids).float().cpu()
            else:  # past the trained context: the last `window` tokens at positions 0.., as in training
                context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
                logits = model(context)[0, -1].float().cpu()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if stop_id is not None and token == stop_id:
                break
            ids.append(token)
            out.append(token)
    finally:
        model.train(was_training)
    return out


class CachedDecoder:
    """The whole model fed a growing text, each layer's keys and values kept: `next_logits(ids)` reads only
    the ids it has not seen. The arithmetic is `Block.forward`'s and `Attention.forward`'s (layers.py), step
    by step; tests/model/test_sampling_cache.py holds its logits equal to the whole forward's."""

    def __init__(self, model: DecoderStage) -> None:
        self.model = model
        self.keys: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.seen = 0

    @torch.no_grad()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits after `ids[-1]`; `ids` must extend what earlier calls were given, within the
        model's `max_seq_len`, and only the first call may bring more than one new id."""
        start, model = self.seen, self.model
        if len(ids) > model.cfg.max_seq_len or len(ids) <= start or (start > 0 and len(ids) - start > 1):
            raise ValueError(f"{len(ids)} ids after {start}: one new id at a time within max_seq_len")
        device = next(model.parameters()).device
        tokens = torch.tensor([ids[start:]], dtype=torch.long, device=device)
        cos, sin = model.rope_cos[start : len(ids)], model.rope_sin[start : len(ids)]
        x = model.embed_tokens(tokens)
        for i, block in enumerate(model.blocks.values()):
            x = x + self._attend(i, block.attn, block.attn_norm(x), cos, sin)
            x = x + block.mlp(block.mlp_norm(x))
        self.seen = len(ids)
        return model.logits(x)[0, -1]

    def _attend(
        self, layer: int, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            w(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2) for w in (attn.wq, attn.wk, attn.wv)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # cos/sin start at the new positions
        first = self.keys[layer] is None
        if not first:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        # the prompt attends causally among itself; one new token attends to everything before it
        out = F.scaled_dot_product_attention(q, k, v, is_causal=first and t > 1)
        return attn.wo(out.transpose(1, 2).reshape(b, t, d))
