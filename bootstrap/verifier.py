"""Verified contributions (docs/security.md, "Send useless or harmful work"): the coordinator weighs and
credits only work that helps, and counts identities by the weight their verified history earned
(`bootstrap/earned_weight.py`), never by headcount.

Two passes per round:
- `screen`, at seal time, over every valid contribution (cheap: no forward pass). A contribution is left
  out of the seal when its header says it was trained from an older θ (`stale`), when it is one of a group
  of near-identical contributions and not the one the group is sealed under (`copy`: one training, one
  weight and one credit, in any read order; `duplicate_level`), when its norm is far outside the round's
  weighted median (`norm`: free riders and scaled payloads; identities without weight cannot move that
  median, so honest work is never out for being large beside many small Sybils), when its author's score
  average is negative (`score`), or when its author has no verified round yet (`probation`).
- `score`, beside the seal (the coordinator's bookkeeping worker, `bootstrap/bookkeeping.py`), on θ before
  the round's step: each drawn replica's update is applied alone at a reduced step, clipped to the round's
  weighted median norm, and the loss change is measured on one of the batches it was assigned this round
  and on a held-out batch, both drawn from our secret. A chain's stages take the chain's score, and each
  stage's part is also tried alone, and where that hurts, the chain without it (`stage_score`): a stage
  whose part hurts its chain is judged by it, a stage whose part helps is never judged negative for a
  neighbour's (no framing). A chain with a pool (several workers on one
  stage, each its own copy of the slice) is tried per combination of one worker a stage, and each worker
  takes the best combination it is in. Improvements become relative scores
  (`hetnode.algo.scoring`), an exponential average per peer and the weight it earns. The score of round t
  reaches them when the worker is done with it: usually before round t+1 is sealed, at worst a round or
  two later.

A peer is judged on MIN_SCORES scores or more (one round on a few sequences is noisy). When every valid
contribution of a round is screened out for its author's record (`score` or `probation`), `helps` is asked
instead: the contributions whose update alone would score non-negative against the last scored round's
yardstick are sealed (a run's first rounds, when nobody has history; a chain left alone after its anchor
died), while their credit still waits for their record.

Which replicas are scored is drawn per round from our secret, after the announcements are fixed: each
with chance verify_sample · w / W for its share of the round's weight (equal weights: verify_sample / R),
at least `outer.verify_min_chance` (small swarms: all); replicas on
probation have a budget of their own, up to `verify_sample` of them a round. Being scored in
round r says nothing about round r+1. Draws, batches and held-out text are published only with the scores.

The coordinator credits a contribution only when it was sealed and its author's average is not negative.

Threads: `score` runs in the worker's thread and is the only writer of the averages and weights; `screen`
and `helps` run for the seal meanwhile and only read them (single dict reads and writes, atomic in
CPython). `score` runs the model it was given; `helps` runs a twin of it (the same tensors, its own module
objects), since `functional_call` swaps a module's parameters while it runs.

Device (`hetnode bootstrap --device`): the forwards run where the model it was given lives, θ and each
trial's update copied there (`bootstrap/device_forwards.py`), in bf16 autocast on CUDA; every decision on
their results (norms, medians, scales, averages, weights) is taken on CPU in float64 or Python floats.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from bootstrap.device_forwards import batches_on, dense_on, model_device, on_device
from bootstrap.earned_weight import EarnedWeight
from bootstrap.ledger import Verdict
from hetnode.algo.aggregate import weighted_median
from hetnode.algo.scoring import (
    SCORE_MARGIN,
    batch_loss,
    improvement_scale,
    index_overlap,
    loss_improvement,
    relative_scores,
    stage_score,
    update_norm,
)
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.planning.roles import lineage_of
from hetnode.planning.rounds import NUM_DATA_SLOTS, assigned_batches, data_slot
from hetnode.training.precision import autocast_for
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

# Two contributions are one training (a group sealed under one member) when their top-k overlap stands
# out of what the round's honest pairs show: at least DUPLICATE_MARGIN above the weighted median overlap of
# the round's pairs (each pair weighs as its lighter member: identities without history do not count),
# and never below DUPLICATE_FLOOR or above DUPLICATE_CEILING. Measured (benchmarks/results/overlap-issue34/,
# BENCHMARKS.md): honest pairs of one round sit within ±0.03 of each other, at a level set by H and the
# stage of training (tiny: ≈ 0.2 at H = 30, 0.30 at H = 10, 0.73 at H = 1 from a fresh θ, Adam's sign-like
# first step), and a copy that moves a fraction f of its positions overlaps its original at 1 − f. At
# H = 30 a copy must move over half its positions to escape, which leaves it more noise than work.
DUPLICATE_FLOOR = 0.5
DUPLICATE_MARGIN = 0.15
DUPLICATE_CEILING = 0.95
# A contribution whose norm is this far above, or below, the round's weighted median is left out. Above:
# scaled payloads sit hundreds of times over, and an honest replica left out for some rounds sends its
# accumulated error feedback, up to 1/(1-β) = 20 rounds' worth: it must not be locked out by it (seen in
# the lab). Below: a free rider sends a thousandth.
NORM_ABOVE = 64.0
NORM_BELOW = 8.0
MIN_FOR_NORM_BAND = 3  # with fewer contributions the median says nothing about who is odd
AVERAGE_WEIGHT = 0.5  # of the newest score in a peer's exponential average (which starts at 0)
MIN_SCORES = 2  # scores a peer needs before its average can refuse it weight or credit
TRIAL_STEP = 0.5  # of the outer learning rate: each update is tried alone at this reduced step
SCORE_SEQUENCES = 4  # sequences per scoring batch: a few forward passes per contribution, not a round's work
MAX_COMBINATIONS = 16  # trials of one pooled chain (`pool_combinations`): each costs a few forward passes

Contribution = tuple[str, list[DecodedPayload]]  # (peer, its decoded payloads)
Sparse = dict[str, tuple]


@dataclass(frozen=True)
class Replica:
    """Whose update a contribution is part of: an anchor alone, or a chain (its stages together)."""

    key: str  # the anchor's peer id, or the chain id
    slot: int  # its data slot: the assigned batches the verifier scores it on
    lineage: str = ""  # whose assigned batches: a chain's lineage (`planning.roles.lineage_of`), else key
    stage: int | None = None  # a chain member's stage (its record's): a pool's workers share it

    @property
    def batches_of(self) -> str:
        return self.lineage or self.key


def replica_of(peer: str, record: Mapping | None) -> Replica:
    """A stage's replica is its chain (from its record), which trains on its lineage's data; anyone else is
    a replica of its own."""
    chain = (record or {}).get("chain") if (record or {}).get("role") == "stage" else None
    if not (isinstance(chain, str) and chain):
        return Replica(peer, data_slot(peer))
    lineage = lineage_of(chain, (record or {}).get("chain_lineage") or "")
    stage = (record or {}).get("stage")
    stage = stage if isinstance(stage, int) and not isinstance(stage, bool) and stage >= 0 else None
    return Replica(chain, data_slot(lineage), lineage, stage)


class Verifier:
    def __init__(
        self, config: Config, dataset: TokenDataset, model: nn.Module, secret: bytes | None = None
    ) -> None:
        """`model`: the whole decoder as anchors train it (T_fix included), used with θ as parameters; the
        forwards run on its device. `secret`: fixed only by benchmarks that compare two runs on the same
        draws; a coordinator's is new in each life."""
        self.config = config
        self.dataset = dataset
        self.model = model
        self.device = model_device(model)
        self._seal_model = _twin(model)  # for `helps`, which runs at the seal while `score` may run
        self.averages: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # scores behind each average
        self.earned = EarnedWeight(config.outer.probation_rounds)
        self.recent_scale: float | None = None  # the last scored round's yardstick (`improvement_scale`)
        self._secret = secret or os.urandom(
            16
        )  # draws, scoring batches, held-out text: nobody can aim at them
        self.last_seconds = 0.0  # scoring time of the last round

    def restore(self, state: Mapping[str, tuple[float | None, int, int | None, int]]) -> None:
        """Take up what an earlier life knew ({peer: (average, scores, weight, strikes)},
        `Ledger.verifier_state`): a restart must not hand every identity a clean slate."""
        for peer, (average, scored, _, _) in state.items():
            if average is not None and scored > 0:
                self.averages[peer] = average
                self.counts[peer] = scored
        self.earned.restore(
            {peer: row[2] for peer, row in state.items()}, {peer: row[3] for peer, row in state.items()}
        )

    def weights(self, peers: Sequence[str]) -> dict[str, int]:
        """The weight each of these sealed peers carries in the seal (`EarnedWeight.in_seal`)."""
        return self.earned.in_seal(peers)

    # --- at seal time --------------------------------------------------------------------------------

    def screen(
        self,
        round_: int,
        contributions: Sequence[Contribution],
        seen_at: Mapping[str, float] | None = None,
        steps: Mapping[str, int] | None = None,
    ) -> dict[str, str]:
        """{peer: reason} for the contributions to leave out of this round's seal. `contributions` are in
        announcement order; `seen_at`: when the sealer first saw each (a copy cannot come before its
        original, which it needs the bytes of); `steps`: the inner steps each claims (paced rounds; None:
        H each)."""
        reasons: dict[str, str] = {}
        for peer, decoded in contributions:
            if any(message.base != round_ - 1 for message in decoded):
                reasons[peer] = "stale"
        updates = {peer: _sparse_of(decoded) for peer, decoded in contributions if peer not in reasons}
        weights = self.earned.counted(updates)
        order = [peer for peer, _ in contributions if peer in updates]
        for peer in self._duplicates(round_, order, updates, weights, seen_at or {}):
            reasons[peer] = "copy"
        pace = self._pace({peer: self._steps(steps, peer) for peer in updates}, weights)
        for peer in self._off_norm(updates, weights, pace):
            reasons.setdefault(peer, "norm")
        for peer in updates:
            if self.judged_negative(peer):
                reasons.setdefault(peer, "score")
            elif self.earned.weight(peer) == 0 and self.earned.anyone:
                reasons.setdefault(peer, "probation")
        return reasons

    def judged_negative(self, peer: str) -> bool:
        """Whether `peer`'s average, over enough scores to judge it, is negative."""
        return self.counts.get(peer, 0) >= MIN_SCORES and self.averages.get(peer, 0.0) < 0

    def _duplicates(
        self,
        round_: int,
        order: Sequence[str],
        updates: Mapping[str, Sparse],
        weights: Mapping[str, int],
        seen_at: Mapping[str, float],
    ) -> set[str]:
        """The members of groups of near-identical contributions (`duplicate_level`; linked in any order)
        other than the one each group is sealed under: the first seen, then the one with the most earned
        weight, then our secret's draw (never the peer id, which identities can grind)."""
        pairs = {
            (a, b): index_overlap(updates[a], updates[b]) for i, a in enumerate(order) for b in order[:i]
        }
        level = duplicate_level(pairs, weights)
        group = {peer: peer for peer in order}

        def root(peer: str) -> str:
            while group[peer] != peer:
                group[peer] = group[group[peer]]
                peer = group[peer]
            return peer

        for (a, b), overlap in pairs.items():
            if overlap >= level and root(a) != root(b):
                group[root(a)] = root(b)
        members: dict[str, list[str]] = {}
        for peer in order:
            members.setdefault(root(peer), []).append(peer)
        out = set()
        for peers in members.values():
            if len(peers) < 2:
                continue
            position = {p: float(i) for i, p in enumerate(order)}  # announcement order, when no time is known
            kept = min(
                peers,
                key=lambda p: (
                    seen_at.get(p, position[p]),
                    -self.earned.weight(p),
                    self._draw(b"keep", round_, p),
                ),
            )
            out.update(p for p in peers if p != kept)
            log.warning(
                "round %d: %s carry one training (top-k overlap >= %.2f): sealed under %s alone",
                round_,
                ", ".join(sorted(p[-8:] for p in peers)),
                level,
                kept[-8:],
            )
        return out

    def _off_norm(
        self, updates: Mapping[str, Sparse], weights: Mapping[str, int], pace: Mapping[str, float]
    ) -> set[str]:
        """Peers whose norm is outside [median / NORM_BELOW, median · NORM_ABOVE] in most shards they sent,
        the median taken per tensor over whoever sent it, by weight (a chain stage sends only its layers;
        identities without history cannot move it). Norms are taken per `pace` (paced rounds: a replica
        that took fewer steps moves less, and is not odd for it)."""
        by_tensor: dict[str, dict[str, float]] = {}
        for peer, update in updates.items():
            for name, values in update.items():
                by_tensor.setdefault(name, {})[peer] = update_norm({name: values}) / pace[peer]
        strikes: dict[str, int] = {}
        sent: dict[str, int] = {}
        for norms in by_tensor.values():
            if len(norms) < MIN_FOR_NORM_BAND:
                continue
            peers = list(norms)
            held = [weights[p] for p in peers]
            held = held if any(held) else [1] * len(held)  # only newcomers sent it: all equal
            median = float(
                weighted_median(torch.tensor([norms[p] for p in peers], dtype=torch.float64), held)
            )
            for peer, norm in norms.items():
                sent[peer] = sent.get(peer, 0) + 1
                if norm > median * NORM_ABOVE or norm < median / NORM_BELOW:
                    strikes[peer] = strikes.get(peer, 0) + 1
        return {peer for peer, n in strikes.items() if n * 2 > sent[peer]}

    # --- after sealing, before θ steps --------------------------------------------------------------

    def score(
        self,
        round_: int,
        params: Mapping[str, torch.Tensor],
        contributions: Sequence[Contribution],
        replicas: Mapping[str, Replica],
        steps: Mapping[str, int] | None = None,
    ) -> dict[str, float]:
        """Score the drawn replicas' contributions on θ (`params`, before this round's step): an anchor's
        update whole, a chain's stage by stage; update each scored peer's average and earned weight and
        return {peer: score}. `steps`: the inner steps each sealed peer claimed (paced rounds; None: H).
        Blocking: run it in a worker thread."""
        started = time.perf_counter()
        params = on_device(params, self.device)  # θ is never copied back
        trial = self._trial(round_, params, contributions, replicas, steps)
        by_replica = trial.by_replica
        newcomers = {
            r
            for r, keys in by_replica.items()
            if not any(self.earned.weight(p) for p in trial.peers_of(keys))
        }
        weight = {r: max(trial.weight[k] for k in keys) for r, keys in by_replica.items()}
        drawn = self._sample(round_, sorted(set(by_replica) - newcomers), weight) + self._newcomers(
            round_, sorted(newcomers)
        )
        picked = [key for r in drawn for key in by_replica[r]]  # a pooled chain: each combination
        anchors = [key for key in picked if trial.is_anchor(key)]
        chains = [key for key in picked if not trial.is_anchor(key)]
        held_out = self._held_out(round_)
        with autocast_for(self.device):
            before = batch_loss(self.model, params, held_out)
        own = {
            r: self._assigned(round_, replicas[trial.members[by_replica[r][0]][0]], trial.batches[r])
            for r in drawn
        }
        own_before: dict[str, float] = {}  # loss(θ) on each replica's batch: once, whatever is tried on it

        def improvement(update: Sparse, key: str) -> float:
            """Loss improvement of `update` (clipped as `key`'s) on its replica's batch and the held-out."""
            delta = trial.clipped(update, key, self.device)
            batch = own[trial.replica[key]]
            with autocast_for(self.device):
                if trial.replica[key] not in own_before:
                    own_before[trial.replica[key]] = batch_loss(self.model, params, batch)
                return (
                    loss_improvement(
                        self.model, params, delta, trial.step, batch, before=own_before[trial.replica[key]]
                    )
                    + loss_improvement(self.model, params, delta, trial.step, held_out, before=before)
                ) / trial.pace[key]

        whole = {key: improvement(trial.merged[key], key) for key in picked}
        scores: dict[str, float] = {}
        if whole:
            scale = _scale(whole, {key: trial.held[key] for key in whole})
            self.recent_scale = scale
            relative = {key: value / scale - SCORE_MARGIN for key, value in whole.items()}
            scores |= {key: relative[key] for key in anchors}
            # a chain's stages take the chain's score, but each is also tried alone on its own layers, and
            # where that hurts, the chain without it (`stage_score`): a stage whose part helps is never
            # judged negative for a neighbour's (no framing), one whose part hurts the chain is judged by
            # it. A pool's worker takes the best score of the combinations it is in: a pool-mate's or a
            # neighbour's bad part does not frame it either.
            best: dict[str, str] = {}
            for key in chains:
                for peer in trial.members[key]:
                    if peer not in best or relative[key] > relative[best[peer]]:
                        best[peer] = key
            for peer, key in best.items():
                alone = improvement(trial.updates[peer], key)
                marginal = None
                rest = {n: u for n, u in trial.merged[key].items() if n not in trial.updates[peer]}
                if alone < 0 and rest:  # what its part adds to the rest of its chain
                    marginal = whole[key] - improvement(rest, key)
                scores[peer] = stage_score(relative[key], alone, marginal, scale)
        for peer, score in scores.items():
            previous = self.averages.get(peer, 0.0)
            self.averages[peer] = (1 - AVERAGE_WEIGHT) * previous + AVERAGE_WEIGHT * score
            self.counts[peer] = self.counts.get(peer, 0) + 1
            self.earned.observe(peer, score)
        if len(self.averages) > 100_000:  # forget the oldest identities rather than grow without bound
            for peer in list(self.averages)[: len(self.averages) // 2]:
                del self.averages[peer]
                self.counts.pop(peer, None)
        self.last_seconds = time.perf_counter() - started
        return scores

    def helps(
        self,
        round_: int,
        params: Mapping[str, torch.Tensor],
        contributions: Sequence[Contribution],
        replicas: Mapping[str, Replica],
        steps: Mapping[str, int] | None = None,
    ) -> set[str]:
        """The peers whose replica's update (a chain's stages together), applied alone, would score
        non-negative against the last scored round's yardstick (no other work to measure it against: for
        a round nobody with a record is left in; before any round was scored, any improvement counts).
        Averages are not touched. Blocking: run it in a worker thread."""
        params = on_device(params, self.device)
        trial = self._trial(round_, params, contributions, replicas, steps)
        held_out = self._held_out(round_)
        improvements = {}
        with autocast_for(self.device):
            before = batch_loss(self._seal_model, params, held_out)
            for key, update in trial.merged.items():
                delta = trial.clipped(update, key, self.device)
                own = self._assigned(
                    round_, replicas[trial.members[key][0]], trial.batches[trial.replica[key]]
                )
                improvements[key] = (
                    loss_improvement(self._seal_model, params, delta, trial.step, own)
                    + loss_improvement(self._seal_model, params, delta, trial.step, held_out, before=before)
                ) / trial.pace[key]
        scale = self.recent_scale
        passed = (
            {key for key, value in improvements.items() if value > 0}
            if scale is None
            else {key for key, score in relative_scores(improvements, scale=scale).items() if score >= 0}
        )
        # a pool's worker passes when any combination it is in passes
        return {peer for key in passed for peer in trial.members[key]}

    def _trial(
        self,
        round_: int,
        params: Mapping[str, torch.Tensor],
        contributions: Sequence[Contribution],
        replicas: Mapping[str, Replica],
        steps: Mapping[str, int] | None = None,
    ) -> _Trial:
        """The round's contributions as trials, one per replica, except a chain with a pool (a stage
        several workers hold, each training its own copy of the slice on the micro-batches routed to it):
        one per combination of one worker a stage (`pool_combinations`), keyed f"{chain}#{i}", since
        merging two workers' updates of the same tensors would keep only one of them."""
        updates = {peer: _sparse_of(decoded) for peer, decoded in contributions}
        peer_weight = self.earned.counted(updates)
        stages: dict[str, dict[int | str, list[str]]] = {}  # replica key -> stage -> its workers
        for peer in updates:
            r = replicas[peer]
            stages.setdefault(r.key, {}).setdefault(peer if r.stage is None else r.stage, []).append(peer)
        members: dict[str, list[str]] = {}
        replica: dict[str, str] = {}
        batches: dict[str, int] = {}
        for r, pools in stages.items():
            ordered = [sorted(pools[s]) for s in sorted(pools, key=lambda s: (isinstance(s, str), s))]
            combos = pool_combinations(ordered)
            for i, combo in enumerate(combos):
                key = r if len(combos) == 1 else f"{r}#{i}"
                # without a pool: the replica's peers in contribution order, as before pools
                members[key] = (
                    list(combo) if len(combos) > 1 else [p for p in updates if replicas[p].key == r]
                )
                replica[key] = r
            # the chain's micro-batches: its fewest over stages, a pool's workers' summed (within the cap)
            cap = self.config.outer.step_cap
            batches[r] = min(min(sum(self._steps(steps, p) for p in pool), cap) for pool in ordered)
        merged: dict[str, Sparse] = {}
        for key, peers in members.items():
            for peer in peers:
                merged.setdefault(key, {}).update(updates[peer])
        # a chain (each combination of a pooled one) weighs as its lightest stage: its update is only as
        # trusted as the least trusted part
        weight = {key: min(peer_weight[p] for p in peers) for key, peers in members.items()}
        # in the round's statistics (median norm, median steps, yardstick) a replica counts once, however
        # many combinations its pools make: each takes its share of the replica's weight (integers)
        shares = {r: sum(1 for k in replica if replica[k] == r) for r in stages}
        unit = math.lcm(*shares.values()) if shares else 1
        held = {key: weight[key] * unit // shares[replica[key]] for key in members}
        norms = {key: update_norm(update) for key, update in merged.items()}
        median = (
            float(
                weighted_median(
                    torch.tensor([norms[k] for k in merged], dtype=torch.float64), [held[k] for k in merged]
                )
            )
            if merged
            else 0.0
        )
        shapes = {name: tuple(t.shape) for name, t in params.items()}
        step = self.config.outer.lr * TRIAL_STEP
        # a chain trains H micro-batches a round; its stages claim them alike (a pool's worker: those it
        # served, which the pace makes up for as it does for a slow replica)
        key_steps = {key: min(self._steps(steps, p) for p in peers) for key, peers in members.items()}
        pace = self._pace(key_steps, held, faster=False)
        return _Trial(
            updates,
            peer_weight,
            members,
            merged,
            weight,
            norms,
            median,
            shapes,
            step,
            key_steps,
            pace,
            replica,
            held,
            batches,
        )

    def _steps(self, steps: Mapping[str, int] | None, peer: str) -> int:
        """The inner steps `peer` claims, within [1, the cap] (None, or absent: H)."""
        o = self.config.outer
        claimed = o.inner_steps if steps is None else steps.get(peer, o.inner_steps)
        return min(max(int(claimed), 1), o.step_cap)

    @staticmethod
    def _pace(steps: Mapping[str, int], weights: Mapping[str, int], faster: bool = True) -> dict[str, float]:
        """Paced rounds: each replica's steps against the round's weighted median, square-rooted (an
        update's norm and its improvement grow with steps, less than in proportion), so that a slow
        honest replica is not screened out for being slow nor a fast one for being fast. `faster` False:
        at most 1 (an improvement is measured after the clip to the median norm, which a fast replica's
        extra steps do not get past; measured in tests/daemon/test_paced_training.py). 1 each when all
        took the same steps."""
        if len(set(steps.values())) <= 1:
            return dict.fromkeys(steps, 1.0)
        keys = list(steps)
        held = [weights.get(k, 0) for k in keys]
        held = held if any(held) else [1] * len(held)
        typical = float(weighted_median(torch.tensor([float(steps[k]) for k in keys]), held))
        ratio = {k: steps[k] / typical for k in keys}
        return {k: math.sqrt(r if faster else min(r, 1.0)) for k, r in ratio.items()}

    def _sample(
        self, round_: int, keys: Sequence[str], weights: Mapping[str, int] | None = None
    ) -> list[str]:
        """The replicas scored this round: all while they are at most `outer.verify_sample`; beyond, each
        with chance max(verify_sample · w / W, verify_min_chance) for its share w / W of the weight (equal
        weights: verify_sample / R), drawn from our secret (so nobody can tell when it will be scored next,
        whatever it saw before). Scrutiny follows influence: an identity that holds more of the round is
        checked more often, at the same cost of about verify_sample scores a round."""
        o = self.config.outer
        if len(keys) <= o.verify_sample:
            return list(keys)
        held = {key: max((weights or {}).get(key, 1), 1) for key in keys}
        total = sum(held.values())
        chance = {key: max(o.verify_sample * held[key] / total, o.verify_min_chance) for key in keys}
        return [key for key in keys if self._draw(b"score", round_, key) < chance[key]]

    def _newcomers(self, round_: int, keys: Sequence[str]) -> list[str]:
        """Replicas on probation scored this round: all while they are at most `outer.verify_sample`,
        beyond that many drawn from our secret. A budget of their own: a newcomer leaves probation within
        a round or two however large the swarm, and a flood of fresh identities cannot crowd out the
        scoring of replicas with a record (it only makes newcomers wait longer)."""
        limit = self.config.outer.verify_sample
        return sorted(keys, key=lambda key: self._draw(b"newcomer", round_, key))[:limit]

    def _draw(self, purpose: bytes, round_: int, key: str) -> float:
        """A number in [0, 1) from our secret: unknown to the peers until we publish what it decided."""
        digest = hashlib.sha256(
            self._secret + purpose + round_.to_bytes(8, "big", signed=True) + key.encode()
        ).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def _assigned(self, round_: int, replica: Replica, steps: int) -> list[tuple]:
        """One of the batches the replica was assigned in `round_` for the `steps` it claims (its data
        slot and round are public), which one drawn from our secret: work that helps only on some of its
        batches is caught too, and so is a claim of steps that were not taken, on its batches' share."""
        batches = assigned_batches(replica.batches_of, round_, steps, self.config.outer.step_cap)
        index = batches[int(self._draw(b"batch", round_, replica.key) * len(batches))]
        inputs, targets = self.dataset.train_batch(replica.slot, NUM_DATA_SLOTS, index)
        return batches_on([(inputs[:SCORE_SEQUENCES], targets[:SCORE_SEQUENCES])], self.device)

    def _held_out(self, round_: int) -> list[tuple]:
        """One eval batch, drawn per round with our secret (the eval split is never trained on)."""
        batches = self.dataset.eval_batches(self.dataset.num_eval_batches)
        inputs, targets = batches[int(self._draw(b"held-out", round_, "") * len(batches))]
        return batches_on([(inputs[:SCORE_SEQUENCES], targets[:SCORE_SEQUENCES])], self.device)

    def verdicts(
        self,
        round_: int,
        sealed: Sequence[str],
        rejected: Mapping[str, str],
        scores: Mapping[str, float],
    ) -> list[Verdict]:
        """One verdict per peer that sent a valid contribution: credited only when sealed and not judged
        negative after this round's score."""
        out = []
        for peer in sorted(set(sealed) | set(rejected)):
            reason = rejected.get(peer)
            average = self.averages.get(peer)
            if reason is None and self.judged_negative(peer):
                reason = "score"  # sealed on its earlier record (or alone), but its average is negative
            weight = self.earned.weight(peer)
            out.append(Verdict(peer, round_, reason, scores.get(peer), average, weight))
        return out


@dataclass(frozen=True)
class _Trial:
    """A round's contributions made ready to try one by one: by peer and by replica (a chain's stages
    merged), their weights, and the clip every trial applies (the weighted median norm, as aggregation)."""

    updates: dict[str, Sparse]  # peer -> its update
    peer_weight: dict[str, int]
    members: dict[str, list[str]]  # replica key -> its peers
    merged: dict[str, Sparse]  # replica key -> its update (a chain's stages together)
    weight: dict[str, int]  # replica key -> its weight
    norms: dict[str, float]  # replica key -> its update's norm
    median: float
    shapes: dict[str, tuple[int, ...]]
    step: float
    steps: dict[str, int]  # replica key -> the inner steps it claims (within [1, the cap])
    pace: dict[str, float]  # replica key -> its steps' pace (`Verifier._pace`)
    # the keys above are trial keys: a replica's, or one per combination of a pooled chain's workers
    replica: dict[str, str] = field(default_factory=dict)  # trial key -> its replica's key
    held: dict[str, int] = field(default_factory=dict)  # trial key -> its weight in the round's medians
    batches: dict[str, int] = field(default_factory=dict)  # replica key -> the micro-batches it trained

    def is_anchor(self, key: str) -> bool:
        return self.members[key] == [key]

    @property
    def by_replica(self) -> dict[str, list[str]]:
        """Replica key -> its trial keys, in order."""
        out: dict[str, list[str]] = {}
        for key in self.members:
            out.setdefault(self.replica[key], []).append(key)
        return out

    def peers_of(self, keys: Sequence[str]) -> list[str]:
        return list(dict.fromkeys(peer for key in keys for peer in self.members[key]))

    def clipped(self, update: Sparse, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        """`update` (a replica's, or a part of it) dense on `device`, scaled by its replica's clip factor
        (never up)."""
        delta = dense_on(update, self.shapes, device)
        norm = self.norms[key]
        if norm > self.median > 0:
            delta = {name: t * (self.median / norm) for name, t in delta.items()}
        return delta


def pool_combinations(
    stages: Sequence[Sequence[str]], bound: int = MAX_COMBINATIONS
) -> list[tuple[str, ...]]:
    """The trials of a chain whose stages hold these workers (in stage order, each pool in a fixed order):
    every combination of one worker a stage while there are at most `bound`; beyond, the i-th worker of
    each pool (round robin) for i below the largest pool, which still tries every worker."""
    if math.prod(len(pool) for pool in stages) <= bound:
        return list(itertools.product(*stages))
    widest = max(len(pool) for pool in stages)
    return [tuple(pool[i % len(pool)] for pool in stages) for i in range(widest)]


def duplicate_level(pairs: Mapping[tuple[str, str], float], weights: Mapping[str, int]) -> float:
    """The top-k overlap from which two of a round's contributions count as one training: the weighted
    median of the round's pair overlaps (a pair weighs as its lighter member) plus DUPLICATE_MARGIN, within
    [DUPLICATE_FLOOR, DUPLICATE_CEILING]."""
    held = [min(weights.get(a, 0), weights.get(b, 0)) for a, b in pairs]
    if not pairs or not any(held):
        return DUPLICATE_FLOOR
    typical = float(weighted_median(torch.tensor(list(pairs.values()), dtype=torch.float64), held))
    return min(max(typical + DUPLICATE_MARGIN, DUPLICATE_FLOOR), DUPLICATE_CEILING)


def _scale(improvements: Mapping[str, float], weights: Mapping[str, int]) -> float:
    """`improvement_scale` by weight: the upper weighted median of the magnitudes (two: the larger)."""
    if len(improvements) <= 2:
        return improvement_scale(improvements)
    keys = list(improvements)
    magnitudes = torch.tensor([abs(improvements[k]) for k in keys], dtype=torch.float64)
    held = [weights[k] for k in keys]
    held = held if any(held) else [1] * len(held)
    # the upper median: the lower weighted median of the negated magnitudes, negated
    return max(-float(weighted_median(-magnitudes, held)), 1e-12)


def _twin(model: nn.Module) -> nn.Module:
    """A copy of `model`'s module objects that shares its tensors (parameters, buffers, T_fix): no memory
    for weights, and `functional_call` on one never touches the other's attributes."""
    shared = itertools.chain(model.parameters(), model.buffers(), [getattr(model, "fixed_embedding", None)])
    return copy.deepcopy(model, memo={id(t): t for t in shared if t is not None})


def _sparse_of(decoded: Sequence[DecodedPayload]) -> Sparse:
    return {name: values for message in decoded for name, values in message.sparse.items()}
