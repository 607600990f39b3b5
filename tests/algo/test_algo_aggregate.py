"""Aggregation and outer steps (docs/sync.md)."""

import random

import pytest
import torch

from hetnode.algo.aggregate import (
    AGGREGATION_RULES,
    MAX_WEIGHT,
    NesterovOuter,
    aggregate_dense,
    aggregate_sparse,
    contribution_parts,
    outer_sgd_step,
    trim_count,
    weighted_median,
)
from hetnode.algo.sparseloco import SparseLoCoCodec


def _sp(idx: list[int], vals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(idx, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32)


def test_single_and_shared_coordinates() -> None:
    # equal norms (5) → no clipping
    contribs = [
        ("peer-a", {"w": _sp([0, 1], [3.0, 4.0])}),
        ("peer-b", {"w": _sp([1, 3], [4.0, -3.0])}),
    ]
    out = aggregate_sparse(contribs, {"w": (2, 2), "unused": (3,)}, rule="selectors")
    assert out["w"].tolist() == [[3.0, 4.0], [0.0, -3.0]]
    assert out["w"].dtype == torch.float32
    assert torch.equal(out["unused"], torch.zeros(3))


def test_median_clipping_scales_outlier_only() -> None:
    contribs = [
        ("a", {"w": _sp([0], [1.0])}),
        ("b", {"w": _sp([1], [2.0])}),
        ("c", {"w": _sp([2, 3], [30.0, 40.0])}),  # norm 50, median norm is 2
    ]
    out = aggregate_sparse(contribs, {"w": (4,)}, rule="selectors")
    assert torch.allclose(out["w"], torch.tensor([1.0, 2.0, 1.2, 1.6]))
    # even count: lower median (1.0) → b is scaled down to norm 1, a untouched, never scaled up
    out2 = aggregate_sparse(contribs[:2], {"w": (4,)}, rule="selectors")
    assert out2["w"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_mean_uses_clipped_values() -> None:
    contribs = [
        ("a", {"w": _sp([0], [1.0])}),
        ("b", {"w": _sp([0], [1.0])}),
        ("c", {"w": _sp([0, 1], [-6.0, 8.0])}),  # norm 10 → scaled to 1: (-0.6, 0.8)
    ]
    out = aggregate_sparse(contribs, {"w": (2,)}, rule="selectors")
    assert torch.allclose(out["w"], torch.tensor([(1.0 + 1.0 - 0.6) / 3, 0.8]))


def _codec_contributions(count: int, shapes: dict[str, tuple[int, ...]]) -> list:
    codec = SparseLoCoCodec()
    contribs = []
    for i in range(count):
        cts = {n: codec.compress(torch.randn(s) * (i + 1)) for n, s in shapes.items()}
        contribs.append((f"peer-{i:02d}", {n: codec.sparse(ct) for n, ct in cts.items()}))
    return contribs


@pytest.mark.parametrize("rule", AGGREGATION_RULES)
def test_order_independent_bit_identical(rule: str) -> None:
    """Every rule is a function of the set of contributions: any input order, the same bits, every time."""
    torch.manual_seed(3)
    shapes = {"w": (128, 192), "b": (257,)}
    contribs = _codec_contributions(7, shapes)
    # shared coordinates with equal and opposite values: ties and signed zeros in the trimmed mean's sort
    contribs.append(("peer-tie", {"w": _sp([0, 1, 2], [1.0, -1.0, 0.0]), "b": _sp([5], [-0.0])}))
    contribs.append(("peer-tie2", {"w": _sp([0, 1, 2], [1.0, -1.0, -0.0]), "b": _sp([5], [0.0])}))
    ref = aggregate_sparse(contribs, shapes, rule=rule)
    assert all(torch.equal(aggregate_sparse(contribs, shapes, rule=rule)[n], ref[n]) for n in shapes)
    rng = random.Random(0)
    for _ in range(5):
        shuffled = contribs[:]
        rng.shuffle(shuffled)
        out = aggregate_sparse(shuffled, shapes, rule=rule)
        for n in shapes:
            assert torch.equal(out[n], ref[n])
            assert out[n].view(torch.int32).equal(ref[n].view(torch.int32))  # bits, signed zeros included


def test_dense_order_independent() -> None:
    torch.manual_seed(3)
    shapes = {"w": (128, 192), "b": (257,)}
    dense = [(c, {n: torch.randn(s) for n, s in shapes.items()}) for c in ("x", "y", "z", "w")]
    ref_d = aggregate_dense(dense)
    out_d = aggregate_dense(dense[::-1])
    assert all(torch.equal(out_d[n], ref_d[n]) for n in shapes)
    assert torch.allclose(ref_d["w"], torch.stack([d["w"] for _, d in dense]).mean(0), atol=1e-6)


def test_rule_definitions() -> None:
    # selectors vs mean: b (norm 2) is scaled to the median norm 1 first
    contribs = [("a", {"w": _sp([0], [1.0])}), ("b", {"w": _sp([1], [2.0])}), ("c", {"w": _sp([0], [1.0])})]
    assert aggregate_sparse(contribs, {"w": (2,)}, rule="selectors")["w"].tolist() == [1.0, 1.0]
    assert torch.allclose(
        aggregate_sparse(contribs, {"w": (2,)}, rule="mean")["w"], torch.tensor([2 / 3, 1 / 3])
    )
    # pooled: 3 selections over 2 selected coordinates, n̄ = 1.5 for every coordinate
    assert torch.allclose(
        aggregate_sparse(contribs, {"w": (2,)}, rule="pooled")["w"], torch.tensor([2 / 1.5, 1 / 1.5])
    )
    # clip: every value capped at the median of the contributors' largest |value| (4, 4, 5 → 4)
    contribs = [
        ("a", {"w": _sp([0, 1], [3.0, 4.0])}),
        ("b", {"w": _sp([1, 2], [4.0, -3.0])}),
        ("c", {"w": _sp([3], [5.0])}),
    ]
    assert aggregate_sparse(contribs, {"w": (4,)}, rule="clip")["w"].tolist() == [3.0, 4.0, -3.0, 4.0]
    # trimmed, N = 5 so b = 1: coordinate 0 sees (1, 1, 1, 0, −1) → mean(0, 1, 1); coordinate 1, selected by
    # d alone, sees (0, 0, 0, 1, 0) → 0: a lone selector is trimmed away
    contribs = [(p, {"w": _sp([0], [1.0])}) for p in "abc"]
    contribs += [("d", {"w": _sp([1], [1.0])}), ("e", {"w": _sp([0], [-1.0])})]
    out = aggregate_sparse(contribs, {"w": (3,)}, rule="trimmed")["w"]
    assert torch.allclose(out, torch.tensor([2 / 3, 0.0, 0.0]))
    # two senders: nothing to trim, the trimmed mean is the mean
    two = contribs[:1] + contribs[3:4]
    assert torch.equal(
        aggregate_sparse(two, {"w": (3,)}, rule="trimmed")["w"],
        aggregate_sparse(two, {"w": (3,)}, rule="mean")["w"],
    )
    assert [trim_count(n) for n in (1, 2, 3, 9, 10, 15)] == [0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        aggregate_sparse(contribs, {"w": (3,)}, rule="median")


def test_one_identity_on_a_support_nobody_chose() -> None:
    """Under "selectors" a lone identity moves θ by the median norm, under "mean" by 1/N of it, under "pooled"
    by 1/n̄ of it (as much as each honest peer), under "trimmed" not at all."""
    honest = [(f"h{i}", {"w": _sp([0, 1], [0.6, 0.8])}) for i in range(4)]
    attacker = ("x", {"w": _sp([2, 3], [30.0, -40.0])})  # norm 50, scaled to the median norm 1
    shapes = {"w": (4,)}
    moved = {
        rule: aggregate_sparse([*honest, attacker], shapes, rule=rule)["w"][2:].norm().item()
        for rule in AGGREGATION_RULES
    }
    assert moved["selectors"] == pytest.approx(1.0) and moved["clip"] < 1.0
    assert moved["mean"] == pytest.approx(1 / 5) and moved["trimmed"] == 0.0
    assert moved["pooled"] == pytest.approx(1 / 2.5)  # 10 selections over 4 coordinates: n̄ = 2.5


def test_aggregate_rejects_bad_contributions() -> None:
    shapes = {"w": (4,)}
    with pytest.raises(ValueError):
        aggregate_sparse([("a", {"w": _sp([0], [1.0])}), ("a", {"w": _sp([1], [1.0])})], shapes)
    with pytest.raises(ValueError):
        aggregate_sparse([("a", {"w": _sp([4], [1.0])})], shapes)
    with pytest.raises(ValueError):
        aggregate_sparse([("a", {"w": _sp([1, 1], [1.0, 2.0])})], shapes)
    with pytest.raises(ValueError):
        aggregate_sparse([("a", {"v": _sp([1], [1.0])})], shapes)
    with pytest.raises(ValueError):
        aggregate_sparse([("a", {"w": _sp([1], [float("nan")])})], shapes)
    assert aggregate_dense([]) == {}


def test_outer_sgd_matches_torch_sgd() -> None:
    torch.manual_seed(4)
    for wd in (0.0, 0.1):
        init = {"a": torch.randn(16, 8), "b": torch.randn(5)}
        mine = {n: t.clone() for n, t in init.items()}
        ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        opt = torch.optim.SGD(list(ref.values()), lr=0.7, weight_decay=wd)
        for _ in range(3):
            delta = {n: torch.randn_like(t) for n, t in init.items()}
            outer_sgd_step(mine, delta, lr=0.7, weight_decay=wd)
            for n, p in ref.items():
                p.grad = delta[n].clone()
            opt.step()
        for n in init:
            assert torch.allclose(mine[n], ref[n].detach(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        outer_sgd_step({"a": torch.zeros(2)}, {"b": torch.zeros(2)})


def test_nesterov_matches_torch_sgd() -> None:
    torch.manual_seed(5)
    init = {"a": torch.randn(16, 8), "b": torch.randn(5)}
    mine = {n: t.clone() for n, t in init.items()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    for step in range(6):
        delta = {n: torch.randn_like(t) for n, t in init.items()}
        outer.step(mine, delta)
        for n, p in ref.items():
            p.grad = delta[n].clone()
        opt.step()
        for n in init:
            assert torch.allclose(mine[n], ref[n].detach(), rtol=1e-6, atol=1e-6)
        if step == 2:  # checkpoint round trip mid-run
            restored = NesterovOuter(lr=0.1, momentum=0.1)
            restored.load_state_dict(outer.state_dict())
            outer = restored
    assert outer.lr == 0.7 and outer.momentum == 0.9


# --- weights (earned by verified history; docs/security.md, "Steer the update", docs/security.md)
# --------------------------------------


@pytest.mark.parametrize("rule", AGGREGATION_RULES)
def test_weight_one_is_the_unweighted_rule_bit_for_bit(rule: str) -> None:
    torch.manual_seed(6)
    shapes = {"w": (64, 64), "b": (65,)}
    contribs = _codec_contributions(5, shapes)
    plain = aggregate_sparse(contribs, shapes, rule=rule)
    ones = aggregate_sparse(contribs, shapes, rule=rule, weights={who: 1 for who, _ in contribs})
    for n in shapes:
        assert plain[n].view(torch.int32).equal(ones[n].view(torch.int32))


@pytest.mark.parametrize("rule", ["mean", "selectors", "pooled", "clip"])
def test_a_weight_counts_as_that_many_identical_contributors(rule: str) -> None:
    """Weight w is w peers sending the same values: the median norm, the clip bound and the means agree."""
    torch.manual_seed(7)
    shapes = {"w": (64, 64), "b": (65,)}
    contribs = _codec_contributions(4, shapes)
    weights = {"peer-00": 3, "peer-01": 1, "peer-02": 2, "peer-03": 1}
    copies = [(f"{who}/{i}", upd) for who, upd in contribs for i in range(weights[who])]
    weighted = aggregate_sparse(contribs, shapes, rule=rule, weights=weights)
    replicated = aggregate_sparse(copies, shapes, rule=rule)
    for n in shapes:
        assert torch.allclose(weighted[n], replicated[n], rtol=1e-5, atol=1e-7), n


def test_the_median_norm_is_taken_over_weight_not_headcount() -> None:
    """Five light Sybils with tiny norms cannot pull the clip down onto two heavy honest peers."""
    honest = [(f"h{i}", {"w": _sp([i], [1.0])}) for i in range(2)]
    sybils = [(f"s{i}", {"w": _sp([2 + i], [0.01])}) for i in range(5)]
    shapes = {"w": (8,)}
    by_head = aggregate_sparse(honest + sybils, shapes, rule="selectors")
    assert by_head["w"][0] == pytest.approx(0.01)  # headcount: the Sybils' median clips the honest to 0.01
    weights = {"h0": 8, "h1": 8} | {f"s{i}": 1 for i in range(5)}
    by_weight = aggregate_sparse(honest + sybils, shapes, rule="selectors", weights=weights)
    assert by_weight["w"][0] == 1.0 and by_weight["w"][1] == 1.0  # the honest are not scaled at all
    mean = aggregate_sparse(honest + sybils, shapes, rule="mean", weights=weights)
    assert mean["w"][0] == pytest.approx(8 / 21) and mean["w"][2] == pytest.approx(0.01 / 21)


def test_the_weighted_trim_cuts_weight_not_heads() -> None:
    """N = 5 senders, trim_count 1: with equal weights one value is cut at each end; a sender holding most of
    the weight cannot be trimmed away by four light outliers, and the parts still add up to Δ."""
    shapes = {"w": (1,)}
    contribs = [("a", {"w": _sp([0], [1.0])})] + [(f"x{i}", {"w": _sp([0], [-1.0])}) for i in range(4)]
    equal = aggregate_sparse(contribs, shapes, rule="trimmed")
    assert equal["w"][0] == pytest.approx(-1.0)  # the lone +1 is cut
    weights = {"a": 8, "x0": 1, "x1": 1, "x2": 1, "x3": 1}  # W = 12, b = 12/5 = 2.4 cut at each end
    heavy = aggregate_sparse(contribs, shapes, rule="trimmed", weights=weights)
    assert heavy["w"][0] == pytest.approx((1.6 * -1.0 + 5.6 * 1.0) / 7.2)
    parts = contribution_parts(contribs, shapes, rule="trimmed", weights=weights)
    total = sum(float(parts[who]["w"][1].sum()) for who, _ in contribs)
    assert total == pytest.approx(float(heavy["w"][0]))


def test_weights_are_checked() -> None:
    contribs = [("a", {"w": _sp([0], [1.0])}), ("b", {"w": _sp([1], [1.0])})]
    for bad in ({"a": 1}, {"a": 0, "b": 1}, {"a": -2, "b": 1}, {"a": 1.5, "b": 1}, {"a": True, "b": 1}):
        with pytest.raises(ValueError, match="weight"):
            aggregate_sparse(contribs, {"w": (2,)}, weights=bad)
    with pytest.raises(ValueError, match="weight"):
        aggregate_sparse(contribs, {"w": (2,)}, weights={"a": MAX_WEIGHT + 1, "b": 1})


def test_the_seal_schema_bounds_weight_as_the_aggregate_does() -> None:
    from hetnode.wire.seals import MAX_SEAL_WEIGHT

    assert MAX_SEAL_WEIGHT == MAX_WEIGHT


def test_weighted_median() -> None:
    values = torch.tensor([5.0, 1.0, 3.0])
    assert weighted_median(values, [1, 1, 1]) == 3.0
    assert weighted_median(values, [1, 5, 1]) == 1.0
    assert weighted_median(values, [4, 1, 1]) == 5.0
    assert weighted_median(torch.tensor([2.0, 1.0]), [1, 1]) == torch.median(torch.tensor([2.0, 1.0]))


@pytest.mark.parametrize("rule", AGGREGATION_RULES)
def test_weighted_rules_are_order_independent_bit_for_bit(rule: str) -> None:
    torch.manual_seed(8)
    shapes = {"w": (64, 96), "b": (129,)}
    contribs = _codec_contributions(6, shapes)
    contribs.append(("peer-tie", {"w": _sp([0, 1, 2], [1.0, -1.0, 0.0]), "b": _sp([5], [-0.0])}))
    weights = {who: 1 + (i * 5) % 7 for i, (who, _) in enumerate(contribs)}
    ref = aggregate_sparse(contribs, shapes, rule=rule, weights=weights)
    rng = random.Random(1)
    for _ in range(3):
        shuffled = contribs[:]
        rng.shuffle(shuffled)
        out = aggregate_sparse(shuffled, shapes, rule=rule, weights=weights)
        assert all(out[n].view(torch.int32).equal(ref[n].view(torch.int32)) for n in shapes)
