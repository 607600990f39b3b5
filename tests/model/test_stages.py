"""Running the stages in sequence is the whole model: same loss, same gradient for every parameter."""

import dataclasses

import pytest
import torch

from hetnode.config import ModelConfig
from hetnode.model import build_model, build_stages, count_parameters, layer_of
from hetnode.planning.layer_split import split_layers

CFG = ModelConfig(vocab_size=320, d_model=64, n_layers=6, n_heads=4, ffn_hidden=160, max_seq_len=32)


def _batch(cfg: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (3, 32), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (3, 32), generator=g)
    return tokens, targets


def _run_pipeline(stages, tokens, targets) -> torch.Tensor:
    """Forward stage by stage through detached boundaries, then backward stage by stage (as a chain does)."""
    boundary_inputs, boundary_outputs = [], []
    x = tokens
    for stage in stages[:-1]:
        if not stage.first:
            x = x.detach().requires_grad_(True)
        boundary_inputs.append(x)
        x = stage(x)
        boundary_outputs.append(x)
    x = x.detach().requires_grad_(True)
    loss = stages[-1].loss(x, targets)
    loss.backward()
    grad = x.grad
    for i in range(len(stages) - 2, -1, -1):
        boundary_outputs[i].backward(grad)
        grad = boundary_inputs[i].grad if i > 0 else None
    return loss


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("capacities", [[1, 1], [1, 2, 1], [1, 1, 1, 1, 1, 1]])
def test_stages_match_whole_model(tie: bool, capacities):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    tokens, targets = _batch(cfg)
    model = build_model(cfg, seed=3)
    full_loss = model.loss(tokens, targets)
    full_loss.backward()
    full_grads = {n: p.grad for n, p in model.named_parameters()}

    stages = build_stages(cfg, split_layers(cfg.n_layers, capacities), seed=3)
    stage_loss = _run_pipeline(stages, tokens, targets)
    torch.testing.assert_close(stage_loss, full_loss, rtol=1e-5, atol=1e-6)

    stage_grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            # A tied embedding lives on the first and the last stage; its gradient is the sum.
            stage_grads[name] = stage_grads.get(name, 0) + param.grad
    assert set(stage_grads) == set(full_grads)
    for name, grad in full_grads.items():
        torch.testing.assert_close(stage_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_stage_built_alone_holds_the_full_models_values():
    model = build_model(CFG, seed=7)
    stage = build_stages(CFG, [range(0, 2), range(2, 6)], seed=7)[1]
    full = dict(model.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, full[name]), name
    assert not any(n.startswith("embed") for n, _ in stage.named_parameters())
    assert {n.split(".")[1] for n, _ in stage.named_parameters() if n.startswith("blocks.")} == {
        "2",
        "3",
        "4",
        "5",
    }


def test_different_seeds_give_different_weights():
    a, b = build_model(CFG, seed=0), build_model(CFG, seed=1)
    assert not torch.equal(a.embed.weight, b.embed.weight)


def test_count_parameters_matches_the_module():
    for tie in (False, True):
        cfg = dataclasses.replace(CFG, tie_embeddings=tie)
        assert count_parameters(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_bad_stage_ranges_rejected():
    with pytest.raises(ValueError):
        build_stages(CFG, [range(0, 2), range(3, 6)])
    with pytest.raises(ValueError):
        build_stages(CFG, [range(0, 2), range(2, 5)])


def test_layer_of_groups_parameters():
    names = [n for n, _ in build_model(CFG).named_parameters()]
    groups = {layer_of(n) for n in names}
    assert groups == {"embed", "head", *map(str, range(CFG.n_layers))}
