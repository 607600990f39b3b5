"""Volunteers behind masquerading NAT routers (no port forward, no public address) join, say truthfully that
they are reached through a relay, and contribute: an anchor's payloads are in sealed rounds, and so are those
of a chain whose second stage is behind NAT (its activation streams cross the relay). A peer on the open
network says it is reached directly. Real daemons in lab namespaces (`hetnode/lab/netlab/nat.py`); root and
iptables only."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hetnode.lab.netlab.nat import NatLab
from hetnode.lab.procs import HETNODE, REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "tc", "iptables")),
        reason="needs root with `ip`, `tc` and `iptables` to build a NAT router in namespaces",
    ),
]

FAST_ROUNDS = {"inner_steps": 10}


def reachability(daemon) -> str:
    lines = [line for line in daemon.lines if line.startswith("reachability:")]
    assert lines, f"{daemon.name} printed no reachability line:\n{daemon.tail()}"
    return lines[0]


def status_ok(peer: str, prefix: list[str]) -> bool:
    """Does `hetnode status --peer` from a lab host reach `peer` (a full multiaddr)?"""
    result = subprocess.run(
        [*prefix, *HETNODE, "status", "--peer", peer, "--json", "--timeout", "15"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    return result.returncode == 0


def join_open_and_natted(swarm, boot, hosts, open_peer: tuple[str, str], natted: str, mbit: str):
    """Two volunteers declaring `mbit`: (name, lab host) on the open network, and `natted` behind its
    router (listening on every address it has, as at home); both READY."""
    name, host = open_peer
    daemons = (
        swarm.join(
            name, boot.maddr, mbit, listen=f"/ip4/{hosts[host].address}/tcp/0", prefix=hosts[host].prefix
        ),
        swarm.join(natted, boot.maddr, mbit, listen="/ip4/0.0.0.0/tcp/0", prefix=hosts[natted].prefix),
    )
    for daemon in daemons:
        daemon.wait_ready()
    return daemons


def test_volunteers_behind_nat_are_relayed_and_contribute_as_an_anchor_and_as_a_chain_stage(swarm):
    hosts_spec = {"coord": None, "open": None, "open-stage": None, "home": None, "home-2": None}
    lab = NatLab(hosts_spec, behind_nat={"volunteer": "home", "stage-nat": "home-2"})
    with lab:
        hosts = lab.hosts
        boot = swarm.start(
            "bootstrap",
            [
                "bootstrap",
                "--config",
                str(swarm.config(outer=FAST_ROUNDS, pipeline={"stages": 2})),
                "--listen",
                f"/ip4/{hosts['coord'].address}/tcp/0",
                "--data-dir",
                str(swarm.tmp_path / "bootstrap"),
            ],
            prefix=hosts["coord"].prefix,
        )
        boot.wait_ready()
        try:
            direct, natted = join_open_and_natted(swarm, boot, hosts, ("direct", "open"), "volunteer", "1000")
            print(f"\n{reachability(direct)}\n{reachability(natted)}")
            assert reachability(direct).startswith("reachability: reachable (direct)"), reachability(direct)
            assert reachability(natted).startswith("reachability: reachable (relayed)"), reachability(natted)

            # what the line claims, checked from the open network: no direct path, a relayed one
            maddrs = natted.ready["maddrs"].split(",")
            circuit = [m for m in maddrs if "/p2p-circuit/" in m]
            assert circuit and circuit[0].startswith(boot.maddr), maddrs
            private = [m for m in maddrs if m.startswith(f"/ip4/{hosts['volunteer'].address}/")]
            assert private and not status_ok(private[0], hosts["open"].prefix)
            assert status_ok(circuit[0], hosts["open"].prefix)

            history = swarm.wait_for_history(
                lambda h: any(natted.peer_id in e["contributors"] for e in h),
                timeout=120,
                what="a round sealed with the NAT'd volunteer's payloads",
            )
            sealed = next(e for e in history if natted.peer_id in e["contributors"])
            assert direct.peer_id in sealed["contributors"]

            # a chain of two on slow links, one stage behind NAT: activations cross the relay
            stage_open, stage_nat = join_open_and_natted(
                swarm, boot, hosts, ("stage-open", "open-stage"), "stage-nat", "20"
            )
            print(f"{reachability(stage_nat)}")
            assert reachability(stage_nat).startswith("reachability: reachable (relayed)")
            history = swarm.wait_for_history(
                lambda h: any({stage_nat.peer_id, stage_open.peer_id} <= set(e["contributors"]) for e in h),
                timeout=240,
                what="a round sealed with the chain whose stage is behind NAT",
            )
            assert natted.peer_id in history[-1]["contributors"]  # the NAT'd anchor is still in
        finally:
            swarm.stop_all()  # before the namespaces go
