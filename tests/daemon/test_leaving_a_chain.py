"""A stage reads from the peers' records when its training in a chain is over (`reason_to_leave`): the chain
is not live any more, or another member caught it lying. The second matters because the neighbour that
caught it closed the stream, and a close need not reach the far end (seen in CI: a pool worker caught
sending gradients ×1000 sat in its chain's round for good, holding a stage role, while the chain went on)."""

from __future__ import annotations

from hetnode.daemon.chain import reason_to_leave
from hetnode.planning.roles import Candidate, format_layout, pack_chains, stage_pools
from hetnode.protocol.swarm_view import SwarmView


def records(plan, blame: dict[str, str]) -> dict[str, dict]:
    """Each member's record as it publishes it (`blame`: whom a member names as caught lying)."""
    return {
        s.peer_id: {
            "role": "stage",
            "chain": s.chain,
            "stage": s.stage,
            "layers": list(s.layers),
            "chain_layout": format_layout(s.layout),
            "chain_lineage": None,
            "chain_broken": None,
            "chain_blame": blame.get(s.peer_id),
            "chain_noshows": None,
        }
        for s in plan.stages
    }


def test_a_worker_another_member_caught_lying_leaves_and_the_others_go_on():
    peers = [Candidate("first", 4.0), Candidate("honest", 2.0), Candidate("liar", 1.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3, stage_workers=2)
    assert stage_pools(plan.stages[0].layout)[1][0] == ("honest", "liar")
    before = SwarmView(records(plan, {}), 2, 4, stage_workers=2)
    assert all(reason_to_leave(before, plan.chain, p.peer_id) is None for p in peers)

    caught = SwarmView(records(plan, {"first": "liar"}), 2, 4, stage_workers=2)
    assert "sent what no honest stage sends" in reason_to_leave(caught, plan.chain, "liar")
    assert reason_to_leave(caught, plan.chain, "first") is None  # live without it: the pool has another
    assert reason_to_leave(caught, plan.chain, "honest") is None
    # a member's blame is its own word (docs/security.md): one naming its pool's other worker has it leave
    named = SwarmView(records(plan, {"liar": "honest"}), 2, 4, stage_workers=2)
    assert "sent what no honest stage sends" in reason_to_leave(named, plan.chain, "honest")
    # a stranger's record names nobody: its claim does not commit to the chain's name
    strangers = records(plan, {}) | {"stranger": records(plan, {"first": "liar"})["first"]}
    assert reason_to_leave(SwarmView(strangers, 2, 4, stage_workers=2), plan.chain, "liar") is None


def test_a_chain_the_records_no_longer_show_live_is_left():
    peers = [Candidate("first", 4.0), Candidate("second", 2.0)]
    [plan] = pack_chains(peers, 2, n_layers=4, boundary=3)
    gone = {p: r for p, r in records(plan, {}).items() if p != "second"}
    assert "not live" in reason_to_leave(SwarmView(gone, 2, 4), plan.chain, "first")
    assert "not live" in reason_to_leave(SwarmView({}, 2, 4), plan.chain, "first")
