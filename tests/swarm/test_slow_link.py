"""A volunteer on a 2 Mbit/s link (below every role's minimum: it waits idle) is still a member of the
swarm: its record is stored and read by the coordinator, no store of it fails, and what the swarm's control
plane moves over its link leaves most of the link free. Real daemons in lab namespaces, the slow host's link
shaped by `tc` (root)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from hetnode.bench.netlab import NetLab

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="needs root with `ip` and `tc`",
    ),
]

SLOW_MBIT = 2.0
WATCH_S = 60.0
# heartbeats and reads at their base all the way (no stretching): the worst case for the control plane
LAB_NETWORK = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "stable_heartbeat_s": 2.0, "boundary_s": 4.0}
FAILED_STORES = ("no DHT node accepted", "timed out")


def test_a_peer_on_a_2_mbit_link_is_stored_read_and_keeps_most_of_its_link(swarm):
    lab = NetLab({"coord": None, "fast-1": None, "fast-2": None, "slow": SLOW_MBIT})
    with lab:
        hosts = lab.hosts
        config = swarm.config(outer={"inner_steps": 10}, network=LAB_NETWORK)
        boot = swarm.start(
            "bootstrap",
            ["bootstrap", "--config", str(config), "--listen", f"/ip4/{hosts['coord'].address}/tcp/0"]
            + ["--data-dir", str(swarm.tmp_path / "bootstrap"), "--http-port", "0"],
            prefix=hosts["coord"].prefix,
        )
        boot.wait_ready()
        try:
            for name in ("fast-1", "fast-2"):
                swarm.join(
                    name,
                    boot.maddr,
                    "1000",
                    listen=f"/ip4/{hosts[name].address}/tcp/0",
                    prefix=hosts[name].prefix,
                )
            slow = swarm.join(
                "slow",
                boot.maddr,
                f"{SLOW_MBIT:g}",
                listen=f"/ip4/{hosts['slow'].address}/tcp/0",
                prefix=hosts["slow"].prefix,
            )
            for daemon in swarm.daemons[1:]:
                daemon.wait_ready()
            swarm.wait_for_history(lambda h: len(h) >= 2, timeout=120, what="two sealed rounds")
            rx0, tx0 = lab.interface_bytes("slow")
            sealed0 = len(swarm.history())
            started = time.monotonic()
            time.sleep(WATCH_S)
            rx1, tx1 = lab.interface_bytes("slow")
            took = time.monotonic() - started
            rounds = len(swarm.history()) - sealed0
            peers = {p["peer_id"]: p for p in swarm.status(boot.maddr, hosts["coord"].prefix)["peers"]}
        finally:
            swarm.stop_all()
    assert slow.peer_id in peers, "the coordinator does not see the slow peer's record"
    assert peers[slow.peer_id]["class"] == "slow" and peers[slow.peer_id]["role"] == "idle"
    log = slow.log_path.read_text()
    assert not [line for line in log.splitlines() if any(f in line for f in FAILED_STORES)], log[-3000:]
    used = {"down": rx1 - rx0, "up": tx1 - tx0}
    share = {k: v * 8 / took / (SLOW_MBIT * 1e6) for k, v in used.items()}
    print(f"\nslow peer over {took:.0f} s ({rounds} rounds sealed): {used} bytes, {share} of its link")
    assert rounds >= 5  # the swarm trained meanwhile
    assert max(share.values()) < 0.25, share
