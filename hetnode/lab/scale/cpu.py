"""What a sealed round costs the CPUs, measured on this machine with real signed payloads: the scale model's
CPU term (docs/scale.md), which the flow model of the links leaves out.

After the last announcement the sealer checks that replica's payload and aggregates every contribution
before it seals; after the seal each replica checks every payload it holds shards of, aggregates and steps
θ (`GlobalModel.apply`); then it hashes θ's layers (the digests it advertises and checks against the
coordinator's) and saves its local state for a restart. That last work comes after a replica's own apply,
but on a shared core it delays the others'. Each is timed here alone on one thread, as a daemon pinned to
one core runs it.
The payloads are the codec's real messages of random pseudo-gradients: their sizes and the work of
decoding them depend on the shapes, not on the values. Left out: the envelope's RSA-2048 signature check
(tens of microseconds a payload, against milliseconds of decoding; it lives in `hetnode/net/`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.config import Config
from hetnode.model.shards import ModelPart, layer_digests
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.sync_payload import SyncPayload, encode_payload

DELTA_SCALE = 1e-3  # a pseudo-gradient's typical size: the outer step stays finite and small
# tensors the size of θ (or of a stage's slice) in a replica's local state: θ, error feedback, and the
# inner optimiser's state (an anchor's trainer: its weights and Adam's two moments; a stage: the moments)
ANCHOR_STATE_COPIES = 5
STAGE_STATE_COPIES = 4


@dataclass(frozen=True)
class RoundCpu:
    """Seconds of one core, per round, for a swarm of `anchors` anchors and `chains` chains."""

    seal_check_s: float  # the sealer checking the last announced payload (an anchor's: all shards)
    seal_prepare_s: float  # the sealer aggregating every contribution and checking the step
    anchor_apply_s: float  # a whole replica applying the seal: check every payload, aggregate, step
    stage_apply_s: tuple[float, ...]  # a chain stage doing the same for its own shards
    commit_s: float  # the sealer stepping its own θ after the seal (its aggregate is ready)
    anchor_saving_s: float = 0.0  # an anchor after its apply: hashing θ's layers, saving its local state
    stage_saving_s: tuple[float, ...] = ()  # a chain stage doing the same for its slice

    def anchors_applied_s(self, anchors_per_core: int) -> float:
        """From the payloads' arrival until the last of a core's anchors has applied the seal: all of their
        applying, and the hashing and saving of all but that last one (which comes after its apply)."""
        return anchors_per_core * self.anchor_apply_s + (anchors_per_core - 1) * self.anchor_saving_s

    def critical_path_s(self, anchors_per_core: int, stage_core_work_s: float) -> tuple[float, float]:
        """(before the seal, after the payloads arrived): the sealer's check and aggregation; then the
        busiest core's work. A core's processes all start applying when the seal's payloads arrive, so
        the core is done when all of its work is (it never idles while one of them has work)."""
        return self.seal_check_s + self.seal_prepare_s, max(
            self.anchors_applied_s(anchors_per_core), stage_core_work_s
        )


def _contribution(
    replica: str, config: Config, model: GlobalModel, round_: int, generator: torch.Generator
) -> dict[str, bytes]:
    """One replica's payloads of `round_`, every shard: a random Δ through the real codec."""
    o = config.outer
    codec = SparseLoCoCodec(o.topk, o.tile)
    payloads = {}
    for shard, names in model.shards.items():
        tensors = {
            n: codec.compress(DELTA_SCALE * torch.randn(model.params[n].shape, generator=generator))
            for n in names
        }
        message = SyncPayload(replica, round_, shard, "sparseloco", tensors, base=round_ - 1)
        payloads[shard] = encode_payload(message)
    return payloads


def _median_s(work: Callable[[], object], repeats: int) -> float:
    work()  # once untimed: first calls pay for allocations and lazy initialisation
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_round_cpu(
    config: Config, anchors: int, chains: int, splits: Sequence[range], repeats: int = 3, seed: int = 0
) -> RoundCpu:
    """Time the CPU work of one round of this swarm, each step alone on one thread. `splits`: a chain's
    layers per stage. The contributions are `anchors` whole payloads and, per chain, each stage's shards
    under its own name."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(config, anchors, chains, list(splits), repeats, seed)
    finally:
        torch.set_num_threads(threads)


def _measure(
    config: Config, anchors: int, chains: int, splits: list[range], repeats: int, seed: int
) -> RoundCpu:
    whole = GlobalModel(config)
    generator = torch.Generator().manual_seed(seed)
    round_ = 0
    parts = [ModelPart.of_stage(splits, i) for i in range(len(splits))]
    stage_models = [GlobalModel(config, part=part) for part in parts]
    contributions: list[tuple[str, dict[str, bytes]]] = []
    for a in range(anchors):
        contributions.append((f"anchor-{a}", _contribution(f"anchor-{a}", config, whole, round_, generator)))
    for c in range(chains):
        for i, stage in enumerate(stage_models):
            full = _contribution(f"chain-{c}.{i}", config, whole, round_, generator)
            contributions.append((f"chain-{c}.{i}", {s: full[s] for s in stage.shards}))
    last_peer, last = contributions[0]
    seal_check_s = _median_s(lambda: whole.decode_contribution(last_peer, round_, last), repeats)
    decoded = [(peer, whole.decode_contribution(peer, round_, p)) for peer, p in contributions]
    seal_prepare_s = _median_s(lambda: whole.prepare(round_, decoded), repeats)
    prepared = whole.prepare(round_, decoded)

    def commit() -> None:
        whole.params_round = round_ - 1  # the same step again: the cost is what is measured
        whole.commit(prepared)

    commit_s = _median_s(commit, repeats)

    def apply(model: GlobalModel) -> Callable[[], None]:
        held = [(peer, {s: d for s, d in p.items() if s in model.shards}) for peer, p in contributions]
        held = [(peer, p) for peer, p in held if p]

        def run() -> None:
            model.params_round = round_ - 1
            model.apply(round_, held)

        return run

    return RoundCpu(
        seal_check_s=seal_check_s,
        seal_prepare_s=seal_prepare_s,
        anchor_apply_s=_median_s(apply(GlobalModel(config)), repeats),
        stage_apply_s=tuple(_median_s(apply(model), repeats) for model in stage_models),
        commit_s=commit_s,
        anchor_saving_s=_saving_s(whole.params, ANCHOR_STATE_COPIES, repeats),
        stage_saving_s=tuple(_saving_s(m.params, STAGE_STATE_COPIES, repeats) for m in stage_models),
    )


def _saving_s(params: Mapping[str, torch.Tensor], copies: int, repeats: int) -> float:
    """Hash the layers of `params` and save a local state of `copies` tensors their size each, as a
    replica does after every applied round (`AnchorTraining.save_local_state`: to a file, then renamed)."""
    state = {f"copy{i}": {name: t.clone() for name, t in params.items()} for i in range(copies)}
    with tempfile.TemporaryDirectory(prefix="hetnode-saving-") as folder:
        path = Path(folder) / "state.pt"

        def save() -> None:
            layer_digests(params)
            torch.save(state, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)

        return _median_s(save, repeats)
