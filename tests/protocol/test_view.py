"""The swarm view a peer plans from: the pool at a boundary, chain liveness, the status document."""

import time

from hetnode.net.node import StoredValue
from hetnode.net.records import new_peer_record
from hetnode.planning.roles import format_layout, pack_chains
from hetnode.protocol.swarm_view import SwarmView


def record(name, role="idle", wants="stage", chain=None, stage=None, layers=None, tflops=1.0, layout=None):
    return new_peer_record(
        name,
        link_class="low" if wants == "stage" else "high",
        up_mbps=20.0,
        down_mbps=20.0,
        mem_gb=4.0,
        tflops=tflops,
        wants=wants,
        role=role,
        chain=chain,
        stage=stage,
        layers=layers,
        chain_layout=format_layout(layout) if layout else None,
    )


def view_of(records):
    entries = {peer: StoredValue(peer, value, time.time() + 10) for peer, value in records.items()}
    return SwarmView.from_entries(entries, stages_per_chain=2, n_layers=4)


def chain_of_two():
    """A live chain of A and B (formed at boundary 3): its plan and its members' records."""
    [plan] = pack_chains(view_of({"A": record("a"), "B": record("b")}).idle_candidates(3), 2, 4, boundary=3)
    records = {
        s.peer_id: record(
            s.peer_id.lower(), "stage", chain=s.chain, stage=s.stage, layers=list(s.layers), layout=s.layout
        )
        for s in plan.stages
    }
    return plan, records


def test_pool_keeps_peers_that_already_claimed_at_this_boundary():
    # B read the pool first and claimed; A reads later and must still see B, or the plans would differ
    [plan] = pack_chains(view_of({"A": record("a"), "B": record("b")}).idle_candidates(7), 2, 4, boundary=7)
    b_stage = next(s for s in plan.stages if s.peer_id == "B")
    later = view_of(
        {
            "A": record("a"),
            "B": record(
                "b",
                "stage",
                chain=plan.chain,
                stage=b_stage.stage,
                layers=list(b_stage.layers),
                layout=b_stage.layout,
            ),
        }
    )
    assert pack_chains(later.idle_candidates(7), 2, 4, boundary=7) == [plan]
    # a chain from an earlier boundary is not part of this boundary's pool
    assert {c.peer_id for c in later.idle_candidates(8)} == {"A"}


def test_offline_peers_anchors_and_bad_records_are_left_out():
    view = view_of(
        {
            "A": record("a"),
            "B": record("b", role="offline"),
            "C": record("c", role="anchor", wants="anchor", layers=[0, 3]),
            "D": {"name": "broken"},
        }
    )
    assert set(view.peers) == {"A", "C"}
    assert [c.peer_id for c in view.idle_candidates(1)] == ["A"]


def test_status_document_shows_live_chains_and_stable_fields():
    plan, records = chain_of_two()
    records["C"] = record("c", role="anchor", wants="anchor", layers=[0, 3])
    document = view_of(records).status_document("run-1", 3)
    assert document["run"] == "run-1" and document["round"] == 3
    assert [p["role"] for p in document["peers"]] == ["anchor", "stage", "stage"]
    stable = {
        "peer_id",
        "name",
        "class",
        "role",
        "chain",
        "stage",
        "layers",
        "up_mbps",
        "down_mbps",
        "last_seen",
    }
    assert all(stable <= set(p) for p in document["peers"])
    assert document["chains"] == [
        {
            "id": plan.chain,
            "live": True,
            "stages": list(plan.members),
            "problem": "",
            "lineage": plan.chain,
            "blamed": [],
            "workers": [[m] for m in plan.members],
            "dropped": {},
        }
    ]
    del records[plan.stages[1].peer_id]
    [chain] = view_of(records).status_document("run-1", 4)["chains"]
    assert not chain["live"] and chain["stages"][1] is None


def test_the_records_daemons_write_pass_the_dht_schema():
    """hivemind's schema check refuses any type conversion: a stage's claim must travel as written."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from hetnode.net.identity import ephemeral_identity, owner_subkey
    from hetnode.net.records import record_key, run_schema_validator

    identity = ephemeral_identity()
    [plan] = pack_chains(view_of({"A": record("a"), "B": record("b")}).idle_candidates(3), 2, 4, boundary=3)
    stage = plan.stages[0]
    claim = record("a", "stage", chain=stage.chain, stage=0, layers=list(stage.layers), layout=stage.layout)
    validator = run_schema_validator("run-1")
    for value in (record("a"), claim, dict(claim, admission="hnadmit1.abc")):
        stored = DHTRecord(
            key=DHTID.generate(source=record_key("run-1", "peers")).to_bytes(),
            subkey=MSGPackSerializer.dumps(owner_subkey(identity)),
            value=MSGPackSerializer.dumps(value),
            expiration_time=time.time() + 30,
        )
        assert validator.validate(stored), value
    assert view_of({"A": claim}).claims()[0].layout == stage.layout


def test_a_seal_waits_for_a_live_chain_one_round_behind_only_when_rounds_overlap():
    plan, records = chain_of_two()
    records["C"] = record("c", role="anchor", wants="anchor", layers=[0, 3])
    rounds = {"A": 8, "B": 9}  # A still applies round 9 while it trains round 10 (overlap)
    for peer, held in rounds.items():
        records[peer]["params_round"] = held
    view = view_of(records)
    assert view.expected_contributors(10) == {"B", "C"}  # lockstep: θ after round 9, or it joins later
    assert view.expected_contributors(10, overlap=True) == {"A", "B", "C"}
    assert view.expected_contributors(11, overlap=True) == {"B", "C"}  # two rounds behind: catching up
    records["A"]["params_round"] = None  # no θ yet
    assert view_of(records).expected_contributors(10, overlap=True) == {"B", "C"}
