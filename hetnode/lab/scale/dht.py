"""The network software's costs on this machine, for the calibration's model: the seal's way through the
DHT, and the CPU that moving payloads takes.

Between the coordinator's check of the last payload and a replica's first fetch, the seal is stored in the DHT
and read back (`Sealer`, `SealWaiter`): two DHT operations, each a few RPCs through hivemind and p2pd. On the
lab's sub-millisecond links they cost what the software costs, which a link model with RTTs alone leaves out.
`hetnode.lab.netbench.seal_trip` measures both on loopback nodes in a process of its own, as `scale_cpu`
measures the CPU term (docs/scale.md, "Link-bound runs"). `hetnode.lab.netbench.transport_cpu` measures the
CPU seconds per byte a payload costs the sending and receiving daemons and p2pds together.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from hetnode.errors import HetnodeError


@dataclass(frozen=True)
class SealTrip:
    store_s: float  # the sealer's store of a seal-sized entry (median)
    read_s: float  # a replica's read of its first copy (median)

    @property
    def total_s(self) -> float:
        return self.store_s + self.read_s


def _run_json(argv: list[str], what: str) -> dict:
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise HetnodeError(f"measuring {what} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_transport_cpu(payload_bytes: int, payloads: int = 8, rounds: int = 6) -> float:
    """CPU seconds per byte moved from one loopback node to another, both ends' daemons and p2pds."""
    argv = ["hetnode.lab.netbench.transport_cpu", "--bytes", str(payload_bytes)]
    argv += ["--payloads", str(payloads), "--rounds", str(rounds)]
    return float(_run_json(argv, "the transport's CPU")["cpu_s_per_byte"])


def measure_seal_trip(seal_bytes: int, peers: int = 10, tries: int = 5) -> SealTrip:
    """Store a `seal_bytes` entry from one of `peers` loopback nodes and read it from another, `tries`
    times (medians)."""
    argv = [
        "hetnode.lab.netbench.seal_trip",
        "--bytes",
        str(seal_bytes),
        "--peers",
        str(peers),
        "--tries",
        str(tries),
    ]
    return SealTrip(**_run_json(argv, "the seal's DHT trip"))
