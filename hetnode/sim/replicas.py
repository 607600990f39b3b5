"""R replicas in one process, syncing through real encoded payload bytes (DESIGN §2.1).

Each replica keeps its own copy of the global parameters and computes the aggregate itself from the
decoded bytes of every contributor, exactly as networked replicas will; the only thing this simulator
replaces is the transport. Bytes are counted from the encoded messages, never from formulas.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

from hetnode.algo.aggregate import NesterovOuter, aggregate_dense, aggregate_sparse, outer_sgd_step
from hetnode.algo.sparseloco import DenseCodec, ErrorFeedback, SparseLoCoCodec, pseudo_gradient
from hetnode.config import Config
from hetnode.data import TokenDataset
from hetnode.model import build_model, layer_of
from hetnode.training.trainer import InnerTrainer
from hetnode.wire.sync_payload import (
    DecodedPayload,
    ShardSpec,
    SyncPayload,
    decode_payload,
    encode_payload,
)

MethodKind = Literal["ddp", "diloco", "sparseloco"]
Params = dict[str, torch.Tensor]


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


@dataclass(frozen=True)
class RoundStats:
    round: int
    steps: int  # inner steps per replica so far
    tokens: int  # tokens processed by all replicas so far
    eval_loss: float
    bytes_per_replica: int  # sent by one replica in this round (mean over replicas), encoded messages
    dense_fp32_bytes: int  # one replica's encoded payload had it sent dense fp32 pseudo-gradients
    syncs: int  # exchanges in this round (H for DDP, 1 otherwise)
    codec_seconds: float  # encode + decode + aggregate + outer step, per replica (mean)
    inner_seconds: float  # the inner steps, per replica (mean)


def shard_names(params: Params) -> dict[str, list[str]]:
    """Tensor names grouped by layer ("embed", "0".."L-1", "head"): one sync message per group."""
    shards: dict[str, list[str]] = defaultdict(list)
    for name in params:
        shards[layer_of(name)].append(name)
    return dict(shards)


def layer_digests(params: Params, prefix_chars: int = 16) -> dict[str, str]:
    """sha256 prefix of the exact bytes of each layer group: equal digests mean bit-identical layers."""
    digests = {}
    for shard, names in sorted(shard_names(params).items()):
        h = hashlib.sha256()
        for name in sorted(names):
            h.update(name.encode())
            h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
        digests[shard] = h.hexdigest()[:prefix_chars]
    return digests


class _Replica:
    def __init__(self, index: int, trainer: InnerTrainer, method: SyncMethod) -> None:
        self.id = f"replica-{index:03d}"
        self.trainer = trainer
        self.global_params: Params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        self.feedback = (
            ErrorFeedback(SparseLoCoCodec(method.topk, method.tile), method.error_feedback)
            if method.kind == "sparseloco"
            else None
        )
        self.outer = (
            NesterovOuter(method.diloco_lr, method.diloco_momentum) if method.kind == "diloco" else None
        )

    def local_params(self) -> Params:
        return dict(self.trainer.model.named_parameters())

    def reset_to_global(self) -> None:
        with torch.no_grad():
            for name, param in self.trainer.model.named_parameters():
                param.copy_(self.global_params[name])


class ReplicaSimulation:
    """Train `num_replicas` replicas on disjoint data slots, syncing every H steps with `method`."""

    def __init__(self, config: Config, dataset: TokenDataset, num_replicas: int, method: SyncMethod) -> None:
        if num_replicas < 1:
            raise ValueError("need at least one replica")
        self.config = config
        self.method = method
        self.num_replicas = num_replicas
        self.round = 0
        seed = config.run.seed
        if method.kind == "ddp":
            # Synchronous DDP = one trainer whose every step averages all replicas' batches.
            model = build_model(config.model, seed=seed)
            trainer = InnerTrainer(config, model, dataset, slots=range(num_replicas), num_slots=num_replicas)
            self.replicas = [_Replica(0, trainer, method)]
        else:
            self.replicas = [
                _Replica(
                    r,
                    InnerTrainer(
                        config,
                        build_model(config.model, seed=seed),
                        dataset,
                        slots=[r],
                        num_slots=num_replicas,
                    ),
                    method,
                )
                for r in range(num_replicas)
            ]
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
        self._dense_bytes = sum(len(b) for b in self._encode_dense(self.replicas[0].id, first).values())

    # -- one round --------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        if self.method.kind == "ddp":
            return self._ddp_round()
        inner_seconds, codec_seconds, sent = [], [], []
        outgoing: dict[str, dict[str, bytes]] = {}
        for replica in self.replicas:
            replica.reset_to_global()
            start = time.perf_counter()
            for _ in range(self.method.inner_steps):
                replica.trainer.train_step()
            inner_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            delta = pseudo_gradient(replica.global_params, replica.local_params())
            outgoing[replica.id] = self._encode(replica, delta)
            codec_seconds.append(time.perf_counter() - start)
            sent.append(sum(len(b) for b in outgoing[replica.id].values()))
        for i, replica in enumerate(self.replicas):
            start = time.perf_counter()
            self._apply(replica, outgoing)
            codec_seconds[i] += time.perf_counter() - start
        self.round += 1
        return self._stats(sent, 1, codec_seconds, inner_seconds)

    def _encode(self, replica: _Replica, delta: Params) -> dict[str, bytes]:
        if replica.feedback is None:
            return self._encode_dense(replica.id, delta)
        compressed = replica.feedback.compress(delta)
        return {
            shard: encode_payload(
                SyncPayload(replica.id, self.round, shard, "sparseloco", {n: compressed[n] for n in names})
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

    def _apply(self, replica: _Replica, outgoing: dict[str, dict[str, bytes]]) -> None:
        """Decode every contributor's bytes, aggregate per shard, take the outer step on the global copy."""
        for shard, spec in self.specs.items():
            decoded: list[DecodedPayload] = [decode_payload(msgs[shard], spec) for msgs in outgoing.values()]
            params = {n: replica.global_params[n] for n in spec.shapes}
            if self.method.kind == "sparseloco":
                delta = aggregate_sparse([(d.replica, d.sparse) for d in decoded], dict(spec.shapes))
                outer_sgd_step(
                    params, delta, lr=self.method.outer_lr, weight_decay=self.config.outer.weight_decay
                )
            else:
                delta = aggregate_dense([(d.replica, d.dense) for d in decoded])
                replica.outer.step(params, delta)

    def _ddp_round(self) -> RoundStats:
        replica = self.replicas[0]
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
        return self._stats([sent], self.method.inner_steps, [codec], [inner])

    def _stats(self, sent: list[int], syncs: int, codec: list[float], inner: list[float]) -> RoundStats:
        trainer = self.replicas[0].trainer
        self.replicas[0].reset_to_global()  # evaluate the global model
        eval_loss = trainer.evaluate()
        return RoundStats(
            round=self.round,
            steps=trainer.step,
            tokens=sum(r.trainer.tokens for r in self.replicas),
            eval_loss=eval_loss,
            bytes_per_replica=round(sum(sent) / len(sent)),
            dense_fp32_bytes=self._dense_bytes * syncs,
            syncs=syncs,
            codec_seconds=sum(codec) / len(codec),
            inner_seconds=sum(inner) / len(inner),
        )

    def global_params(self, replica: int) -> Params:
        return self.replicas[replica].global_params
