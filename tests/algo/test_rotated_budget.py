"""`RotatedAdamW` under a FLOP budget: block-diagonal bases and the per-matrix rule of `plan_bases`."""

import copy

import pytest
import torch

from hetnode.algo.optim import build_optimizer, is_rotated
from hetnode.algo.rotated_adam import (
    RotatedAdamW,
    add_from_basis,
    from_basis,
    left_apply,
    reproject_second_moment,
    right_apply,
    to_basis,
)
from hetnode.algo.rotation_cost import Bases, plan_bases, share
from hetnode.config import InnerConfig, ModelConfig, config_from_dict
from hetnode.errors import ConfigError
from hetnode.model import build_model

TINY = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, ffn_hidden=160, max_seq_len=32)


def _orthogonal_stack(blocks: int, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.linalg.qr(torch.randn(size, size, generator=g))[0] for _ in range(blocks)])


def test_block_stacks_act_as_their_block_diagonal() -> None:
    x = torch.randn(6, 8)
    left, right = _orthogonal_stack(3, 2, 0), _orthogonal_stack(2, 4, 1)
    full_left, full_right = torch.block_diag(*left), torch.block_diag(*right)
    torch.testing.assert_close(left_apply(left, x), full_left @ x)
    torch.testing.assert_close(right_apply(x, right), x @ full_right)
    torch.testing.assert_close(to_basis(x, left, right), full_left.T @ x @ full_right)
    torch.testing.assert_close(from_basis(to_basis(x, left, right), left, right), x, atol=1e-5, rtol=0)


def _basis(size: int, block: int, seed: int) -> torch.Tensor | None:
    """None (identity), a full size×size basis, or a stack of block×block ones."""
    if not block:
        return None
    stack = _orthogonal_stack(size // block, block, seed)
    return stack[0] if block == size else stack


@pytest.mark.parametrize("left, right", [(6, 4), (3, 0), (6, 0), (0, 2), (0, 4), (3, 2)])
def test_update_is_accumulated_into_the_parameter_in_place(left: int, right: int) -> None:
    """decay·p + alpha·Q_L x Q_Rᵀ written into p's own storage: full or blocked, either side or both, also
    through a non-contiguous view; a bfloat16 parameter gets the float32 result rounded once."""
    g = torch.Generator().manual_seed(7)
    q_left, q_right = _basis(6, left, 8), _basis(4, right, 9)
    full_left = torch.eye(6) if q_left is None else torch.block_diag(*q_left.reshape(-1, left, left))
    full_right = torch.eye(4) if q_right is None else torch.block_diag(*q_right.reshape(-1, right, right))
    x, start = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    expected = 0.9 * start - 0.1 * full_left @ x @ full_right.T
    storage = start.T.clone()  # 4×6: its transpose is a non-contiguous 6×4 parameter
    for p in (start.clone(), storage.T):
        pointer = p.data_ptr()
        add_from_basis(p, x, q_left, q_right, decay=0.9, alpha=-0.1)
        assert p.data_ptr() == pointer
        torch.testing.assert_close(p, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(storage.T, expected, atol=1e-6, rtol=0)
    low = start.bfloat16()
    add_from_basis(low, x, q_left, q_right, decay=0.9, alpha=-0.1)
    torch.testing.assert_close(low, expected.bfloat16(), atol=2e-2, rtol=0)


def test_blocked_reprojection_permutes_v_within_blocks_exactly() -> None:
    v = torch.rand(4, 6)
    old = _orthogonal_stack(3, 2, 2)
    new = old.flip(-1)  # each 2×2 block's columns swapped
    moved = reproject_second_moment(v, None, None, old, new)
    torch.testing.assert_close(moved, v.reshape(4, 3, 2).flip(-1).reshape(4, 6))


def _blocked_optimizer(w: torch.nn.Parameter, **kw) -> RotatedAdamW:
    """8×6 with a budget between blocks of 3 and a full right side (the smaller one)."""
    budget = 0.5 * (share(8, 6, Bases(0, 3), 1, 10) + share(8, 6, Bases(0, 6), 1, 10))
    assert plan_bases(8, 6, 1, budget, 10) == Bases(0, 3)
    return RotatedAdamW([w], budget=budget, tokens_per_step=1, refresh_every=10, **kw)


def test_blocked_statistics_are_the_diagonal_blocks_of_gtg() -> None:
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = _blocked_optimizer(w, stat_decay=0.9)
    grad = torch.randn(8, 6)
    w.grad = grad.clone()
    opt.step()
    state = opt.state[w]
    assert "Q_L" not in state and state["Q_R"].shape == (2, 3, 3)
    full = 0.1 * grad.T @ grad
    torch.testing.assert_close(state["stat_R"][0], full[:3, :3])
    torch.testing.assert_close(state["stat_R"][1], full[3:, 3:])
    eye = torch.eye(3).expand(2, 3, 3)
    torch.testing.assert_close(state["Q_R"].mT @ state["Q_R"], eye, atol=1e-5, rtol=0)


def test_frozen_blocked_basis_is_adam_in_rotated_coordinates() -> None:
    """As for full bases (test_algo_optim): with the basis fixed after step 1, the update is AdamW on
    W̃ = W Q_R with Q_R the block diagonal of the stack."""
    g = torch.Generator().manual_seed(5)
    start = torch.randn(8, 6, generator=g)
    grads = [torch.randn(8, 6, generator=g) for _ in range(6)]
    kw = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.0}
    w = torch.nn.Parameter(start.clone())
    opt = _blocked_optimizer(w, **kw)
    opt.param_groups[0]["refresh_every"] = 1000
    w.grad = grads[0].clone()
    opt.step()
    q = torch.block_diag(*opt.state[w]["Q_R"])
    w_rot = torch.nn.Parameter(start @ q)
    ref = torch.optim.AdamW([w_rot], foreach=False, **kw)
    for grad in grads:
        w_rot.grad = grad @ q
        ref.step()
    for grad in grads[1:]:
        w.grad = grad.clone()
        opt.step()
    torch.testing.assert_close(w.detach(), w_rot.detach() @ q.T, rtol=0, atol=1e-5)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_build_optimizer_applies_the_rule_only_with_the_tokens_of_a_step() -> None:
    cfg = InnerConfig(optimizer="rotated_adamw", rotation_refresh=3, rotation_budget=0.10)
    # d = 64, refresh every 3: one-sided in full costs 12 % (attention) and 10.2 % (MLP), blocks of 32 5-6 %
    tokens = 1024
    model = build_model(TINY, seed=0)
    plain_model = copy.deepcopy(model)
    opt = build_optimizer(model, cfg, tokens_per_step=tokens)

    def step(m, o, seed: int) -> None:
        o.zero_grad(set_to_none=True)
        m.loss(*_batch(seed)).backward()
        o.step()

    for s in range(6):  # crosses the refresh at step 4
        step(model, opt, s)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    seen = set()
    for name, p in model.named_parameters():
        state = opt.state[p]
        if not is_rotated(name, p):
            assert "stat_L" not in state and "stat_R" not in state
            continue
        m, n = p.shape
        bases = plan_bases(m, n, tokens, 0.10, 3)
        assert share(m, n, bases, tokens, 3) <= 0.10
        for side, block, size in (("L", bases.left, m), ("R", bases.right, n)):
            expected = None if not block else (size, size) if block == size else (size // block, block, block)
            assert (state[f"Q_{side}"].shape if f"Q_{side}" in state else None) == expected
        seen.add(bases)
    assert seen == {Bases(0, 32), Bases(32, 0)}  # the down projection (64×160) rotates its left side

    clone = copy.deepcopy(model)
    fresh = build_optimizer(clone, cfg, tokens_per_step=tokens)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(6, 9):  # crosses the refresh at step 7 in both copies
        step(model, opt, s)
        step(clone, fresh, s)
    for (n, p), q in zip(model.named_parameters(), clone.parameters(), strict=True):
        assert torch.equal(p, q), n

    plain = build_optimizer(plain_model, cfg)  # without the tokens: the configured two-sided bases
    step(plain_model, plain, 0)
    wq = plain_model.blocks["0"].attn.wq.weight
    assert plain.state[wq]["Q_L"].shape == (64, 64) and plain.state[wq]["Q_R"].shape == (64, 64)


@pytest.mark.parametrize("budget", [0.0, -0.1])
def test_config_rejects_a_budget_that_is_not_positive(budget: float) -> None:
    with pytest.raises(ConfigError, match="rotation_budget"):
        config_from_dict({"inner": {"rotation_budget": budget}})
