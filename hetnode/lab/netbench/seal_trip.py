"""The seal's way through the DHT, timed: a sealer stores a seal-sized entry, a replica reads a copy.

`python -m hetnode.lab.netbench.seal_trip --bytes N [--peers P --tries T]` starts P nodes on loopback, times T
stores and reads, prints {"store_s": …, "read_s": …} (medians) and shuts every node down. The scale
calibration runs it (`hetnode/lab/scale/dht.py`: the bench layer starts networking in processes of its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgpack

from hetnode.lab.nodes import nodes_on_loopback
from hetnode.net import loop


def seal_of_size(round_: int, nbytes: int) -> dict:
    """A schema-valid seal of about `nbytes` (msgpack): contributions of two shards each, as many as fit."""
    seal = {"round": round_, "contributions": [], "excluded": [], "sealed_at": time.time(), "prev": "0" * 64}
    while len(msgpack.packb(seal, use_bin_type=True)) < nbytes and len(seal["contributions"]) < 1024:
        peer = f"Q{len(seal['contributions']):045d}"
        seal["contributions"].append(
            {"peer": peer, "shards": {"embed": "0" * 64, "head": "0" * 64}, "tokens": 1}
        )
    return seal


async def measure(seal_bytes: int, peers: int, tries: int) -> dict[str, float]:
    async with nodes_on_loopback(peers, "seal-trip") as nodes:
        sealer, reader = nodes[0], nodes[-1]
        stores, reads = [], []
        for i in range(tries):
            value = seal_of_size(i, seal_bytes)
            started = time.perf_counter()
            await sealer.store_own("seal", value, 600.0)
            stores.append(time.perf_counter() - started)
            started = time.perf_counter()
            await reader.read_field("seal", latest=False)
            reads.append(time.perf_counter() - started)
        return {"store_s": statistics.median(stores), "read_s": statistics.median(reads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--peers", type=int, default=10)
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    if not 2 <= args.peers <= 64 or not 1 <= args.tries <= 100 or not 0 < args.bytes <= 256 * 1024:
        parser.error("--peers 2..64, --tries 1..100, --bytes 1..262144")
    print(json.dumps(loop.run(measure(args.bytes, args.peers, args.tries))))


if __name__ == "__main__":
    main()
