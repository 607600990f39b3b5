"""One attacker process per attack class of docs/security.md against one live swarm (coordinator + 2 anchors).

The attacker (`tests/swarm/attacker.py`) is a volunteer built from hetnode's own client code. After each
attack the swarm must be whole: the coordinator and the honest anchors alive, honest rounds still
sealing, every honest replica holding the coordinator's θ, status routes answering, and the attacker
credited nothing beyond the schedule. The swarm is shared (one set-up for all attacks); each test checks
from the round it started at, so the tests stay independent of each other's outcome.
"""

from __future__ import annotations

import itertools
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from hetnode.config import load_config
from hetnode.planning.rounds import replica_tokens

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

HONEST = {"anchor-a", "anchor-b"}


@pytest.fixture(scope="module")
def live(module_swarm):
    swarm = module_swarm
    config = swarm.config(outer={"inner_steps": 8})
    boot = swarm.bootstrap(config)
    boot.wait_ready()
    for name in sorted(HONEST):
        swarm.join(name, boot.maddr, "1000")
    for daemon in swarm.daemons[1:]:
        daemon.wait_ready()
    swarm.wait_for_round(1, timeout=120)
    return swarm, boot, config


def attack(swarm, name: str, seconds: float = 15.0, extra: tuple[str, ...] = ()) -> dict:
    return swarm.attack_result(swarm.start_attack(name, seconds, *extra), timeout=seconds + 120)


def http(boot, path: str) -> bytes:
    with urllib.request.urlopen(f"{boot.ready['http']}{path}", timeout=10) as response:
        assert response.status == 200
        return response.read()


def assert_whole(swarm, boot, since: int, attacker: str | None = None) -> list[dict]:
    """The swarm after an attack: alive, sealing past `since`, one θ, status answering, no stolen credit."""
    for daemon in swarm.daemons:
        assert daemon.proc.poll() is None, f"{daemon.name} exited:\n{daemon.tail()}"
    history = swarm.wait_for_round(since + 2, timeout=120)
    # only the honest replicas: an attacker's record may claim anything until it expires
    document = swarm.wait_for(
        boot.maddr,
        lambda d: all((p["params_round"] or -1) >= since + 2 for p in d["peers"] if p["name"] in HONEST),
        timeout=60,
        what=f"the honest replicas applied round {since + 2}",
    )
    assert set(swarm.agree_with_coordinator(document, HONEST)) == HONEST
    for entry in history:
        if entry["round"] > since and "contributors" in entry and entry.get("caught_up_from") is None:
            assert len(entry["contributors"]) >= 1
    status = json.loads(http(boot, "/api/status"))
    assert status["params_round"] >= since + 2
    http(boot, "/metrics")
    http(boot, "/")
    contributions = json.loads(http(boot, "/api/contributions"))
    if attacker is not None:
        config = load_config(swarm.tmp_path / "swarm.toml")
        rounds_in = sum(attacker in h["contributors"] for h in swarm.history())
        mine = [row for row in contributions["standings"] if row["peer"] == attacker]
        tokens = mine[0]["tokens"] if mine else 0
        assert tokens <= rounds_in * replica_tokens(config), (tokens, rounds_in)
    return history


def current_round(swarm) -> int:
    history = swarm.history()
    return history[-1]["round"] if history else -1


def test_crash_a_float32_overflowing_payload_is_excluded_and_nothing_is_half_applied(live):
    swarm, boot, _ = live
    since = current_round(swarm)
    result = attack(swarm, "overflow", seconds=16)
    assert result["announcements_accepted"] >= 1
    history = assert_whole(swarm, boot, since, result["peer_id"])
    attacker = result["peer_id"]
    assert not any(attacker in h["contributors"] for h in history)
    assert any(attacker in h["excluded"] for h in history if h["round"] > since)
    assert "float32" in boot.log_path.read_text() or "exceeds the run's limit" in boot.log_path.read_text()


def test_game_the_ledger_credit_follows_the_schedule_not_the_claim(live):
    swarm, boot, _ = live
    since = current_round(swarm)
    result = attack(swarm, "ledger", seconds=16)
    assert result["huge_claim_stored"] is False  # 2^62 tokens is refused by every DHT node's schema
    history = assert_whole(swarm, boot, since, result["peer_id"])
    attacker = result["peer_id"]
    # its well-formed (random) contribution is weighed: sealed, or refused by verification for its work
    weighed = [h for h in history if attacker in h["contributors"] or attacker in h.get("rejected", {})]
    assert weighed, "a well-formed contribution is sealed or scored (the claim is what must not count)"
    config = load_config(swarm.tmp_path / "swarm.toml")
    full = config.outer.probation_rounds
    for entry in history:  # the round's tokens: the schedule of each credited replica by its weight, no claim
        credited = set(entry["contributors"]) - set(entry.get("rejected", {}))
        weights = entry.get("weights") or dict.fromkeys(entry["contributors"], full)
        assert entry["tokens"] == sum(replica_tokens(config) * weights[p] // full for p in credited)


def test_hijack_and_stall_forged_and_far_future_seals_change_nothing(live):
    swarm, boot, _ = live
    since = current_round(swarm)
    result = attack(swarm, "hijack", seconds=12)
    assert result["ten_year_seal_stored"] is False  # TTL cap
    history = assert_whole(swarm, boot, since, result["peer_id"])
    assert all(h.get("caught_up_from") is None for h in history if h["round"] > since)
    assert all(h["round"] < 10**6 for h in history)
    # θ is the coordinator's: its history chains seal after seal
    hashes = [h.get("seal_hash") for h in history if h["round"] > since]
    assert all(hashes) and len(set(hashes)) == len(hashes)


def test_hide_the_swarm_oversized_and_foreign_records_do_not_hide_peers(live):
    swarm, boot, _ = live
    since = current_round(swarm)
    result = attack(swarm, "records", seconds=8)
    assert result["huge_record_stored"] is False  # record byte cap
    # only the coordinator's entries (and its stand-ins' seals): no honest node keeps a stranger's
    for field in ("head", "changes", "seal", "manifest"):
        assert result[f"{field}_asked"] >= 2 and result[f"{field}_held"] == 0, result
    document = swarm.status(boot.maddr)  # a fresh reader, as a joining volunteer is
    names = {p["name"] for p in document["peers"]}
    assert names >= HONEST and "attacker-records" not in names
    assert_whole(swarm, boot, since)


def test_exhaust_streams_probes_and_state_requests_are_budgeted(live):
    swarm, boot, _ = live
    since = current_round(swarm)
    started = time.monotonic()
    result = attack(swarm, "exhaust", seconds=8)
    assert result["streams_refused"] >= 64 - 8 and result["streams_held"] <= 8  # the per-peer stream cap
    assert result["probe_bytes"] == 0  # no live record, no probe: no amplification
    assert result["state_refused"] > 0  # the byte budget ran out
    assert time.monotonic() - started < 120
    # 200 half-open HTTP connections (a request line and no end): the status page still answers at once
    url = urllib.parse.urlsplit(boot.ready["http"])
    held = []
    try:
        for _ in range(200):
            conn = socket.create_connection((url.hostname, url.port), timeout=5)
            conn.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")
            held.append(conn)
        asked = time.monotonic()
        json.loads(http(boot, "/api/status"))
        assert time.monotonic() - asked < 5
    finally:
        for conn in held:
            conn.close()
    assert_whole(swarm, boot, since)


def test_redirect_a_volunteer_is_refused_without_its_pinned_coordinator(live, tmp_path):
    swarm, boot, config = live
    since = current_round(swarm)
    rogue = swarm.start_attack("redirect", 40, stderr=subprocess.DEVNULL)
    try:
        maddr = next(line.split()[1] for line in rogue.stdout if line.startswith("MADDR "))
        base = [sys.executable, "-m", "hetnode.cli.main", "join", "--peer", maddr, "--bandwidth", "1000"]
        base += ["--listen", "/ip4/127.0.0.1/tcp/0", "--connect-timeout", "20"]
        unpinned = subprocess.run(
            [*base, "--name", "victim", "--data-dir", str(tmp_path / "v1")],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=ROOT,
        )
        assert unpinned.returncode != 0 and "--coordinator" in unpinned.stderr, unpinned.stderr[-2000:]
        pinned = subprocess.run(
            [*base, "--name", "victim", "--data-dir", str(tmp_path / "v2"), "--coordinator", boot.peer_id],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=ROOT,
        )
        assert pinned.returncode != 0 and "not the pinned" in pinned.stderr, pinned.stderr[-2000:]
    finally:
        rogue.terminate()
        rogue.wait(30)
    assert_whole(swarm, boot, since)


def seal_intervals(history: list[dict], after: int) -> list[float]:
    times = [h["time"] for h in history if h["round"] > after and "time" in h]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def attack_at_pace(swarm, boot, name: str, extra: tuple[str, ...] = ()) -> tuple[dict, list[dict], set[str]]:
    """Run attack `name` for 25 s after measuring the honest pace over 3 rounds; check that the swarm is
    whole and the pace held (within 2x). Returns the attacker's result, the rounds sealed from the
    attack's start on, and the honest replicas' peer ids."""
    since = current_round(swarm)
    before = statistics.median(seal_intervals(swarm.wait_for_round(since + 3, timeout=120), since))
    attacker = swarm.start_attack(name, 25.0, *extra)
    swarm.wait_attacking(attacker)  # the pace counts from here: not the attacker's set-up on our 2 cores
    start = current_round(swarm)
    result = swarm.attack_result(attacker, timeout=25.0 + 120)
    history = assert_whole(swarm, boot, start, attacker=result.get("peer_id"))
    during = statistics.median(seal_intervals(history, start))
    assert during <= 2 * before + 1.0, (during, before)
    attacked = [h for h in history if h["round"] > start and "contributors" in h]
    return result, attacked, {d.peer_id for d in swarm.daemons if d.name in HONEST}


def left_out(attacked: list[dict], honest: set[str]) -> list[int]:
    """Rounds sealed (not caught up) without every honest replica, for what these attacks aim at (the seal's
    waits and fetches): not the verifier's score screen, which judges the work itself and on `tiny` late in
    training now and then scores an honest anchor's round below the margin (seen once in CI during the
    eclipse: one round of 11; the verifier's own attacks: `tests/lab/experiments/test_sybil_attacks.py`)."""
    return [
        h["round"]
        for h in attacked
        if h.get("caught_up_from") is None
        and not honest - {p for p, why in (h.get("rejected") or {}).items() if why == "score"}
        <= set(h["contributors"])
    ]


def test_stall_a_slow_author_holds_no_seal_hostage(live):
    swarm, boot, _ = live
    result, attacked, honest = attack_at_pace(swarm, boot, "slow_author")
    assert result["announcements_accepted"] >= 1 and result.get("asked", 0) >= 1  # it was fetched
    assert attacked and all(result["peer_id"] not in h["contributors"] for h in attacked)
    assert left_out(attacked, honest) == []


def test_eclipse_ten_chosen_id_dht_nodes_next_to_the_round_keys_do_not_stop_sealing(live):
    swarm, boot, _ = live
    result, attacked, honest = attack_at_pace(swarm, boot, "eclipse")
    assert result["sybils"] == 10 and result["stores_dropped"] > 0  # the DHT path ended with them
    assert len(attacked) >= 5 and left_out(attacked, honest) == []


def test_crowd_33_identities_holding_idle_streams_do_not_choose_who_is_sealed(live):
    swarm, boot, _ = live
    targets = [arg for d in swarm.daemons if d.name in HONEST for arg in ("--target", d.maddr)]
    result, attacked, honest = attack_at_pace(swarm, boot, "crowd", (*targets, "--identities", "33"))
    assert result["identities"] == 33 and result["streams_opened"] > 33 * 8 * 2  # they held and reopened
    # 33 more p2pd on the 2 cores slow every round (their start-up not counted); the pace check bounds it
    assert len(attacked) >= 3
    # the sealer always found a slot for its fetches: no honest author excluded (as unreachable); and at
    # most one round in which one announced too late for the deadline on this loaded 2-core machine
    assert not any(honest & set(h["excluded"]) for h in attacked), [
        (h["round"], h["excluded"]) for h in attacked
    ]
    assert len(left_out(attacked, honest)) <= 1


def test_duplicates_one_update_under_four_identities_is_weighed_once_and_credited_never(live):
    """Four identities announce one and the same update (each signed by its own key, served by its own
    p2pd) every round: the sealer takes them for one training (`copy` for all but one), and the one left
    has no verified history (probation, then its noise scores negative): no weight, no credit."""
    swarm, boot, _ = live
    since = current_round(swarm)
    result = attack(swarm, "duplicates", seconds=20, extra=("--identities", "4"))
    identities = set(result["identities"])
    assert len(identities) == 4 and result["rounds_announced"] >= 2
    history = assert_whole(swarm, boot, since, result["peer_id"])
    weighed = [h for h in history if h["round"] > since and identities & set(h.get("rejected", {}))]
    assert weighed, "the copies reached the seal's screen"
    for entry in weighed:
        reasons = {p: entry["rejected"][p] for p in identities & set(entry["rejected"])}
        assert sum(1 for r in reasons.values() if r == "copy") >= len(reasons) - 1, reasons
        assert not identities & set(entry["contributors"]), entry  # no weight: nothing verified yet
    standings = {s["peer"] for s in swarm.contributions(boot)["standings"] if s["tokens"] > 0}
    assert not identities & standings  # and no credit


def test_a_coordinator_restart_after_the_attacks_resumes_its_own_chain(live):
    swarm, boot, config = live
    before = swarm.history()[-1]
    assert boot.stop() == 0
    restarted = swarm.bootstrap(config)
    restarted.wait_ready()
    swarm.daemons.remove(boot)
    swarm.daemons.insert(0, restarted)
    history = swarm.wait_for_round(before["round"] + 2, timeout=150)
    assert restarted.ready["run"] == boot.ready["run"]
    after = [h for h in history if h["round"] > before["round"]]
    assert after and all(
        h.get("caught_up_from") in (None,) or h.get("sealed_by") == restarted.peer_id for h in after
    )
    assert_whole(swarm, restarted, before["round"])
