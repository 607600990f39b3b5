"""`hetnode bootstrap`, `join` and `status` as real processes on loopback (each with its own p2pd)."""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = pytest.mark.slow

N_LAYERS = 4  # tiny


def by_role(document: dict, role: str) -> list[dict]:
    return [p for p in document["peers"] if p["role"] == role]


def live_chains(document: dict) -> list[dict]:
    return [c for c in document["chains"] if c["live"]]


def covered_layers(document: dict, chain: dict) -> list[int]:
    peers = {p["peer_id"]: p for p in document["peers"]}
    layers = []
    for peer_id in chain["stages"]:
        first, last = peers[peer_id]["layers"]
        layers.extend(range(first, last + 1))
    return layers


def one_live_chain_of(stages: int):
    def check(document: dict) -> bool:
        chains = live_chains(document)
        return len(chains) == 1 and len(chains[0]["stages"]) == stages

    return check


def test_swarm_assembles_heals_and_shuts_down_cleanly(swarm):
    config = swarm.config(pipeline={"stages": 3})
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    peers = [("anchor-1", "1000"), ("anchor-2", "1000"), ("edge-1", "20"), ("edge-2", "20"), ("edge-3", "20")]
    joined = {name: swarm.join(name, boot.maddr, bandwidth) for name, bandwidth in peers}
    for daemon in joined.values():
        daemon.wait_ready()
        assert daemon.live_p2pd(), f"{daemon.name} runs no p2pd"
    assert joined["anchor-1"].ready["link_class"] == "high" and joined["edge-1"].ready["link_class"] == "low"

    def formed(document: dict) -> bool:
        return len(by_role(document, "anchor")) == 2 and one_live_chain_of(3)(document)

    document = swarm.wait_for(boot.maddr, formed, timeout=60, what="2 anchors and one live chain of 3")
    [chain] = live_chains(document)
    assert covered_layers(document, chain) == list(range(N_LAYERS))  # every layer exactly once, in order
    assert {p["name"] for p in by_role(document, "stage")} == {"edge-1", "edge-2", "edge-3"}
    assert [p["role"] for p in document["peers"]].count("coordinator") == 1
    for anchor in by_role(document, "anchor"):
        assert anchor["layers"] == [0, N_LAYERS - 1] and anchor["up_mbps"] == 1000.0

    # kill -9 a chain member: its p2pd dies with it, and the chain dissolves at the next boundary
    victim_id = chain["stages"][1]
    victim = next(d for d in joined.values() if d.peer_id == victim_id)
    victim_p2pd = victim.live_p2pd()
    victim.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    while victim_p2pd and any(True for _ in victim.live_p2pd()) and time.monotonic() - killed_at < 10:
        time.sleep(0.2)
    assert not victim.live_p2pd(), "p2pd outlived a kill -9 of its daemon by 10 s"

    def dissolved(document: dict) -> bool:
        ids = {p["peer_id"] for p in document["peers"]}
        return victim_id not in ids and not live_chains(document) and len(by_role(document, "idle")) == 2

    swarm.wait_for(boot.maddr, dissolved, timeout=30, what="the chain dissolves, its members idle")

    # another low peer arrives: a chain forms again
    newcomer = swarm.join("edge-4", boot.maddr, "20")
    newcomer.wait_ready()
    document = swarm.wait_for(boot.maddr, one_live_chain_of(3), timeout=45, what="a new live chain of 3")
    [chain] = live_chains(document)
    assert newcomer.peer_id in chain["stages"]
    assert covered_layers(document, chain) == list(range(N_LAYERS))

    # SIGTERM everybody: each exits 0, announces offline, and leaves no p2pd behind
    p2pd = [pid for d in swarm.daemons if d is not victim for pid in d.live_p2pd()]
    assert len(p2pd) == 1 + 5  # bootstrap + 4 live joiners + the newcomer - the victim
    codes = swarm.stop_all()
    assert {name: code for name, code in codes.items() if name != victim.name} == {
        d.name: 0 for d in swarm.daemons if d is not victim
    }
    assert not swarm.leftover_p2pd()


def test_bootstrap_restart_keeps_identity_and_address(swarm, tmp_path):
    config = swarm.config()
    data_dir = tmp_path / "coordinator"
    boot = swarm.bootstrap(config, data_dir=data_dir)
    first = boot.wait_ready()
    anchor = swarm.join("anchor", boot.maddr, "1000")
    edge = swarm.join("edge", boot.maddr, "20")
    anchor.wait_ready()
    edge.wait_ready()
    swarm.wait_for(boot.maddr, lambda d: len(d["peers"]) == 3, timeout=30, what="3 peers")

    assert boot.stop() == 0
    restarted_at = time.time()
    again = swarm.bootstrap(config, data_dir=data_dir)
    second = again.wait_ready()
    assert second["peer_id"] == first["peer_id"]
    assert second["maddrs"] == first["maddrs"]
    assert second["run"] == first["run"]

    def peers_kept_working(document: dict) -> bool:
        fresh = {p["name"] for p in document["peers"] if p["last_seen"] > restarted_at + 1}
        return {"anchor", "edge", "coordinator"} <= fresh

    document = swarm.wait_for(
        again.maddr, peers_kept_working, timeout=30, what="heartbeats after the restart"
    )
    assert document["run"] == first["run"]
    late = swarm.join("late", again.maddr, "1000")  # the restarted coordinator still admits peers
    late.wait_ready()
    assert anchor.proc.poll() is None and edge.proc.poll() is None


def test_join_refuses_a_swarm_of_another_protocol_version(swarm):
    boot = swarm.bootstrap(swarm.config(), extra=["--protocol-version", "99"])
    boot.wait_ready()
    peer = swarm.join("newcomer", boot.maddr, "100")
    assert peer.proc.wait(60) == 1
    assert "protocol version 99" in peer.tail() and "upgrade hetnode" in peer.tail()
    assert not peer.live_p2pd()


def test_join_explains_a_bad_peer_address(swarm):
    peer = swarm.join("lost", "/ip4/127.0.0.1/tcp/1", "100")
    assert peer.proc.wait(60) == 2  # an argument error: a service must not restart it
    assert "/p2p/<peer id>" in peer.tail()


def test_sigterm_while_waiting_for_the_swarm_exits_0(swarm):
    # a peer id nobody has: the joiner keeps waiting until it is told to stop
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    peer = swarm.join("patient", nobody, "100", extra=["--connect-timeout", "120"])
    time.sleep(8)
    assert peer.proc.poll() is None, peer.tail()
    assert peer.stop(signal.SIGTERM) == 0, peer.tail()
