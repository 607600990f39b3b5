import random

import pytest

from hetnode.planning.layer_split import split_layers


@pytest.mark.parametrize(
    ("n_layers", "capacities", "sizes"),
    [
        (12, [1, 1, 1], [4, 4, 4]),
        (12, [2, 1, 1], [6, 3, 3]),
        (8, [1, 3], [2, 6]),
        (4, [1, 1, 1, 1], [1, 1, 1, 1]),
        (5, [100, 1], [4, 1]),  # every stage keeps at least one layer
        (7, [1, 1, 1], [3, 2, 2]),  # ties go to the earlier stage
        (1, [5.0], [1]),
    ],
)
def test_split_sizes(n_layers, capacities, sizes):
    ranges = split_layers(n_layers, capacities)
    assert [len(r) for r in ranges] == sizes


def test_split_is_contiguous_and_covers_all_layers():
    rng = random.Random(0)
    for _ in range(200):
        stages = rng.randint(1, 8)
        n_layers = rng.randint(stages, 40)
        caps = [rng.uniform(0.1, 10) for _ in range(stages)]
        ranges = split_layers(n_layers, caps)
        assert [i for r in ranges for i in r] == list(range(n_layers))
        assert all(len(r) >= 1 for r in ranges)
        # each stage gets its share rounded, give or take the layers lent to stages whose share is < 1
        shares = [n_layers * c / sum(caps) for c in caps]
        lent = sum(1 for s in shares if s < 1)
        for r, share in zip(ranges, shares, strict=True):
            assert len(r) == 1 or abs(len(r) - share) < 1.0 + lent + 1e-9


@pytest.mark.parametrize(
    ("n_layers", "capacities"), [(2, [1, 1, 1]), (4, []), (4, [1, 0]), (4, [1, float("nan")]), (4, [1, -2])]
)
def test_split_rejects_impossible_inputs(n_layers, capacities):
    with pytest.raises(ValueError):
        split_layers(n_layers, capacities)
