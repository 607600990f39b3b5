"""The FLOP model of the rotated optimiser and the rule that keeps it within a share of a step."""

import pytest

from hetnode.algo.rotation_cost import (
    Bases,
    full_bases,
    overhead,
    plan_bases,
    rotation_flops,
    share,
    step_flops,
)

R = 26 / 3  # one refresh per side, per b³: power step 2 + QR 8/3 + eigenvalue estimate 2 + overlaps 2


def test_two_sided_flops_by_hand() -> None:
    # G is 4×2: G Gᵀ is 2·4·2·4 = 64, Gᵀ G 2·4·2·2 = 32; each rotation is those two products again.
    flops = rotation_flops(4, 2, Bases(4, 2), refresh_every=1)
    assert flops.statistics == 96
    assert flops.rotations == 3 * 96
    # refresh: left R·4·4² + v moved 64, right R·2·2² + 32
    assert flops.refresh == pytest.approx(R * 64 + 64 + R * 8 + 32)
    assert flops.eigh_once == pytest.approx(9 * 64 + 9 * 8)
    assert rotation_flops(4, 2, Bases(4, 2), refresh_every=2).refresh == pytest.approx(flops.refresh / 2)
    assert flops.per_step == pytest.approx(96 + 288 + R * 72 + 96)


def test_one_sided_and_blocked_flops_by_hand() -> None:
    right = rotation_flops(4, 2, Bases(0, 2), refresh_every=1)
    assert (right.statistics, right.rotations) == (32, 96)
    assert right.refresh == pytest.approx(R * 8 + 32)
    blocked = rotation_flops(4, 2, Bases(2, 0), refresh_every=1)  # two 2×2 blocks on the left
    assert (blocked.statistics, blocked.rotations) == (32, 96)
    assert blocked.refresh == pytest.approx(R * 4 * 4 + 32)
    assert blocked.eigh_once == pytest.approx(9 * 4 * 4)
    assert rotation_flops(4, 2, Bases(0, 0), refresh_every=1).per_step == 0
    with pytest.raises(ValueError, match="does not divide"):
        rotation_flops(4, 2, Bases(3, 0), refresh_every=1)


def test_share_is_over_the_matrix_own_step() -> None:
    assert step_flops(8, 10) == 480
    per_step = rotation_flops(4, 2, Bases(4, 2), refresh_every=1).per_step
    assert share(4, 2, Bases(4, 2), tokens=10, refresh_every=1) == pytest.approx(per_step / 480)
    # without the refresh, two-sided is 8·m·n·(m+n) / (6·m·n·T) = 4(m+n)/(3T)
    big = share(1024, 1024, Bases(1024, 1024), tokens=16384, refresh_every=10**9)
    assert big == pytest.approx(4 * 2048 / (3 * 16384), rel=1e-6)


def test_full_bases_one_sided_takes_the_smaller_side_right_when_square() -> None:
    assert full_bases(3, 5, one_sided=False) == Bases(3, 5)
    assert full_bases(3, 5, one_sided=True) == Bases(3, 0)
    assert full_bases(5, 3, one_sided=True) == Bases(0, 3)
    assert full_bases(4, 4, one_sided=True) == Bases(0, 4)


@pytest.mark.parametrize(
    ("m", "n", "tokens", "expected", "richer"),
    [
        (128, 128, 10**6, Bases(128, 128), None),  # a big batch: the paper's two-sided rotation fits
        (128, 128, 2048, Bases(0, 128), Bases(128, 128)),  # tiny's attention: 16.7 % + refresh, then 9.4 %
        (1024, 2560, 16384, Bases(1024, 0), Bases(1024, 2560)),  # 178m's down projection (left: 1024 < 2560)
        (2048, 2048, 8192, Bases(0, 512), Bases(0, 1024)),  # 1b's attention: blocks of 1024 are 17 %
        (5504, 2048, 8192, Bases(0, 512), Bases(0, 1024)),  # 1b's gate and up projections
        (384, 384, 2048, Bases(0, 128), Bases(0, 192)),  # small's attention: 384 = 3·128 = 2·192
    ],
)
def test_plan_picks_the_richest_bases_within_the_budget(
    m: int, n: int, tokens: int, expected: Bases, richer: Bases | None
) -> None:
    assert plan_bases(m, n, tokens, budget=0.10, refresh_every=10) == expected
    assert share(m, n, expected, tokens, 10) <= 0.10
    if richer is not None:  # the next richer choice does not fit
        assert share(m, n, richer, tokens, 10) > 0.10


def test_plan_respects_one_sided_and_gives_up_below_two_by_two_blocks() -> None:
    assert plan_bases(64, 32, 10**9, budget=0.1, refresh_every=10, one_sided=True) == Bases(0, 32)
    assert plan_bases(64, 32, 1, budget=0.1, refresh_every=10) == Bases(0, 0)
    with pytest.raises(ValueError):
        plan_bases(64, 32, 0, budget=0.1, refresh_every=10)


def test_overhead_counts_every_parameter_in_the_step_and_only_rotated_matrices_in_the_cost() -> None:
    shapes = {"w": (4, 2), "plain": (3, 3), "norm": (3,)}
    cost = overhead(shapes, lambda name, _: name == "w", tokens=10, refresh_every=1, choose=full_bases_two)
    assert cost.step == 6 * (8 + 9 + 3) * 10
    assert cost.flops == rotation_flops(4, 2, Bases(4, 2), 1)
    assert cost.per_step == pytest.approx(cost.flops.per_step / cost.step)
    assert cost.eigh_once == pytest.approx((9 * 64 + 9 * 8) / cost.step)


def full_bases_two(m: int, n: int) -> Bases:
    return full_bases(m, n, one_sided=False)
