"""Links as volunteers have them, with real daemons in lab namespaces (root):

- a volunteer on a 2 Mbit/s link (below every role's minimum: it waits idle) is still a member of the
  swarm: its record is stored and read by the coordinator, no store of it fails, and what the swarm's
  control plane moves over its link leaves most of the link free;
- an anchor whose link goes down for 30 s (its DHT neighbours all drop it, and it drops them) is back in a
  sealed round within seconds of the link coming back, without anyone restarting."""

from __future__ import annotations

import subprocess
import time

import pytest

from hetnode.lab.netlab.hosts import NetLab, lab_unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable()),
]

SLOW_MBIT = 2.0
WATCH_S = 60.0
# heartbeats and reads at their base all the way (no stretching): the worst case for the control plane
LAB_NETWORK = {"heartbeat_s": 2.0, "record_ttl_s": 8.0, "stable_heartbeat_s": 2.0, "boundary_s": 4.0}
# an anchor on a 100 Mbit/s link (the far one) is an anchor here, as in the soak
LAB_NETWORK |= {"anchor_min_up_mbps": 50.0, "anchor_min_down_mbps": 50.0}
FAILED_STORES = ("no DHT node accepted", "timed out")
LINK_DOWN_S = 30.0
BACK_WITHIN_S = 30.0  # from the link coming back to a sealed round with the anchor in it


def start_coordinator(swarm, host):
    """The coordinator on lab host `host`, READY, with rounds of 10 steps and the lab's heartbeats."""
    config = swarm.config(outer={"inner_steps": 10}, network=LAB_NETWORK)
    boot = swarm.start(
        "bootstrap",
        ["bootstrap", "--config", str(config), "--listen", f"/ip4/{host.address}/tcp/0"]
        + ["--data-dir", str(swarm.tmp_path / "bootstrap"), "--http-port", "0"],
        prefix=host.prefix,
    )
    boot.wait_ready()
    return boot


def join_on(swarm, boot, hosts, name: str, mbit: str):
    """A volunteer `name` on the lab host of that name, declaring `mbit`."""
    host = hosts[name]
    return swarm.join(name, boot.maddr, mbit, listen=f"/ip4/{host.address}/tcp/0", prefix=host.prefix)


def test_a_2_mbit_peer_is_stored_and_keeps_its_link_and_an_anchor_is_back_soon_after_a_link_outage(swarm):
    lab = NetLab({"coord": None, "fast-1": None, "fast-2": None, "slow": SLOW_MBIT})
    with lab:
        hosts = lab.hosts
        boot = start_coordinator(swarm, hosts["coord"])
        try:
            for name in ("fast-1", "fast-2"):
                join_on(swarm, boot, hosts, name, "1000")
            slow = join_on(swarm, boot, hosts, "slow", f"{SLOW_MBIT:g}")
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
            slow_log = slow.log_path.read_text()  # before the outage below, which is not the slow peer's

            fast = swarm.daemons[2]  # fast-2
            link = ["ip", "-n", hosts["fast-2"].namespace, "link", "set", hosts["fast-2"].device]
            subprocess.run([*link, "down"], check=True)
            time.sleep(LINK_DOWN_S)
            subprocess.run([*link, "up"], check=True)
            back_at, sealed_then = time.monotonic(), len(swarm.history())
            swarm.wait_for_history(
                lambda h: any(fast.peer_id in e["contributors"] for e in h[sealed_then:]),
                timeout=BACK_WITHIN_S + 60,
                what="a sealed round with the anchor whose link was down",
            )
            back_in = time.monotonic() - back_at
        finally:
            swarm.stop_all()
    assert slow.peer_id in peers, "the coordinator does not see the slow peer's record"
    assert peers[slow.peer_id]["class"] == "slow" and peers[slow.peer_id]["role"] == "idle"
    failed = [line for line in slow_log.splitlines() if any(f in line for f in FAILED_STORES)]
    assert not failed, slow_log[-3000:]
    used = {"down": rx1 - rx0, "up": tx1 - tx0}
    share = {k: v * 8 / took / (SLOW_MBIT * 1e6) for k, v in used.items()}
    print(f"\nslow peer over {took:.0f} s ({rounds} rounds sealed): {used} bytes, {share} of its link")
    assert rounds >= 5  # the swarm trained meanwhile
    assert max(share.values()) < 0.15, share  # a DHT client: it serves no replica of anyone's records
    print(f"anchor back in a sealed round {back_in:.1f} s after its link came back")
    assert back_in <= BACK_WITHIN_S


def test_an_anchor_150_ms_away_catches_up_and_contributes_within_a_few_rounds_of_joining(swarm):
    """θ is served for the round its source holds; a far peer fetching it shard by shard, an RTT and a slow
    start each, could not finish within a round and chased the swarm for many rounds."""
    lab = NetLab({"coord": None, "near": None, "far": "far-fast"})
    with lab:
        hosts = lab.hosts
        boot = start_coordinator(swarm, hosts["coord"])
        try:
            join_on(swarm, boot, hosts, "near", "1000").wait_ready()
            swarm.wait_for_history(lambda h: len(h) >= 3, timeout=120, what="three sealed rounds")
            far = join_on(swarm, boot, hosts, "far", "100")
            far.wait_ready()
            joined_at = len(swarm.history())
            history = swarm.wait_for_history(
                lambda h: any(far.peer_id in e["contributors"] for e in h),
                timeout=180,
                what="a sealed round with the far anchor",
            )
            first = next(i for i, e in enumerate(history) if far.peer_id in e["contributors"])
        finally:
            swarm.stop_all()
    print(f"\nthe far anchor was in a seal {first + 1 - joined_at} rounds after it was READY")
    assert first + 1 - joined_at <= 4, far.log_path.read_text()[-3000:]
