"""Two workers of one stage pool are not copies of each other: each trains its own copy of the stage's slice,
from the same θ and the same seed, on the micro-batches routed to it, and the verifier's copy screen
(`Verifier._duplicates`: top-k overlap at or above the round's `duplicate_level`, never below
DUPLICATE_FLOOR = 0.5) must not take one for the other's copy.

The real code: `StageTraining` (the daemon's chain member) on tiny, a two-stage chain whose stage `pooled`
is held by two workers, micro-batches routed to them in turn (1F1B, weight delay 1, as on the wire), one
round of H = 30 (15 micro-batches each) from a fresh θ, where overlaps are highest (Adam's first steps
agree). Measured on CPU, beside a second chain of the same shape (`c1-1`, another data slot):
- pooled last stage: pool pair 0.367 in round 0 and 0.351 in round 1 (error feedback carried, θ after the
  first seal), against 0.31–0.36 between a pool worker and the same stage of the other chain;
- pooled first stage: pool pair 0.195, against 0.165 to the other chain's first stage.
A pool's workers overlap as two chains do, far under the floor: the screen never calls them a copy."""

from __future__ import annotations

import pytest

from bootstrap.verifier import DUPLICATE_FLOOR, Verifier, _sparse_of
from hetnode.algo.scoring import index_overlap
from hetnode.daemon.stage_training import StageTraining
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.planning.rounds import NUM_DATA_SLOTS, assigned_batches
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding

pytestmark = pytest.mark.slow

CHAIN = "c1-0"


def _pool_round(config, dataset, theta, pooled: int) -> dict[str, dict[str, bytes]]:
    """One round of a two-stage chain whose stage `pooled` has two workers: {peer: its payloads}."""
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    held = {i: 2 if i == pooled else 1 for i in range(2)}
    stages = {
        i: [StageTraining(config, splits, i, CHAIN, dataset if i == 0 else None) for _ in range(held[i])]
        for i in range(2)
    }
    firsts, lasts = stages[0], stages[1]
    for stage in firsts + lasts:
        stage.rebase(stage.rebase_from(theta))
    for stage in firsts:
        stage.begin_round(0)
    for stage in lasts:
        stage.begin_round(0, firsts[0].drift_base)
    batches = assigned_batches(CHAIN, 0, config.outer.inner_steps, config.outer.step_cap)
    waiting = []  # the last stage's gradient for the previous micro-batch: weight delay 1 on the first
    for i, mb in enumerate(batches):
        first, last = firsts[i % len(firsts)], lasts[i % len(lasts)]  # a pool's workers in turn
        frame = first.forward(mb, dataset.train_batch(firsts[0].slot, NUM_DATA_SLOTS, mb))
        if waiting:
            before, j, grad = waiting.pop()
            firsts[j % len(firsts)].backward(before, grad)
        last.forward(mb, frame)
        waiting.append((mb, i, last.backward(mb)))
    for before, j, grad in waiting:
        firsts[j % len(firsts)].backward(before, grad)
    return {
        f"stage-{i}/{k}": stage.end_round(0, f"stage-{i}/{k}")
        for i, group in stages.items()
        for k, stage in enumerate(group)
    }


def test_two_workers_of_a_pool_are_not_copies(tiny_config):
    config, pooled = tiny_config, 1  # the first stage takes no pool (docs/chains.md, "Pools")
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    theta = GlobalModel(config)
    payloads = _pool_round(config, dataset, theta, pooled)
    contributions = [(peer, theta.decode_contribution(peer, 0, p)) for peer, p in payloads.items()]
    a, b = (_sparse_of(dict(contributions)[f"stage-{pooled}/{k}"]) for k in range(2))
    assert set(a) == set(b)  # the same tensors: the pool's slice
    overlap = index_overlap(a, b)
    assert 0.1 < overlap < DUPLICATE_FLOOR, overlap  # measured 0.367
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    assert "copy" not in Verifier(config, dataset, model).screen(0, contributions).values()
