"""Verified contributions (TRUST §4): the coordinator weighs and credits only work that helps.

Two passes per round:
- `screen`, at seal time, over every valid contribution (cheap: no forward pass). A contribution is left
  out of the seal when its header says it was trained from an older θ (`stale`), when its top-k positions
  repeat an earlier announcement's (`copy`), when its norm is far outside the round's (`norm`: free riders
  and payloads scaled to the bounds), or when its author's score average is negative (`score`).
- `score`, beside the seal (the coordinator's bookkeeping worker, `bootstrap/bookkeeping.py`), on θ before
  the round's step: each replica's update (a chain's stages together) is applied alone at a reduced step,
  clipped to the round's median norm, and the loss change is measured on the batches that replica was
  assigned this round and on a held-out batch the replicas cannot know in advance. Improvements become
  relative scores (`hetnode.algo.scoring`) and an exponential average per peer; a peer whose average is
  negative is screened out of later seals until it recovers (it is still scored while it is out, so honest
  work comes back). The score of round t reaches the average when the worker is done with it: usually before
  round t+1 is sealed, at worst a round or two later (the trust bench measures the bound with one round).

A peer is judged on MIN_SCORES scores or more (one round on a few sequences is noisy, and a newcomer's first
round, from a fresh optimiser, helps less than its later ones), and its average starts from 0. When every
valid contribution of a round is screened out for its author's average, `helps` is asked instead: the
contributions whose update alone would score non-negative against the last scored round's yardstick are
sealed (a chain left alone after its anchor died must
not stall the swarm), while their credit still waits for the average to recover.

Small swarms are scored whole; beyond `outer.verify_sample` replicas a rotating sample is, the least
recently scored first, so verification stays a bounded share of a round and every replica is looked at
every ceil(R / verify_sample) rounds (an unsampled round leaves its average as it was).

The coordinator credits a contribution only when it was sealed and its author's average is not negative.

Threads: `score` runs in the worker's thread and is the only writer of the averages; `screen` and `helps`
run for the seal meanwhile and only read them (single dict reads and writes, atomic in CPython). `score`
runs the model it was given; `helps` runs a twin of it (the same tensors, its own module objects), since
`functional_call` swaps a module's parameters while it runs.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bootstrap.ledger import Verdict
from hetnode.algo.scoring import (
    batch_loss,
    dense_update,
    improvement_scale,
    index_overlap,
    loss_improvement,
    relative_scores,
    update_norm,
)
from hetnode.config import Config
from hetnode.daemon.rounds import NUM_DATA_SLOTS, data_slot
from hetnode.data.dataset import TokenDataset
from hetnode.planning.rounds import assigned_batches
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

COPY_OVERLAP = 0.9  # share of top-k positions in common that marks a copy (honest pairs measure far below)
# A contribution whose norm is this far above, or below, the round's median is left out. Above: scaled
# payloads sit hundreds of times over (clipping to the median already disarms less), and an honest replica
# left out for some rounds sends its accumulated error feedback, up to 1/(1-β) = 20 rounds' worth: it must
# not be locked out by it (seen in the lab). Below: a free rider sends a thousandth.
NORM_ABOVE = 64.0
NORM_BELOW = 8.0
MIN_FOR_NORM_BAND = 3  # with fewer contributions the median says nothing about who is odd
AVERAGE_WEIGHT = 0.5  # of the newest score in a peer's exponential average (which starts at 0)
MIN_SCORES = 2  # scores a peer needs before its average can refuse it weight or credit
TRIAL_STEP = 0.5  # of the outer learning rate: each update is tried alone at this reduced step
SCORE_SEQUENCES = 4  # sequences per scoring batch: a few forward passes per contribution, not a round's work

Contribution = tuple[str, list[DecodedPayload]]  # (peer, its decoded payloads)


@dataclass(frozen=True)
class Replica:
    """Whose update a contribution is part of: an anchor alone, or a chain (its stages together)."""

    key: str  # the anchor's peer id, or the chain id
    slot: int  # its data slot: the assigned batches the verifier scores it on


def replica_of(peer: str, record: Mapping | None) -> Replica:
    """A stage's replica is its chain (from its record); anyone else is a replica of its own."""
    chain = (record or {}).get("chain") if (record or {}).get("role") == "stage" else None
    key = chain if isinstance(chain, str) and chain else peer
    return Replica(key, data_slot(key))


class Verifier:
    def __init__(self, config: Config, dataset: TokenDataset, model: nn.Module) -> None:
        """`model`: the whole decoder as anchors train it (T_fix included), used with θ as parameters."""
        self.config = config
        self.dataset = dataset
        self.model = model
        self._seal_model = _twin(model)  # for `helps`, which runs at the seal while `score` may run
        self.averages: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # scores behind each average
        self.last_scored: dict[str, int] = {}  # replica key -> the last round it was scored in
        self.recent_scale: float | None = None  # the last scored round's yardstick (`improvement_scale`)
        self._secret = os.urandom(16)  # held-out batches are drawn with it: replicas cannot aim at them
        self.last_seconds = 0.0  # scoring time of the last round

    # --- at seal time --------------------------------------------------------------------------------

    def screen(
        self,
        round_: int,
        contributions: Sequence[Contribution],
        seen_at: Mapping[str, float] | None = None,
    ) -> dict[str, str]:
        """{peer: reason} for the contributions to leave out of this round's seal. `contributions` are in
        announcement order (a copy can only come after its original: it needs the original's bytes).

        `seen_at`: when the sealer first saw each announcement. Two that overlap but were first seen in the
        same read have no order: which one is the copy cannot be told, and neither is refused for it
        (honest work is never refused; a copier fast enough to land in its victim's read keeps that
        round's weight, and is refused in every round it is seen later)."""
        reasons: dict[str, str] = {}
        for peer, decoded in contributions:
            if any(message.base != round_ - 1 for message in decoded):
                reasons[peer] = "stale"
        updates = {peer: _sparse_of(decoded) for peer, decoded in contributions}
        order = [peer for peer, _ in contributions]
        for i, peer in enumerate(order):
            if peer in reasons:
                continue
            for earlier in order[:i]:
                if index_overlap(updates[peer], updates[earlier]) >= COPY_OVERLAP:
                    if seen_at is not None and seen_at.get(peer) == seen_at.get(earlier):
                        log.warning(
                            "round %d: %s and %s repeat each other's top-k positions, first seen in one "
                            "read: which is the copy cannot be told, neither is left out",
                            round_,
                            peer,
                            earlier,
                        )
                        continue
                    reasons[peer] = "copy"
                    log.warning("round %d: %s repeats %s's top-k positions: a copy", round_, peer, earlier)
                    break
        for peer in self._off_norm(updates):
            reasons.setdefault(peer, "norm")
        for peer in order:
            if self.judged_negative(peer):
                reasons.setdefault(peer, "score")
        return reasons

    def judged_negative(self, peer: str) -> bool:
        """Whether `peer`'s average, over enough scores to judge it, is negative."""
        return self.counts.get(peer, 0) >= MIN_SCORES and self.averages.get(peer, 0.0) < 0

    def _off_norm(self, updates: Mapping[str, Mapping]) -> set[str]:
        """Peers whose norm is outside [median / NORM_BELOW, median · NORM_ABOVE] in most shards they sent,
        the median taken per tensor over whoever sent it (a chain stage sends only its layers)."""
        by_tensor: dict[str, dict[str, float]] = {}
        for peer, update in updates.items():
            for name, values in update.items():
                by_tensor.setdefault(name, {})[peer] = update_norm({name: values})
        strikes: dict[str, int] = {}
        sent: dict[str, int] = {}
        for norms in by_tensor.values():
            if len(norms) < MIN_FOR_NORM_BAND:
                continue
            ordered = sorted(norms.values())
            median = ordered[len(ordered) // 2]
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
    ) -> dict[str, float]:
        """Score every contribution's replica on θ (`params`, before this round's step); update the
        averages of their peers and return {peer: score}. Blocking: run it in a worker thread."""
        started = time.perf_counter()
        improvements, members = self._improvements(
            self.model, round_, params, contributions, replicas, sample=True
        )
        scores = relative_scores(improvements)
        if improvements:
            self.recent_scale = improvement_scale(improvements)
        by_peer = {}
        for key, peers in members.items():
            for peer in peers:
                by_peer[peer] = scores[key]
                previous = self.averages.get(peer, 0.0)
                self.averages[peer] = (1 - AVERAGE_WEIGHT) * previous + AVERAGE_WEIGHT * scores[key]
                self.counts[peer] = self.counts.get(peer, 0) + 1
        if len(self.averages) > 100_000:  # forget the oldest identities rather than grow without bound
            for peer in list(self.averages)[: len(self.averages) // 2]:
                del self.averages[peer]
                self.counts.pop(peer, None)
            self.last_scored = {key: r for key, r in self.last_scored.items() if r >= round_ - 1000}
        self.last_seconds = time.perf_counter() - started
        return by_peer

    def helps(
        self,
        round_: int,
        params: Mapping[str, torch.Tensor],
        contributions: Sequence[Contribution],
        replicas: Mapping[str, Replica],
    ) -> set[str]:
        """The peers whose replica's update, applied alone, would score non-negative against the last
        scored round's yardstick (no other work to measure it against: for a round nobody else is left in;
        before any round was scored, any improvement counts). Averages are not touched: the round's score
        comes after sealing, as for any round. Blocking: run it in a worker thread."""
        improvements, members = self._improvements(self._seal_model, round_, params, contributions, replicas)
        scale = self.recent_scale
        passed = (
            {key for key, value in improvements.items() if value > 0}
            if scale is None
            else {key for key, score in relative_scores(improvements, scale=scale).items() if score >= 0}
        )
        return {peer for key in passed for peer in members[key]}

    def _improvements(
        self,
        model: nn.Module,
        round_: int,
        params: Mapping[str, torch.Tensor],
        contributions: Sequence[Contribution],
        replicas: Mapping[str, Replica],
        sample: bool = False,
    ) -> tuple[dict[str, float], dict[str, list[str]]]:
        """({replica key: loss improvement}, {replica key: its peers}): each replica's update (a chain's
        stages merged) applied alone at the trial step, clipped to the median norm of all of them. With
        `sample`, only the replicas `_sample` picks for this round are tried."""
        shapes = {name: tuple(t.shape) for name, t in params.items()}
        merged: dict[str, dict[str, tuple]] = {}
        members: dict[str, list[str]] = {}
        for peer, decoded in contributions:
            key = replicas[peer].key
            merged.setdefault(key, {}).update(_sparse_of(decoded))
            members.setdefault(key, []).append(peer)
        if not merged:
            return {}, {}
        norms = sorted(update_norm(u) for u in merged.values())
        median = norms[len(norms) // 2]
        if sample:
            picked = self._sample(round_, sorted(merged))
            merged = {key: merged[key] for key in picked}
            members = {key: members[key] for key in picked}
        step = self.config.outer.lr * TRIAL_STEP
        held_out = self._held_out(round_)
        held_out_before = batch_loss(model, params, held_out)
        improvements = {}
        for key, update in merged.items():
            norm = update_norm(update)
            delta = dense_update(update, shapes)
            if norm > median > 0:  # as aggregation does: never scaled up, clipped to the median
                delta = {name: t * (median / norm) for name, t in delta.items()}
            own = self._assigned(round_, replicas[members[key][0]])
            improvements[key] = loss_improvement(model, params, delta, step, own) + loss_improvement(
                model, params, delta, step, held_out, before=held_out_before
            )
        return improvements, members

    def _sample(self, round_: int, keys: Sequence[str]) -> list[str]:
        """All replicas while they are at most `outer.verify_sample`; beyond, the least recently scored
        first (never scored counts as oldest), ties in an order our secret draws anew each round, so that
        nobody can tell when it will be looked at next."""
        limit = self.config.outer.verify_sample
        if len(keys) > limit:

            def turn(key: str) -> tuple[int, bytes]:
                tie = hashlib.sha256(self._secret + round_.to_bytes(8, "big", signed=True) + key.encode())
                return self.last_scored.get(key, -(2**62)), tie.digest()

            keys = sorted(keys, key=turn)[:limit]
        for key in keys:
            self.last_scored[key] = round_
        return list(keys)

    def _assigned(self, round_: int, replica: Replica) -> list[tuple]:
        """The last batch the replica was assigned in `round_` (its data slot and round are public)."""
        index = assigned_batches(replica.key, round_, self.config.outer.inner_steps)[-1]
        inputs, targets = self.dataset.train_batch(replica.slot, NUM_DATA_SLOTS, index)
        return [(inputs[:SCORE_SEQUENCES], targets[:SCORE_SEQUENCES])]

    def _held_out(self, round_: int) -> list[tuple]:
        """One eval batch, drawn per round with our secret (the eval split is never trained on)."""
        batches = self.dataset.eval_batches(self.dataset.num_eval_batches)
        digest = hashlib.sha256(self._secret + round_.to_bytes(8, "big", signed=True)).digest()
        inputs, targets = batches[int.from_bytes(digest[:4], "big") % len(batches)]
        return [(inputs[:SCORE_SEQUENCES], targets[:SCORE_SEQUENCES])]

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
            out.append(Verdict(peer, round_, reason, scores.get(peer), average))
        return out


def _twin(model: nn.Module) -> nn.Module:
    """A copy of `model`'s module objects that shares its tensors (parameters, buffers, T_fix): no memory
    for weights, and `functional_call` on one never touches the other's attributes."""
    shared = itertools.chain(model.parameters(), model.buffers(), [getattr(model, "fixed_embedding", None)])
    return copy.deepcopy(model, memo={id(t): t for t in shared if t is not None})


def _sparse_of(decoded: Sequence[DecodedPayload]) -> dict[str, tuple]:
    return {name: values for message in decoded for name, values in message.sparse.items()}
