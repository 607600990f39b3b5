"""Anchors and chains in one process, syncing through real encoded payload bytes (docs/sync.md, "One round").

Each replica keeps its own copy of the global parameters and computes the aggregate itself from the
decoded bytes of every contributor, as networked replicas will; only the transport is swapped out.
Bytes are counted from the encoded messages, never from formulas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from hetnode.algo.aggregate import AGGREGATION_RULES, aggregate_dense, aggregate_sparse, outer_sgd_step
from hetnode.algo.sparseloco import DenseCodec
from hetnode.config import Config, replace
from hetnode.data import TokenDataset
from hetnode.lab.sim.replicas import AnchorReplica, ChainReplica, DDPReplica, Params, Replica, Update
from hetnode.lab.sim.stage_chain import StageChain
from hetnode.model import build_model
from hetnode.model.shards import shard_names
from hetnode.planning.layer_split import split_layers
from hetnode.replica.global_model import base_fixed_embedding
from hetnode.training.anchor_round import AnchorRound
from hetnode.training.trainer import InnerTrainer
from hetnode.wire.sync_payload import ShardSpec, SyncPayload, decode_payload, encode_payload

MethodKind = Literal["ddp", "diloco", "sparseloco"]
Mode = Literal["none", "selective", "everything"]


@dataclass(frozen=True)
class SyncMethod:
    """How replicas synchronise. `inner_steps` is H (for DDP: steps between evaluations)."""

    name: str
    kind: MethodKind
    inner_steps: int = 30
    topk: int = 64
    tile: int = 64
    error_feedback: float = 0.95
    outer_lr: float = 1.0  # SparseLoCo α; DiLoCo uses its own Nesterov lr below
    diloco_lr: float = 0.7
    diloco_momentum: float = 0.9
    aggregation: str | None = None  # SparseLoCo's aggregation rule; None: the config's outer.aggregation


@dataclass(frozen=True)
class Swarm:
    """Who trains: `anchors` full replicas and `chains` pipelines of `chain_stages` stages."""

    anchors: int
    chains: int = 0
    chain_stages: int = 2
    mode: Mode = "none"  # subspace compression: none, selective (chains only), everything
    chain_optimizer: str = "adamw"

    @property
    def replicas(self) -> int:
        return self.anchors + self.chains


@dataclass(frozen=True)
class RoundStats:
    round: int
    steps: int  # inner steps per replica so far
    tokens: int  # tokens processed by all replicas so far
    eval_loss: float
    bytes_per_replica: int  # sync bytes sent by one replica in this round (mean), encoded messages
    dense_fp32_bytes: int  # one replica's encoded payload had it sent dense fp32 pseudo-gradients
    activation_bytes: int  # chain boundary frames (forward + backward) this round, all chains
    syncs: int  # exchanges in this round (H for DDP, 1 otherwise)
    codec_seconds: float  # encode + decode + aggregate + outer step, per replica (mean)
    inner_seconds: float  # the inner steps, per replica (mean)


def round_config(config: Config, method: SyncMethod, swarm: Swarm) -> Config:
    """`config` as an anchor and a chain's stages of this simulation read it: H, codec and α of `method`,
    lockstep rounds of H steps, the subspace mode (an anchor is constrained in "everything" only), the
    stages and the chain optimiser of `swarm`."""
    config = replace(
        config,
        "outer",
        inner_steps=method.inner_steps,
        topk=method.topk,
        tile=method.tile,
        error_feedback=method.error_feedback,
        lr=method.outer_lr,
        schedule="steps",
    )
    return replace(
        config,
        "pipeline",
        compression=swarm.mode,
        stages=swarm.chain_stages,
        chain_optimizer=swarm.chain_optimizer,
    )


class ReplicaSimulation:
    """Train a swarm on disjoint data slots, syncing every H inner steps with `method`."""

    def __init__(self, config: Config, dataset: TokenDataset, method: SyncMethod, swarm: Swarm) -> None:
        if swarm.anchors + swarm.chains < 1:
            raise ValueError("need at least one replica")
        if method.kind == "ddp" and swarm.chains:
            raise ValueError("the DDP baseline has no chains")
        self.config, self.dataset, self.method, self.swarm = config, dataset, method, swarm
        self.aggregation = method.aggregation or config.outer.aggregation
        if self.aggregation not in AGGREGATION_RULES:
            raise ValueError(f"unknown aggregation rule {self.aggregation!r} ({method.name})")
        self.last_outgoing: dict[str, dict[str, bytes]] = {}  # the last round's payloads, per replica
        self.round = 0
        seed = config.run.seed
        # the config an anchor's and a stage's round read: the method's H and codec, the swarm's subspace mode
        self.round_config = round_config(config, method, swarm)
        self.eval_model = build_model(config.model, seed=seed)
        initial = dict(self.eval_model.named_parameters())  # θ⁰, the same on every replica
        base_fixed = base_fixed_embedding(self.round_config)
        self.eval_model.fixed_embedding = base_fixed
        splits = split_layers(config.model.n_layers, [1.0] * swarm.chain_stages)
        self.replicas: list[Replica] = []
        if method.kind == "ddp":
            # Synchronous DDP = one trainer whose every step averages all replicas' batches.
            trainer = InnerTrainer(
                config,
                build_model(config.model, seed=seed),
                dataset,
                slots=range(swarm.anchors),
                num_slots=swarm.anchors,
            )
            self.replicas.append(DDPReplica(trainer, initial, method))
        else:
            for r in range(swarm.anchors):
                anchor = AnchorRound(self.round_config, dataset, f"anchor-{r:03d}")
                self.replicas.append(AnchorReplica(anchor, initial, method))
            for c in range(swarm.chains):
                chain = StageChain(self.round_config, splits, f"chain-{c:03d}", dataset)
                self.replicas.append(ChainReplica(chain, initial, method))
        first = self.replicas[0].global_params
        self.shards = shard_names(first)
        codec = "sparseloco" if method.kind == "sparseloco" else "fp32"
        max_bytes = int(config.network.max_frame_mb * 2**20)
        self.specs = {
            shard: ShardSpec(
                shard, {n: tuple(first[n].shape) for n in names}, codec, method.topk, method.tile, max_bytes
            )
            for shard, names in self.shards.items()
        }
        self._dense_bytes = sum(len(b) for b in self._encode_dense("probe", first).values())

    def run_round(self) -> RoundStats:
        if self.method.kind == "ddp":
            return self._ddp_round()
        inner_seconds, codec_seconds, sent = [], [], []
        outgoing: dict[str, dict[str, bytes]] = {}
        activation_before = sum(r.activation_bytes + r.gradient_bytes for r in self.replicas)
        for replica in self.replicas:
            start = time.perf_counter()
            replica.train(self.round, self.method.inner_steps)
            inner_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            outgoing[replica.id] = self._encode(replica.id, replica.update(self.round))
            codec_seconds.append(time.perf_counter() - start)
            sent.append(sum(len(b) for b in outgoing[replica.id].values()))
        self.last_outgoing = outgoing
        for i, replica in enumerate(self.replicas):
            start = time.perf_counter()
            self._apply(replica, outgoing)
            codec_seconds[i] += time.perf_counter() - start
        self.round += 1
        activation = sum(r.activation_bytes + r.gradient_bytes for r in self.replicas) - activation_before
        return self._stats(sent, 1, codec_seconds, inner_seconds, activation)

    def _encode(self, replica_id: str, update: Update) -> dict[str, bytes]:
        if self.method.kind != "sparseloco":
            return self._encode_dense(replica_id, update)
        return {
            shard: encode_payload(
                SyncPayload(replica_id, self.round, shard, "sparseloco", {n: update[n] for n in names})
            )
            for shard, names in self.shards.items()
        }

    def _encode_dense(self, replica_id: str, tensors: Params) -> dict[str, bytes]:
        codec = DenseCodec("fp32")
        return {
            shard: encode_payload(
                SyncPayload(
                    replica_id, self.round, shard, "fp32", {n: codec.compress(tensors[n]) for n in names}
                )
            )
            for shard, names in self.shards.items()
        }

    def _apply(self, replica: Replica, outgoing: dict[str, dict[str, bytes]]) -> None:
        """Decode every contributor's bytes, aggregate per shard, take the outer step on the global copy."""
        for shard, spec in self.specs.items():
            decoded = [decode_payload(messages[shard], spec) for messages in outgoing.values()]
            params = {n: replica.global_params[n] for n in spec.shapes}
            if self.method.kind == "sparseloco":
                delta = aggregate_sparse(
                    [(d.replica, d.sparse) for d in decoded], dict(spec.shapes), rule=self.aggregation
                )
                outer_sgd_step(
                    params, delta, lr=self.method.outer_lr, weight_decay=self.config.outer.weight_decay
                )
            else:
                delta = aggregate_dense([(d.replica, d.dense) for d in decoded])
                replica.outer.step(params, delta)

    def _ddp_round(self) -> RoundStats:
        replica = self.replicas[0]
        if not isinstance(replica, DDPReplica):
            raise TypeError(f"the DDP baseline runs one DDP trainer, not {type(replica).__name__}")
        trainer = replica.trainer
        inner, codec, sent = 0.0, 0.0, 0
        for _ in range(self.method.inner_steps):
            start = time.perf_counter()
            trainer.train_step()
            inner += time.perf_counter() - start
            # Every step, each replica would send its dense fp32 gradient: count a real encoded message.
            start = time.perf_counter()
            grads = {n: p.grad for n, p in trainer.model.named_parameters()}
            sent += sum(len(b) for b in self._encode_dense(replica.id, grads).values())
            codec += time.perf_counter() - start
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                replica.global_params[name].copy_(param)
        self.round += 1
        return self._stats([sent], self.method.inner_steps, [codec], [inner], 0)

    def _stats(
        self, sent: list[int], syncs: int, codec: list[float], inner: list[float], activation: int
    ) -> RoundStats:
        return RoundStats(
            round=self.round,
            steps=self.round * self.method.inner_steps,
            tokens=sum(r.tokens for r in self.replicas),
            eval_loss=self.evaluate(),
            bytes_per_replica=round(sum(sent) / len(sent)),
            dense_fp32_bytes=self._dense_bytes * syncs,
            activation_bytes=activation,
            syncs=syncs,
            codec_seconds=sum(codec) / len(codec),
            inner_seconds=sum(inner) / len(inner),
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Eval loss of the global model (replica 0's copy; all copies are identical)."""
        for name, param in self.eval_model.named_parameters():
            param.copy_(self.replicas[0].global_params[name])
        batches = self.dataset.eval_batches(self.config.train.eval_batches)
        self.eval_model.eval()
        return sum(self.eval_model.loss(x, y).item() for x, y in batches) / len(batches)

    def global_params(self, replica: int) -> Params:
        return self.replicas[replica].global_params
