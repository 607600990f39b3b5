"""The bandwidth probe against a real shaped link: two network namespaces joined by a veth pair, the
joiner's side limited to 20 Mbit/s with `tc`. Needs root and `ip netns` (CI runs as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="needs root with `ip` and `tc` to create network namespaces and shape a link",
    ),
]

RATE_MBIT = 20.0


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def shaped_pair():
    """Namespaces `coord` (10.231.x.1) and `edge` (10.231.x.2); `edge`'s egress shaped to 20 Mbit/s."""
    tag = uuid.uuid4().hex[:6]
    coord, edge = f"hn-c-{tag}", f"hn-e-{tag}"
    subnet = f"10.231.{int(tag[:2], 16)}"
    veth_c, veth_e = f"vc{tag}", f"ve{tag}"
    try:
        sh("ip", "netns", "add", coord)
        sh("ip", "netns", "add", edge)
        sh("ip", "link", "add", veth_c, "type", "veth", "peer", "name", veth_e)
        sh("ip", "link", "set", veth_c, "netns", coord)
        sh("ip", "link", "set", veth_e, "netns", edge)
        sh("ip", "-n", coord, "addr", "add", f"{subnet}.1/24", "dev", veth_c)
        sh("ip", "-n", edge, "addr", "add", f"{subnet}.2/24", "dev", veth_e)
        for ns, dev in ((coord, veth_c), (edge, veth_e)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"coord": coord, "edge": edge, "subnet": subnet, "edge_dev": veth_e}
    finally:
        for ns in (coord, edge):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_probe_measures_a_shaped_link_and_classes_the_peer(swarm, shaped_pair):
    coord, edge, subnet = shaped_pair["coord"], shaped_pair["edge"], shaped_pair["subnet"]
    # thresholds between the shaped rate and what an unshaped veth moves here (>500 Mbit/s)
    config = swarm.config(network={"anchor_min_up_mbps": 150.0, "anchor_min_down_mbps": 150.0})
    boot = swarm.start(
        "bootstrap",
        [
            "bootstrap",
            "--config",
            str(config),
            "--listen",
            f"/ip4/{subnet}.1/tcp/0",
            "--data-dir",
            str(swarm.tmp_path / "boot"),
        ],
        prefix=["ip", "netns", "exec", coord],
    )
    boot.wait_ready()
    in_edge = ["ip", "netns", "exec", edge]
    listen = f"/ip4/{subnet}.2/tcp/0"

    fast = swarm.join("fast", boot.maddr, "auto", listen=listen, prefix=in_edge)
    unshaped = fast.wait_ready()
    assert unshaped["link_class"] == "high", unshaped
    assert float(unshaped["up_mbps"]) > 150
    # an anchor in the same namespace would be a probe target behind no shaping at all: stop it
    assert fast.stop() == 0

    sh(
        "ip",
        "netns",
        "exec",
        edge,
        "tc",
        "qdisc",
        "add",
        "dev",
        shaped_pair["edge_dev"],
        "root",
        "tbf",
        "rate",
        "20mbit",
        "burst",
        "32kbit",
        "latency",
        "400ms",
    )
    shaped = swarm.join("slow", boot.maddr, "auto", listen=listen, prefix=in_edge).wait_ready()
    up = float(shaped["up_mbps"])
    print(f"probe over a {RATE_MBIT} Mbit/s link: up {up} Mbit/s, unshaped {unshaped['up_mbps']} Mbit/s")
    assert 0.75 * RATE_MBIT <= up <= 1.25 * RATE_MBIT, f"measured {up} Mbit/s over a {RATE_MBIT} Mbit/s link"
    assert float(shaped["down_mbps"]) > 150  # only the edge's egress is shaped
    assert shaped["link_class"] == "low"

    document = swarm.status(boot.maddr, prefix=in_edge)
    classes = {p["name"]: (p["class"], p["role"]) for p in document["peers"]}
    assert "fast" not in classes  # it announced going offline
    assert classes["slow"] == ("low", "idle")  # a stage candidate waiting for a chain
