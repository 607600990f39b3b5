"""θ as a Hugging Face `LlamaForCausalLM` folder: the state-dict mapping, `config.json` and the files
`from_pretrained` reads, so that `transformers` loads the global model with no code of ours.

hetnode's decoder *is* the Llama architecture (pre-norm RMSNorm with the weight after the scale, SwiGLU,
no biases, RoPE over the two halves of each head, i.e. HF's `rotate_half`, with inv_freq
θ^(−2i/d)), so every block tensor maps by name alone: no q/k row permutation. Two things do not map by
name: the frozen input embedding T_fix that the subspace-compressed pipeline adds (folded into the exported
input embedding) and, because of that fold, the head of a tied model (then exported untied).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hetnode.config import Config, ModelConfig
from hetnode.data.tokenizer import Tokenizer
from hetnode.errors import CheckpointError, DataError
from hetnode.export.hf_tokenizer import write_tokenizer_files

WEIGHTS = "model.safetensors"
# (hetnode name inside block i, HF name inside model.layers.i)
BLOCK_MAP = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn.wq.weight", "self_attn.q_proj.weight"),
    ("attn.wk.weight", "self_attn.k_proj.weight"),
    ("attn.wv.weight", "self_attn.v_proj.weight"),
    ("attn.wo.weight", "self_attn.o_proj.weight"),
    ("mlp_norm.weight", "post_attention_layernorm.weight"),
    ("mlp.w_gate.weight", "mlp.gate_proj.weight"),
    ("mlp.w_up.weight", "mlp.up_proj.weight"),
    ("mlp.w_down.weight", "mlp.down_proj.weight"),
)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model and its shape, from the config alone: the names this mapping reads.
    Arithmetic, not `decoder.parameter_shapes`: building even on the meta device loads torch's compiler
    (a second, at every `hetnode sample`). tests/export/test_hf_export.py holds the two equal."""
    d, f, v = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size
    block = {"attn_norm.weight": (d,), "mlp_norm.weight": (d,), "mlp.w_down.weight": (d, f)}
    block |= {f"attn.{w}.weight": (d, d) for w in ("wq", "wk", "wv", "wo")}
    block |= {f"mlp.{w}.weight": (f, d) for w in ("w_gate", "w_up")}
    shapes = {"embed.weight": (v, d), "norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["head.weight"] = (v, d)
    for i in range(cfg.n_layers):
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in block.items()}
    return shapes


def check_params(params: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """CheckpointError unless `params` are exactly the whole model's tensors for `cfg`."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    wrong = sorted(
        f"{n} {tuple(params[n].shape)} (config: {expected[n]})"
        for n in set(expected) & set(params)
        if tuple(params[n].shape) != expected[n]
    )
    problems = [
        f"{label}: {', '.join(names[:5])}{' …' if len(names) > 5 else ''}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if names
    ]
    if problems:
        raise CheckpointError(f"{where} does not hold the model its config describes ({'; '.join(problems)})")


def exported_tied(cfg: ModelConfig, fixed_embedding: torch.Tensor | None) -> bool:
    """Tied in HF only when ours is tied *and* nothing is added at the input: with T_fix the input table is
    embed + T_fix while the head still reads embed alone."""
    return cfg.tie_embeddings and fixed_embedding is None


def hf_state_dict(
    params: dict[str, torch.Tensor], cfg: ModelConfig, fixed_embedding: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The `LlamaForCausalLM` state dict (float32, contiguous, no shared storage) of θ."""
    check_params(params, cfg, "the checkpoint")
    embed = params["embed.weight"].float()
    inputs = embed if fixed_embedding is None else embed + fixed_embedding.float()
    out = {"model.embed_tokens.weight": inputs, "model.norm.weight": params["norm.weight"]}
    if not exported_tied(cfg, fixed_embedding):
        out["lm_head.weight"] = embed if cfg.tie_embeddings else params["head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in BLOCK_MAP:
            out[f"model.layers.{i}.{theirs}"] = params[f"blocks.{i}.{ours}"]
    # safetensors refuses tensors sharing memory; clone so the head never aliases the input table
    return {name: t.detach().to("cpu", torch.float32).clone().contiguous() for name, t in out.items()}


def hf_config(cfg: ModelConfig, tied: bool, eos_id: int, provenance: dict[str, Any]) -> dict[str, Any]:
    """`config.json` for `LlamaForCausalLM`. The vocabulary is the model's (it may exceed the tokenizer's:
    padded to whole sync tiles). `rope_theta` is given both ways: top level for transformers 4.x,
    `rope_parameters` for 5.x."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,  # no grouped-query attention
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": tied,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",
        "hetnode": provenance,  # which run and round this is; transformers keeps it as an attribute
    }


def generation_config(eos_id: int) -> dict[str, Any]:
    """`generate()` stops at our end-of-text and pads with it (there is no separate pad token)."""
    return {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id}


def write_hf(
    out: Path,
    params: dict[str, torch.Tensor],
    config: Config,
    fixed_embedding: torch.Tensor | None,
    tokenizer: Tokenizer,
    provenance: dict[str, Any],
) -> list[Path]:
    """Write the model, its configs and its tokenizer files into `out` (created); the paths written."""
    cfg = config.model
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, "
            f"more than the model's {cfg.vocab_size}"
        )
    tensors = hf_state_dict(params, cfg, fixed_embedding)
    tied = exported_tied(cfg, fixed_embedding)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **{f"hetnode_{k}": str(v) for k, v in provenance.items()}}
    save_file(tensors, str(out / WEIGHTS), metadata=metadata)
    written = [out / WEIGHTS]
    for name, doc in (
        ("config.json", hf_config(cfg, tied, tokenizer.eos_id, provenance)),
        ("generation_config.json", generation_config(tokenizer.eos_id)),
    ):
        (out / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        written.append(out / name)
    written += write_tokenizer_files(out, tokenizer, cfg.max_seq_len)
    return written
