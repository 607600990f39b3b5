"""Inner optimisers (docs/chains.md, "Asynchronous 1F1B with weight stashing"): NAdam with constant μ = β1,
basis-rotated AdamW (arXiv 2602.03515)."""

import copy

import pytest
import torch

from hetnode.algo.optim import NAdamW, build_optimizer, rotation_groups
from hetnode.algo.rotated_adam import RotatedAdamW, reproject_second_moment
from hetnode.config import InnerConfig, ModelConfig
from hetnode.model import build_model

TINY = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, ffn_hidden=160, max_seq_len=32)


def _params_and_grads(seed: int, shapes: list[tuple[int, ...]], steps: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(*s, generator=g) for s in shapes]
    grads = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


def _run(opt_cls, params, grads, **kw) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls(ps, **kw)
    for step_grads in grads:
        for p, gr in zip(ps, step_grads, strict=True):
            p.grad = gr.clone()
        opt.step()
    return [p.detach() for p in ps]


@pytest.mark.parametrize("one_sided", [False, True])
def test_identity_bases_equal_adamw(one_sided: bool) -> None:
    params, grads = _params_and_grads(0, [(12, 7), (5, 9), (6,)], steps=6)
    kw = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours = _run(RotatedAdamW, params, grads, identity_bases=True, one_sided=one_sided, **kw)
    ref = _run(torch.optim.AdamW, params, grads, foreach=False, **kw)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_nadam_matches_hand_written_update() -> None:
    params, grads = _params_and_grads(1, [(4, 3), (5,)], steps=7)
    lr, b1, b2, eps, wd = 0.02, 0.99, 0.95, 1e-8, 0.1
    ours = _run(NAdamW, params, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for i, theta in enumerate(params):
        theta = theta.double().clone()
        m, v = torch.zeros_like(theta), torch.zeros_like(theta)
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[i].double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            nesterov = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
            theta = theta * (1 - lr * wd) - lr * nesterov / ((v / (1 - b2**t)).sqrt() + eps)
        torch.testing.assert_close(ours[i].double(), theta, rtol=0, atol=1e-5)
    # torch's NAdam has μ_t = β1(1 − ½·0.96^(tψ)): ψ → ∞ gives our constant μ = β1, ψ = 0 gives β1/2.
    kw = {"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": wd, "decoupled_weight_decay": True}
    same = _run(torch.optim.NAdam, params, grads, momentum_decay=float("inf"), foreach=False, **kw)
    half = _run(torch.optim.NAdam, params, grads, momentum_decay=0.0, foreach=False, **kw)
    torch.testing.assert_close(ours[0], same[0], rtol=0, atol=1e-6)
    assert (ours[0] - half[0]).abs().max() > 1e-3


def test_fixed_basis_is_adam_in_rotated_coordinates() -> None:
    """With the basis frozen after step 1, the update is AdamW on W̃ = Q_Lᵀ W Q_R (no weight decay).

    eps is large here because the step-1 basis diagonalises G₁: the off-diagonal G̃₁ entries are rounding noise
    (~1e-7) that Adam's normalisation would blow up differently in the two computations.
    """
    params, grads = _params_and_grads(2, [(8, 6)], steps=6)
    kw = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.0}
    w = torch.nn.Parameter(params[0].clone())
    opt = RotatedAdamW([w], refresh_every=1000, **kw)
    w.grad = grads[0][0].clone()
    opt.step()
    ql, qr = opt.state[w]["Q_L"], opt.state[w]["Q_R"]
    w_rot = torch.nn.Parameter(ql.T @ params[0] @ qr)
    ref = torch.optim.AdamW([w_rot], foreach=False, **kw)
    for step_grads in grads:
        w_rot.grad = ql.T @ step_grads[0] @ qr
        ref.step()
    for step_grads in grads[1:]:
        w.grad = step_grads[0].clone()
        opt.step()
    torch.testing.assert_close(w.detach(), ql @ w_rot.detach() @ qr.T, rtol=0, atol=1e-5)


def test_bases_refresh_every_k_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"eigh": 0, "qr": 0}
    eigh, qr = torch.linalg.eigh, torch.linalg.qr

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(torch.linalg, "eigh", counting("eigh", eigh))
    monkeypatch.setattr(torch.linalg, "qr", counting("qr", qr))
    params, grads = _params_and_grads(3, [(10, 6)], steps=35)
    w = torch.nn.Parameter(params[0].clone())
    opt = RotatedAdamW([w], lr=0.01, refresh_every=10)
    changed = []
    for t, step_grads in enumerate(grads, start=1):
        w.grad = step_grads[0].clone()
        before = opt.state[w]["Q_L"].clone() if opt.state[w] else torch.eye(10)
        opt.step()
        if not torch.equal(before, opt.state[w]["Q_L"]):
            changed.append(t)
    assert changed == [1, 11, 21, 31]
    assert calls == {"eigh": 2, "qr": 2 * 3}  # two sides: eigh at step 1, power step + QR at 11, 21, 31
    assert opt.state[w]["Q_L"].shape == (10, 10) and opt.state[w]["Q_R"].shape == (6, 6)


def test_one_sided_rotates_only_the_smaller_side() -> None:
    tall, wide = torch.nn.Parameter(torch.randn(12, 5)), torch.nn.Parameter(torch.randn(4, 9))
    opt = RotatedAdamW([tall, wide], lr=0.01, one_sided=True)
    tall.grad, wide.grad = torch.randn(12, 5), torch.randn(4, 9)
    opt.step()
    assert set(opt.state[tall]) & {"Q_L", "Q_R"} == {"Q_R"} and opt.state[tall]["Q_R"].shape == (5, 5)
    assert set(opt.state[wide]) & {"Q_L", "Q_R"} == {"Q_L"} and opt.state[wide]["Q_L"].shape == (4, 4)


def test_reprojection_permutes_v_exactly_and_keeps_its_mass() -> None:
    g = torch.Generator().manual_seed(4)
    v = torch.rand(5, 4, generator=g)
    ql, _ = torch.linalg.qr(torch.randn(5, 5, generator=g))
    qr, _ = torch.linalg.qr(torch.randn(4, 4, generator=g))
    perm_l, perm_r = torch.tensor([2, 0, 4, 1, 3]), torch.tensor([3, 1, 0, 2])
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    moved = reproject_second_moment(v, ql, ql[:, perm_l] * signs, qr, qr[:, perm_r])
    torch.testing.assert_close(moved, v[perm_l][:, perm_r])
    other, _ = torch.linalg.qr(torch.randn(5, 5, generator=g))
    mixed = reproject_second_moment(v, ql, other, None, None)
    torch.testing.assert_close(mixed.sum(), v.sum())
    assert (mixed >= 0).all()


def _least_squares(seed: int = 0):
    """min ||A W B − C||² with A, B of condition number 100: the Hessian is (BBᵀ) ⊗ (AᵀA)."""
    g = torch.Generator().manual_seed(seed)

    def ill_conditioned(rows: int, cols: int) -> torch.Tensor:
        u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g))
        v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
        k = min(rows, cols)
        return u[:, :k] @ torch.diag(torch.logspace(0, -2, k)) @ v[:, :k].T

    a, b = ill_conditioned(32, 24), ill_conditioned(16, 20)
    c = a @ torch.randn(24, 16, generator=g) @ b
    return a, b, c


def _fit(make_opt, steps: int = 80) -> list[float]:
    a, b, c = _least_squares()
    w = torch.nn.Parameter(torch.zeros(24, 16))
    opt = make_opt([w])
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (a @ w @ b - c).square().sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    losses.append((a @ w.detach() @ b - c).square().sum().item())
    return losses  # losses[t]: the loss after t steps


@pytest.mark.parametrize("one_sided", [False, True])
def test_rotated_state_stays_consistent_across_refreshes(one_sided: bool) -> None:
    kw = {"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.0}
    rotated = _fit(lambda ps: RotatedAdamW(ps, refresh_every=10, one_sided=one_sided, **kw))
    assert all(torch.isfinite(torch.tensor(rotated)))
    for t in range(11, 80, 10):  # the step-t update is the first one made in a refreshed basis
        assert rotated[t] <= 1.10 * rotated[t - 1], (t, rotated[t - 1], rotated[t])
    assert rotated[-1] < 0.01 * rotated[0]


@pytest.mark.parametrize("one_sided", [False, True])
def test_rotated_beats_adamw_on_ill_conditioned_least_squares(one_sided: bool) -> None:
    """Each at its better learning rate of two.

    At lr <= 0.03 AdamW is ahead after 80 steps: the rotated update moves each eigen-direction by ~lr per
    step, where sign-like AdamW moves the dominant direction faster.
    """

    def best(make_opt) -> float:
        return min(_fit(lambda ps, lr=lr: make_opt(ps, lr))[-1] for lr in (0.1, 0.3))

    kw = {"betas": (0.9, 0.95), "weight_decay": 0.0}
    rotated = best(lambda ps, lr: RotatedAdamW(ps, lr=lr, one_sided=one_sided, **kw))
    adamw = best(lambda ps, lr: torch.optim.AdamW(ps, lr=lr, **kw))
    assert rotated < (0.5 if one_sided else 0.25) * adamw, (rotated, adamw)


def _model_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", ["adamw", "nadam", "rotated_adamw", "rotated_one_sided"])
def test_build_optimizer_trains_and_resumes_exactly(name: str) -> None:
    cfg = InnerConfig(
        rotation="one_sided" if name == "rotated_one_sided" else "two_sided", rotation_refresh=3
    )
    name = "rotated_adamw" if name == "rotated_one_sided" else name
    model = build_model(TINY, seed=0)
    opt = build_optimizer(model, cfg, name)

    def train_step(m, o, step: int) -> float:
        for group in o.param_groups:
            group["lr"] = 1e-3 * (1 + step % 3)
        o.zero_grad(set_to_none=True)
        loss = m.loss(*_model_batch(step))
        loss.backward()
        o.step()
        return loss.item()

    losses = [train_step(model, opt, s) for s in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    clone = copy.deepcopy(model)
    fresh = build_optimizer(clone, cfg, name)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(5, 8):  # crosses a refresh (step 7) in both copies
        train_step(model, opt, s)
        train_step(clone, fresh, s)
    for (n, p), q in zip(model.named_parameters(), clone.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_rotation_groups_split_attention_and_mlp_from_the_rest() -> None:
    model = build_model(TINY, seed=0)
    groups = rotation_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    rotated = sorted(names[id(p)] for p in groups[0]["params"])
    assert len(rotated) == TINY.n_layers * 7
    assert all(".attn.w" in n or ".mlp.w" in n for n in rotated)
    rest = {names[id(p)] for g in groups[1:] for p in g["params"]}
    assert {"embed.weight", "head.weight", "norm.weight"} <= rest
    assert [g["rotate"] for g in groups] == [True, False, False]
    assert groups[2]["weight_decay"] == 0.0 and all(p.ndim == 1 for p in groups[2]["params"])


def test_unknown_optimizer_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="adamw, nadam, rotated_adamw"):
        build_optimizer(build_model(TINY), InnerConfig(), "sgd")
