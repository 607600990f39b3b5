"""SparseLoCo payload size and codec cost at a given model size, against the H inner steps it summarises.

Trains one replica for H real inner steps, takes its real pseudo-gradient, and for R replicas (the same
pseudo-gradient with a little per-replica noise) runs what a round costs each replica: error feedback +
encode of every shard, decode of all R contributors, aggregation and the outer step. Bytes come from the
encoded messages; the dense-fp32 reference is the encoded dense payload of the same tensors.

    .venv/bin/python benchmarks/codec_cost.py --config configs/small.toml --replicas 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hetnode.algo.aggregate import aggregate_sparse, outer_sgd_step
from hetnode.algo.sparseloco import DenseCodec, ErrorFeedback, SparseLoCoCodec, pseudo_gradient
from hetnode.config import load_config
from hetnode.data import TokenDataset
from hetnode.model import build_model, count_parameters
from hetnode.model.shards import shard_names
from hetnode.training.trainer import InnerTrainer
from hetnode.wire.sync_payload import ShardSpec, SyncPayload, decode_payload, encode_payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/small.toml"))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    config = load_config(args.config)
    outer = config.outer
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    trainer = InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset)
    start_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step()  # warm-up (allocations), not timed
    start = time.perf_counter()
    for _ in range(outer.inner_steps):
        trainer.train_step()
    inner_seconds = time.perf_counter() - start
    delta = pseudo_gradient(start_params, dict(trainer.model.named_parameters()))

    shards = shard_names(delta)
    max_bytes = int(config.network.max_frame_mb * 2**20)
    specs = {}
    for s, names in shards.items():
        shapes = {n: tuple(delta[n].shape) for n in names}
        specs[s] = ShardSpec(s, shapes, "sparseloco", outer.topk, outer.tile, max_bytes)
    generator = torch.Generator().manual_seed(0)
    payloads: dict[str, dict[str, bytes]] = {}
    encode_seconds = []
    for r in range(args.replicas):
        noisy = {n: t * (1 + 0.1 * torch.randn(t.shape, generator=generator)) for n, t in delta.items()}
        feedback = ErrorFeedback(SparseLoCoCodec(outer.topk, outer.tile), outer.error_feedback)
        start = time.perf_counter()
        compressed = feedback.compress(noisy)
        rid = f"replica-{r}"
        payloads[rid] = {
            s: encode_payload(SyncPayload(rid, 0, s, "sparseloco", {n: compressed[n] for n in names}))
            for s, names in shards.items()
        }
        encode_seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    for shard, spec in specs.items():
        decoded = [decode_payload(p[shard], spec) for p in payloads.values()]
        aggregate = aggregate_sparse([(d.replica, d.sparse) for d in decoded], dict(spec.shapes))
        outer_sgd_step({n: start_params[n] for n in spec.shapes}, aggregate, lr=outer.lr)
    apply_seconds = time.perf_counter() - start

    dense = DenseCodec("fp32")
    dense_bytes = sum(
        len(encode_payload(SyncPayload("d", 0, s, "fp32", {n: dense.compress(delta[n]) for n in names})))
        for s, names in shards.items()
    )
    sparse_bytes = sum(len(b) for b in payloads["replica-0"].values())
    codec_seconds = sum(encode_seconds) / len(encode_seconds) + apply_seconds
    result = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "replicas": args.replicas,
        "topk": outer.topk,
        "inner_steps": outer.inner_steps,
        "tokens_per_step": config.data.batch_size * config.data.seq_len,
        "sparse_payload_bytes": sparse_bytes,
        "dense_fp32_payload_bytes": dense_bytes,
        "compression_vs_dense_fp32": dense_bytes / sparse_bytes,
        "encode_seconds": sum(encode_seconds) / len(encode_seconds),
        "decode_aggregate_step_seconds": apply_seconds,
        "inner_seconds": inner_seconds,
        "codec_over_inner": codec_seconds / inner_seconds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"codec_cost_{config.run.name}.json").write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:>30}: {value:,.4f}" if isinstance(value, float) else f"{key:>30}: {value}")


if __name__ == "__main__":
    main()
