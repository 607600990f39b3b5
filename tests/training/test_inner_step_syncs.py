"""An anchor's inner steps never make the host wait for the device: counted on CPU with `HostSyncs` (every
read of a tensor's value reaches `aten._local_scalar_dense` on CPU too, so the count is the GPU path's).

torch's AdamW keeps its step counters on the host even for a GPU's parameters and reads them each step;
those reads wait for nothing and are counted apart (`optimizer_step_counters`)."""

from __future__ import annotations

import math

import pytest
import torch

from hetnode.config import Config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.model import build_model
from hetnode.replica.global_model import GlobalModel
from hetnode.training.host_syncs import HostSyncs, optimizer_step_counters
from hetnode.training.trainer import InnerTrainer, StepResult

H = 4


@pytest.fixture(scope="module")
def small(tiny_config: Config) -> Config:
    """tiny, on small batches: what a step reads does not depend on its batch's size."""
    return replace(tiny_config, "data", batch_size=2, seq_len=32)


@pytest.fixture(scope="module")
def dataset(small: Config) -> TokenDataset:
    return TokenDataset.build(small.data, small.model.vocab_size, seed=small.run.seed)


def _anchor(config: Config, dataset: TokenDataset) -> AnchorTraining:
    training = AnchorTraining(config, dataset, "peer-a")
    training.rebase(training.rebase_from(GlobalModel(config), next_round=0))
    return training


def _count_steps(trainer: InnerTrainer) -> list[HostSyncs]:
    """Count each of `trainer`'s steps on its own (inside any counter around them): one entry a step."""
    counted, step = [], trainer.train_step

    def counting_step(*args: object, **kwargs: object) -> StepResult:
        with HostSyncs(optimizer_step_counters(trainer.optimizer)) as syncs:
            result = step(*args, **kwargs)
        counted.append(syncs)
        return result

    trainer.train_step = counting_step  # type: ignore[method-assign]
    return counted


def _round_syncs(config: Config, dataset: TokenDataset, steps: int) -> tuple[int, list[HostSyncs]]:
    """The syncs of a whole round of `steps` inner steps (H), and those of each step."""
    config = replace(config, "outer", inner_steps=steps)
    training = _anchor(config, dataset)
    per_step = _count_steps(training.trainer)
    with HostSyncs(optimizer_step_counters(training.trainer.optimizer)) as whole:
        trained = training.train_round(0)
    assert trained.steps == steps and trained.payloads and math.isfinite(trained.loss)
    return whole.count, per_step


def test_an_anchor_round_makes_no_host_sync_inside_its_steps(small: Config, dataset: TokenDataset):
    syncs, per_step = _round_syncs(small, dataset, H)
    assert [s.count for s in per_step] == [0] * H
    # the only reads in a step are AdamW's host-side step counters (one per parameter)
    params = len(list(build_model(small.model).parameters()))
    assert [s.host_reads for s in per_step] == [params] * H
    # a round's reads (the loss, the finite check, the close) do not grow with its steps
    twice, _ = _round_syncs(small, dataset, 2 * H)
    assert 0 < syncs == twice


def test_a_paced_round_makes_no_host_sync_inside_its_steps(small: Config, dataset: TokenDataset):
    config = replace(small, "outer", schedule="paced", inner_steps=H, min_inner_steps=1)
    training = _anchor(config, dataset)
    training.budget_s, training.step_s = 3600.0, 1e-3  # room for the cap: the paced loop decides each step
    per_step = _count_steps(training.trainer)
    trained = training.train_round(0)
    assert trained.steps == config.outer.step_cap == len(per_step)
    assert [s.count for s in per_step] == [0] * trained.steps
    assert training.step_s is not None and training.step_s > 0 and trained.timing.train_s > 0


@pytest.mark.parametrize("optimizer", ["adamw", "nadam"])
def test_inner_optimisers_make_no_host_sync_per_step(small: Config, dataset: TokenDataset, optimizer: str):
    config = replace(small, "inner", optimizer=optimizer)
    trainer = InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)
    trainer.deferred_checks = True
    per_step = _count_steps(trainer)
    for _ in range(3):
        trainer.train_step()
    assert [s.count for s in per_step] == [0, 0, 0]


def test_rotated_adamw_syncs_only_when_it_refreshes_its_bases(small: Config, dataset: TokenDataset):
    """Where the rotated optimiser waits for the device (hetnode/algo/rotated_adam.py), measured: the
    steps between basis refreshes make no host sync."""
    config = replace(small, "inner", optimizer="rotated_adamw", rotation_refresh=3)
    trainer = InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)
    trainer.deferred_checks = True
    per_step = _count_steps(trainer)
    for _ in range(7):
        trainer.train_step()
    refreshes = {0, 3, 6}  # bases refresh at optimiser steps 1, 1 + k, 1 + 2k
    assert [s.count for i, s in enumerate(per_step) if i not in refreshes] == [0] * 4


def test_a_non_finite_step_never_reaches_a_payload_or_the_saved_state(small: Config, dataset: TokenDataset):
    config = replace(small, "outer", inner_steps=H)
    training = _anchor(config, dataset)
    saved: list[dict] = []
    training.on_rebased = saved.append
    with torch.no_grad():
        next(training.model.parameters()).fill_(float("nan"))  # every loss from here is NaN
    with pytest.raises(FloatingPointError, match="non-finite training loss at step 0"):
        training.train_round(0)
    assert training.trainer.step == H  # the steps ran without a sync; the round's end caught it
    assert training.local.unsent == {}  # nothing was compressed
    training.rebase(training.rebase_from(GlobalModel(config), next_round=1))
    assert saved == []  # the state on disk stays the last finite one


def test_without_deferred_checks_a_non_finite_loss_raises_before_the_step(
    small: Config, dataset: TokenDataset
):
    trainer = InnerTrainer(small, build_model(small.model, seed=small.run.seed), dataset)
    first = next(trainer.model.parameters())
    with torch.no_grad():
        first.fill_(float("nan"))
    others = [p.detach().clone() for p in list(trainer.model.parameters())[1:]]
    with pytest.raises(FloatingPointError, match="at step 0"):
        trainer.train_step()
    assert trainer.step == 0
    assert all(torch.equal(a, p) for a, p in zip(others, list(trainer.model.parameters())[1:], strict=True))
