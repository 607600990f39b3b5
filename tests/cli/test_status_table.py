"""The status table shows, per peer, whether the shards it holds agree with the coordinator's θ, and keeps
the boundary (a clock) apart from the round a peer holds."""

from __future__ import annotations

from hetnode.daemon.status_table import DIGEST_LEGEND, digest_agreement, render_table

COORDINATOR = "12D3KooWGRUVh2RNnvh6dquqNn6K7Tq4b1q2nZMB4RVtYfF7bKoF"
THETA = {"embed": "e0", "0": "a0", "1": "a1", "2": "a2", "3": "a3", "head": "h0"}


def peer(name: str, peer_id: str, role: str, params_round: int | None, digests: dict | None, **more) -> dict:
    return {
        "name": name,
        "peer_id": peer_id,
        "role": role,
        "params_round": params_round,
        "layer_digests": digests,
        **more,
    }


def swarm() -> dict:
    first_half = {k: THETA[k] for k in ("embed", "0", "1")}
    second_half = {"2": THETA["2"], "3": "drifted", "head": THETA["head"]}  # block 3 is not the swarm's
    return {
        "run": "tiny-0123abcd",
        "config": "tiny",
        "round": 12,
        "boundary_round": 12,
        "coordinator": COORDINATOR,
        "time": 1000.0,
        "peers": [
            peer("coordinator", COORDINATOR, "coordinator", 5, THETA),
            peer("anchor-1", "A" * 46, "anchor", 5, THETA, layers=[0, 3]),
            peer("edge-0", "S" * 45 + "0", "stage", 5, first_half, layers=[0, 1], stage=0),
            peer("edge-1", "S" * 45 + "1", "stage", 5, second_half, layers=[2, 3], stage=1),
            peer("late", "L" * 46, "anchor", 4, THETA, layers=[0, 3]),
            peer("idle-1", "I" * 46, "idle", None, None),
        ],
        "chains": [],
    }


def rows(table: str) -> dict[str, str]:
    lines = table.split("\n")[3:]
    return {line.split()[0]: line for line in lines if line and not line.startswith("digests:")}


def test_each_stage_shows_whether_its_layers_agree_with_the_coordinator():
    table = render_table(swarm())
    by_name = rows(table)
    assert "agree 6/6" in by_name["anchor-1"]
    assert "agree 3/3" in by_name["edge-0"]
    assert "DIFFER 1/3" in by_name["edge-1"]  # one of its three shards is not the swarm's
    assert "other round" in by_name["late"]  # holds round 4: its digests are of another θ
    assert "reference" in by_name["coordinator"]
    assert by_name["idle-1"].split()[-2] == "-"
    assert DIGEST_LEGEND in table  # the words explained once, under the rows


def test_the_header_keeps_the_boundary_apart_from_the_round_held():
    lines = render_table(swarm()).split("\n")
    assert lines[0].startswith("run tiny-0123abcd (tiny), boundary 12, 6 peers")
    assert lines[0].endswith("(holds round 5)")  # the coordinator's round: the last it sealed
    header = lines[2]
    assert "holds round" in header and "digests" in header and "embed digest" not in header
    column = header.index("holds round")
    assert rows("\n".join(lines))["late"][column : column + 11].strip() == "4"


def test_without_a_coordinator_entry_nothing_is_compared():
    document = swarm()
    document["peers"] = document["peers"][1:]
    table = render_table(document)
    assert "agree" not in table and "DIFFER" not in table and DIGEST_LEGEND not in table
    assert "holds round" not in table.split("\n")[0]


def test_a_peer_that_only_says_it_is_the_coordinator_is_not_the_reference():
    impostor = peer("coordinator", "X" * 46, "coordinator", 5, {k: "forged" for k in THETA})
    reference = peer("coordinator", COORDINATOR, "coordinator", 5, THETA)
    assert digest_agreement(impostor, reference) == "DIFFER 6/6"
    assert digest_agreement(peer("p", "P" * 46, "stage", 5, {"unknown-shard": "x"}), reference) == "-"
    assert digest_agreement(peer("p", "P" * 46, "stage", 5, {"embed": "e0"}), None) == "-"


def test_a_chain_that_went_on_with_a_spare_says_where_it_comes_from():
    document = swarm()
    stages = ["S" * 45 + "0", "S" * 45 + "1"]
    document["chains"] = [
        {"id": "c9-aaaa", "live": True, "stages": stages, "problem": "", "lineage": "c3-bbbb"},
        {"id": "c4-cccc", "live": False, "stages": [stages[0], None], "problem": "stage 1 has no member"},
        {"id": "c5-dddd", "live": False, "stages": stages, "problem": "broken", "blamed": [stages[1]]},
    ]
    table = render_table(document)
    assert "chain c9-aaaa (goes on from c3-bbbb): live" in table
    assert "chain c4-cccc: not live (stage 1 has no member)" in table  # a founding chain, or an older peer's
    assert "chain c5-dddd: not live (broken); stages SSSSSSS0 | SSSSSSS1; caught lying: SSSSSSS1" in table


def test_a_pool_shows_its_workers_and_why_one_was_dropped():
    document = swarm()
    a, b, c, d = ("S" * 45 + str(i) for i in range(4))
    document["chains"] = [
        {
            "id": "c9-aaaa",
            "live": True,
            "stages": [a, b],
            "problem": "",
            "workers": [[a], [b, c]],
            "blamed": [d],
            "dropped": {d: "caught lying", "L" * 46: "left"},
        }
    ]
    table = render_table(document)
    assert "stages SSSSSSS0 | SSSSSSS1, SSSSSSS2; caught lying: SSSSSSS3; dropped: LLLLLLLL (left)" in table
