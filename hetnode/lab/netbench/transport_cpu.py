"""What moving sync payloads costs the CPUs, measured: both daemons' and both p2pds' CPU seconds per byte.

A payload goes from one daemon through its p2pd (encrypted, multiplexed) to the other p2pd and daemon, where
its sha256 is checked. Where links are fast and cores are shared (the lab: seven anchors on one core), that
work, not the link, sets how fast a round's payloads spread.

`python -m hetnode.lab.netbench.transport_cpu --bytes N [--payloads K --rounds R]` starts two nodes on
loopback; one fetches K payloads of N bytes from the other R times (over streams as `fetch_sealed` opens
them), and it prints {"cpu_s_per_byte": …, "moved_bytes": …, "wall_s": …}: the CPU time of this process and of
both p2pds over the bytes moved. The scale calibration runs it in a process of its own
(`hetnode/lab/scale/dht.py`) and keeps the result beside its model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from hetnode.lab.nodes import nodes_on_loopback
from hetnode.net import loop

TICKS = os.sysconf("SC_CLK_TCK")


def children_cpu_s(parent: int, name: str) -> float:
    """CPU seconds (user + system) of the live processes named `name` whose parent is `parent`."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if comm == name and int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def cpu_now() -> float:
    return time.process_time() + children_cpu_s(os.getpid(), "p2pd")


async def measure(payload_bytes: int, payloads: int, rounds: int) -> dict[str, float]:
    async with nodes_on_loopback(2) as (author, fetcher):
        owner = author.identity.peer_id
        held = {str(i): os.urandom(payload_bytes) for i in range(payloads)}
        digests = {shard: hashlib.sha256(data).hexdigest() for shard, data in held.items()}
        author.set_payloads(lambda round_, shard, replica, asker: held.get(shard))
        wanted = [(shard, owner) for shard in held]

        async def fetch_all() -> None:
            got = await fetcher.fetch_payloads(owner, 0, wanted, payload_bytes + 1024)
            for (shard, _), data in zip(wanted, got, strict=True):
                if hashlib.sha256(data).hexdigest() != digests[shard]:
                    raise RuntimeError(f"payload {shard} arrived damaged")

        await fetch_all()  # once unmeasured: connections, buffers and lazy imports
        cpu, started = cpu_now(), time.perf_counter()
        for _ in range(rounds):
            await fetch_all()
        wall_s, cpu_s = time.perf_counter() - started, cpu_now() - cpu
        moved = rounds * payloads * payload_bytes
        return {"cpu_s_per_byte": cpu_s / moved, "moved_bytes": moved, "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--payloads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not 0 < args.bytes <= 16 * 2**20 or not 1 <= args.payloads <= 64 or not 1 <= args.rounds <= 100:
        parser.error("--bytes 1..16 MiB, --payloads 1..64, --rounds 1..100")
    print(json.dumps(loop.run(measure(args.bytes, args.payloads, args.rounds))))


if __name__ == "__main__":
    main()
