"""Reachability verdicts over address sets: a table of cases, each with the fix a user would need."""

from __future__ import annotations

import pytest

from hetnode.planning.reachability import assess, judge

ID = "/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PUBLIC_SWARM = f"/ip4/1.2.3.4/tcp/31337{ID}"
LAN_SWARM = f"/ip4/192.168.1.10/tcp/31337{ID}"
LOCAL_SWARM = f"/ip4/127.0.0.1/tcp/31337{ID}"


@pytest.mark.parametrize(
    ("own", "contact", "verdict", "relayed", "needs_fix"),
    [
        (["/ip4/9.9.9.10/tcp/4001", "/ip4/10.0.0.2/tcp/4001"], PUBLIC_SWARM, "reachable", False, False),
        (["/ip4/10.0.0.2/tcp/4001", "/ip4/127.0.0.1/tcp/4001"], PUBLIC_SWARM, "unreachable", False, True),
        (
            [f"/ip4/5.6.7.8/tcp/4001{ID}/p2p-circuit", "/ip4/10.0.0.2/tcp/4001"],
            PUBLIC_SWARM,
            "reachable",
            True,
            True,
        ),
        (["/ip4/192.168.1.11/tcp/4001"], LAN_SWARM, "local-only", False, False),
        (["/ip4/127.0.0.1/tcp/4001"], LOCAL_SWARM, "local-only", False, False),
        (["/ip4/127.0.0.1/tcp/4001"], LAN_SWARM, "unreachable", False, True),
    ],
)
def test_verdicts(own, contact, verdict, relayed, needs_fix):
    result = assess(own, contact)
    assert (result.verdict, result.relayed, bool(result.fix)) == (verdict, relayed, needs_fix)
    assert result.line().startswith(f"reachability: {verdict}")


def test_the_fix_names_the_port_to_forward():
    result = assess(["/ip4/10.0.0.2/tcp/4711"], PUBLIC_SWARM)
    assert (
        "forward TCP port 4711" in result.fix
        and "--announce-maddr /ip4/<your public IP>/tcp/4711" in result.fix
    )


def test_a_verdict_from_real_dials_names_the_path_it_found():
    own = ["/ip4/192.168.1.2/tcp/4711", "/ip4/127.0.0.1/tcp/4711"]
    direct = judge(True, None, own, LAN_SWARM)
    assert direct.line().startswith("reachability: reachable (direct): ") and not direct.fix
    circuit = [*own, f"/ip4/10.0.0.1/tcp/31337{ID}/p2p-circuit{ID}"]
    relayed = judge(False, True, circuit, LAN_SWARM, relay=ID[5:])
    assert relayed.line().startswith("reachability: reachable (relayed): ")
    assert "forward TCP port 4711" in relayed.fix  # the way to go direct
    stuck = judge(False, False, own, LAN_SWARM)
    assert stuck.verdict == "unreachable" and "serves relays" in stuck.fix
    assert judge(None, None, own, LAN_SWARM) == assess(own, LAN_SWARM)  # no dial-back: from addresses
