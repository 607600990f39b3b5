"""The subspace constraint makes boundary compression exact, and only with the constraint."""

import pytest
import torch

from hetnode.algo.subspace import (
    decode_activations,
    decode_gradient,
    encode_activations,
    encode_gradient,
    orthonormal_basis,
)
from hetnode.config import ModelConfig
from hetnode.model import build_model, build_stages
from hetnode.model.subspace import SubspaceConstraint

CFG = ModelConfig(vocab_size=320, d_model=64, n_layers=4, n_heads=4, ffn_hidden=160, max_seq_len=32)


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (2, 32), generator=g), torch.randint(
        0, CFG.vocab_size, (2, 32), generator=g
    )


def test_basis_is_orthonormal_and_seeded():
    u = orthonormal_basis(64, 7, seed=3)
    torch.testing.assert_close(u.T @ u, torch.eye(7), atol=1e-6, rtol=0)
    assert torch.equal(u, orthonormal_basis(64, 7, seed=3))
    assert not torch.equal(u, orthonormal_basis(64, 7, seed=4))


@pytest.mark.parametrize("rank", [4, 15])
def test_constrained_boundary_reconstructs_exactly(rank):
    constraint = SubspaceConstraint.create(CFG, rank, last_boundary=3, seed=0)
    first, last = build_stages(CFG, [range(0, 3), range(3, 4)], seed=1)
    constraint.attach(first)
    tokens, _ = _tokens()
    # perturb weights the way training would, then re-project (as after an optimiser step)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    constraint.project_parameters(first)
    x = first(tokens)
    c = encode_activations(x, tokens, constraint.basis, constraint.fixed)
    assert c.shape == (2, 32, rank)
    rebuilt = decode_activations(c, tokens, constraint.basis, constraint.fixed)
    error = (rebuilt - x).norm() / x.norm()
    assert error < 1e-5
    # bf16 on the wire: bounded, reported error
    rebuilt_bf16 = decode_activations(c.to(torch.bfloat16), tokens, constraint.basis, constraint.fixed)
    assert (rebuilt_bf16 - x).norm() / x.norm() < 2e-2


def test_unconstrained_boundary_does_not_reconstruct():
    constraint = SubspaceConstraint.create(CFG, 8, last_boundary=3, seed=0)
    first = build_stages(CFG, [range(0, 3), range(3, 4)], seed=1)[0]
    first.fixed_embedding = constraint.fixed  # T_fix but no projection
    tokens, _ = _tokens()
    x = first(tokens)
    rebuilt = decode_activations(
        encode_activations(x, tokens, constraint.basis, constraint.fixed),
        tokens,
        constraint.basis,
        constraint.fixed,
    )
    assert (rebuilt - x).norm() / x.norm() > 0.1


def test_gradient_sent_back_is_the_projection_of_the_full_gradient():
    u = orthonormal_basis(64, 8, seed=0)
    g = torch.randn(2, 32, 64)
    torch.testing.assert_close(decode_gradient(encode_gradient(g, u), u), g @ u @ u.T)


def test_split_constrained_model_has_the_unsplit_constrained_gradients():
    """Compressed boundaries (coefficients forward, projected gradients back) lose nothing."""
    constraint = SubspaceConstraint.create(CFG, 8, last_boundary=2, seed=0)
    tokens, targets = _tokens(1)
    model = build_model(CFG, seed=5)
    constraint.attach(model)
    model.loss(tokens, targets).backward()
    constraint.project_gradients(model)
    full = {n: p.grad for n, p in model.named_parameters()}

    stages = build_stages(CFG, [range(0, 1), range(1, 2), range(2, 4)], seed=5)
    for s in stages:
        constraint.attach(s)
    u, fixed = constraint.basis, constraint.fixed
    sent, received = [], []  # sent[i]: coefficients out of stage i; received[i]: their leaf in stage i+1
    coeffs = None
    for i, stage in enumerate(stages):
        if i == 0:
            inputs = tokens
        else:
            leaf = coeffs.detach().requires_grad_(True)
            received.append(leaf)
            inputs = decode_activations(leaf, tokens, u, fixed)
        if stage.last:
            stage.loss(inputs, targets).backward()
        else:
            coeffs = encode_activations(stage(inputs), tokens, u, fixed)
            sent.append(coeffs)
    for i in range(len(sent) - 1, -1, -1):
        sent[i].backward(received[i].grad)
    for s in stages:
        constraint.project_gradients(s)
        for name, p in s.named_parameters():
            torch.testing.assert_close(p.grad, full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_constraint_covers_the_right_weights():
    constraint = SubspaceConstraint.create(CFG, 8, last_boundary=3, seed=0)
    names = [n for n, _ in build_model(CFG).named_parameters()]
    constrained = {n for n in names if constraint.is_constrained(n)}
    assert constrained == {"embed.weight"} | {
        f"blocks.{i}.{w}" for i in range(3) for w in ("attn.wo.weight", "mlp.w_down.weight")
    }
    with pytest.raises(ValueError, match="untied"):
        SubspaceConstraint.create(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), 8, 3, 0)
