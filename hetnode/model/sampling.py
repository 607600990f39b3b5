"""Text from the whole model: autoregressive sampling with a temperature, seeded so that a sample can be
repeated (the coordinator's per-round samples, `hetnode sample`).

No KV cache: the models a swarm trains here are small and a sample is a few hundred tokens; the context
is cropped to the model's `max_seq_len`, as in training.
"""

from __future__ import annotations

import torch

from hetnode.model.decoder import DecoderStage


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
    try:
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-model.cfg.max_seq_len :]], dtype=torch.long, device=device)
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
