"""Bytes one replica's SparseLoCo payload weighs on the wire with and without its author's signed envelope,
against dense fp32, per config (what docs/security.md and BENCHMARKS.md quote).

Pseudo-gradients are random (the sizes are fixed by the shapes and the codec, not by the values).

    .venv/bin/python benchmarks/signed_payload_size.py --configs tiny small
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.config import load_config
from hetnode.net.identity import ephemeral_identity
from hetnode.net.signing import sign_payload
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.sync_payload import SyncPayload, encode_payload

ROOT = Path(__file__).resolve().parents[1]


def measure(name: str) -> dict[str, float]:
    config = load_config(ROOT / "configs" / f"{name}.toml")
    model = GlobalModel(config)
    codec = SparseLoCoCodec(config.outer.topk, config.outer.tile)
    author = ephemeral_identity()
    generator = torch.Generator().manual_seed(0)
    message_bytes = signed_bytes = 0
    for shard, names in model.shards.items():
        tensors = {n: codec.compress(torch.randn(model.params[n].shape, generator=generator)) for n in names}
        body = encode_payload(SyncPayload(author.peer_id, 0, shard, "sparseloco", tensors))
        message_bytes += len(body)
        signed_bytes += len(sign_payload(author, "run", body))
    dense = model.dense_bytes(model.shards)
    return {
        "shards": len(model.shards),
        "message_bytes": message_bytes,
        "signed_bytes": signed_bytes,
        "envelope_bytes_per_shard": (signed_bytes - message_bytes) / len(model.shards),
        "ratio_message": round(dense / message_bytes, 1),
        "ratio_signed": round(dense / signed_bytes, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    args = parser.parse_args()
    print(json.dumps({name: measure(name) for name in args.configs}, indent=1))


if __name__ == "__main__":
    main()
