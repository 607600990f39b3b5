"""`hetnode bench scale`: the sync-plane simulation (docs/scale.md). Pure model, no network, seconds."""

import json
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.config import load_config
from hetnode.errors import HetnodeError
from hetnode.lab.netbench.seal_trip import seal_of_size
from hetnode.lab.scale import control as scale_control
from hetnode.lab.scale import model as scale
from hetnode.lab.scale import pace as scale_pace
from hetnode.lab.scale.calibrate import calibration_report, cores_of, lab_config, remodel
from hetnode.lab.scale.cpu import RoundCpu, measure_round_cpu
from hetnode.lab.scale.dht import SealTrip, measure_seal_trip, measure_transport_cpu
from hetnode.lab.scale.fetch import QUANTUM_OF_LIMIT, daemon_fetch, fair_rates
from hetnode.lab.scale.fluid import NodeGroup, Transfer, link_seconds, simulate
from hetnode.lab.scale.lab_runs import CalibrationPlan
from hetnode.lab.scale.sizes import ROUND, payload_sizes, seal_bytes, shard_shapes, signed_payload_bytes
from hetnode.model import build_model
from hetnode.model.shards import shard_names
from hetnode.net.identity import ephemeral_identity
from hetnode.net.records import SealRecord
from hetnode.net.signing import sign_payload
from hetnode.planning.fetch import STALL_TIMEOUT_S
from hetnode.wire.sync_payload import SyncPayload, encode_payload

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def small():
    return payload_sizes(load_config(CONFIGS / "small.toml"))


def _row(sizes, replicas: int, mode: str, stages: int = 3) -> dict:
    plan = scale.plan_for(quick=True)
    return scale.simulate_round(mode, sizes, scale.swarm_at(replicas, stages, plan.anchor_share), plan)


def test_payload_sizes_are_what_the_codec_and_the_signer_produce():
    config = load_config(CONFIGS / "tiny.toml")
    model = build_model(config.model)
    params = dict(model.named_parameters())
    groups = shard_names(params)
    shapes = shard_shapes(config.model)
    assert {s: {n: tuple(params[n].shape) for n in names} for s, names in groups.items()} == shapes
    codec, identity = SparseLoCoCodec(config.outer.topk, config.outer.tile), ephemeral_identity()
    gen = torch.Generator().manual_seed(0)
    for shard, names in groups.items():
        tensors = {n: codec.compress(torch.randn(params[n].shape, generator=gen)) for n in names}
        body = encode_payload(SyncPayload(identity.peer_id, ROUND, shard, "sparseloco", tensors))
        signed = sign_payload(identity, config.run.name, body)
        assert len(signed) == signed_payload_bytes(shard, shapes[shard], config.outer.topk, config.outer.tile)


def test_a_stage_holds_its_slice_and_the_slices_cover_the_payload(small):
    assert small.stage_shards[0][0] == "embed" and small.stage_shards[-1][-1] == "head"
    assert sorted(s for held in small.stage_shards for s in held) == sorted(small.shard_bytes)
    assert sum(small.stage_bytes(i) for i in range(3)) == small.payload_bytes
    # SparseLoCo's 146× against fp32, with framing and signatures: about 0.027 bytes per parameter
    assert 0.026 < small.payload_bytes / small.parameters < 0.03


def test_hub_coordinator_uploads_every_payload_to_every_other_replica(small):
    row = _row(small, 8, "hub")  # 4 anchors, 4 chains of 3 stages
    p, r = small.payload_bytes, 8
    assert row["anchors"] == 4 and row["chains"] == 4
    # by hand: each of R replicas fetches the R − 1 others' payloads (a stage its slice), and each of the
    # 4 + 4 × 3 peers holding θ reads the seal
    assert row["coordinator_egress_bytes"] == pytest.approx(r * (r - 1) * p + 16 * seal_bytes(small, 4, 4))
    assert row["coordinator_ingress_bytes"] == pytest.approx(r * p)
    assert row["anchor_download_bytes"] == pytest.approx((r - 1) * p + seal_bytes(small, 4, 4))
    for s, down in enumerate(row["stage_download_bytes_by_stage"]):
        assert down == pytest.approx((r - 1) * small.stage_bytes(s) + seal_bytes(small, 4, 4))


def test_any_holder_authors_serve_their_payloads_and_the_coordinator_only_seals(small):
    row = _row(small, 8, "any-holder")  # 4 anchors, 4 chains of 3 stages
    p, r, seal = small.payload_bytes, 8, seal_bytes(small, 4, 4)
    # by hand: every peer holding θ reads the seal from the coordinator, which validates every payload
    assert row["coordinator_egress_bytes"] == pytest.approx(16 * seal)
    assert row["coordinator_ingress_bytes"] == pytest.approx(r * p)
    # a stage's uplink carries its slice once to the coordinator and to the R − 1 replicas holding it
    assert row["stage_upload_bytes"] == pytest.approx(max(r * small.stage_bytes(s) for s in range(3)))
    assert row["anchor_upload_bytes"] == pytest.approx(p + (r - 1) * p)
    assert row["anchor_download_bytes"] == pytest.approx((r - 1) * p + seal)
    for s, down in enumerate(row["stage_download_bytes_by_stage"]):
        assert down == pytest.approx((r - 1) * small.stage_bytes(s) + seal)
    assert row["control_scheme"] == "vouched"  # the code now: the coordinator's head vouches for views
    hub = _row(small, 8, "hub")
    assert hub["control_scheme"] == "today" and row["control_bytes_per_peer"] < hub["control_bytes_per_peer"]


def test_seeded_stage_uploads_once_and_the_coordinator_egress_is_far_below_the_hub_at_64(small):
    hub, seeded, holder = _row(small, 64, "hub"), _row(small, 64, "seeded"), _row(small, 64, "any-holder")
    p = small.payload_bytes
    assert seeded["stage_upload_bytes"] == pytest.approx(max(small.stage_bytes(s) for s in range(3)))
    for row in (seeded, holder):
        assert row["coordinator_egress_bytes"] < hub["coordinator_egress_bytes"] / 100
        assert row["coordinator_egress_bytes"] <= 2 * 64 * p
        assert row["coordinator_ingress_bytes"] == pytest.approx(64 * p)  # it still validates every payload
        # the same bytes reach every replica, from other holders
        assert row["anchor_download_bytes"] == pytest.approx(hub["anchor_download_bytes"], rel=1e-3)
        assert row["stage_download_bytes"] == pytest.approx(hub["stage_download_bytes"])
        assert row["stage_download_over_slice"] <= 1.2
        assert row["round_s"] < hub["round_s"]
    assert holder["busiest_link"].endswith(" up") and seeded["busiest_link"].endswith(" down")


def test_the_daemon_at_8_replicas_is_near_the_fluid_schedule(small):
    row = _row(small, 8, "any-holder")
    daemon = row["daemon"]
    assert daemon["timed_out"] == 0 and daemon["fallback_bytes"] == 0 and not daemon["failed"]
    assert daemon["coordinator_egress_bytes"] == pytest.approx(row["coordinator_egress_bytes"])
    assert row["round_s"] <= daemon["round_s"] < 2 * row["round_s"]


def test_fair_rates_by_hand():
    # peers 0 (up 10), 1 (up 4), 2 (down 12), 3 (down 100); connections 0→2, 1→2, 0→3. Peer 1's uplink
    # fills first (4), then peer 0's, shared by its two connections (5 each); peer 2 takes 9 of its 12
    up, down = np.array([10.0, 4.0, 0.0, 0.0]), np.array([0.0, 0.0, 12.0, 100.0])
    rates = fair_rates(np.array([0, 1, 0]), np.array([2, 2, 3]), up, down)
    assert rates.tolist() == pytest.approx([5.0, 4.0, 5.0])


def test_daemon_fetch_by_hand():
    sizes = payload_sizes(load_config(CONFIGS / "tiny.toml"))
    p, p0, p1 = sizes.payload_bytes, sizes.stage_bytes(0), sizes.stage_bytes(1)
    links = scale.Links(anchor_mbit=8.0, stage_mbit=8.0, coordinator_mbit=8.0, rtt_s=0.1)
    # two anchors fetch each other's payload: one flow per author at the 1 MB/s link, after one RTT
    fetch = daemon_fetch(sizes, scale.Swarm(2, 0, 2), links)
    assert fetch.requests == 2 and fetch.timed_out == 0
    assert fetch.fetch_s["anchors"] == pytest.approx(0.1 + p / 1e6)
    # and a chain of 2 with stage links so fast that the anchors' 1 MB/s links bind: each anchor's
    # uplink and downlink carry 3 connections (the other anchor, both stages), 1/3 MB/s each; the slices
    # (p0 < p1) end first and the others speed up, so the anchors' links are never idle: 2p in, 2p out
    fast = scale.Links(anchor_mbit=8.0, stage_mbit=8000.0, coordinator_mbit=8.0, rtt_s=0.1)
    fetch = daemon_fetch(sizes, scale.Swarm(2, 1, 2), fast)
    assert p0 < p1 and fetch.requests == 2 * 3 + 2 * 2 and fetch.timed_out == 0
    assert fetch.fetch_s["anchors"] == pytest.approx(0.1 + 2 * p / 1e6)
    assert fetch.fetch_s["stage0"] == pytest.approx(0.1 + 3 * p0 / 1e6)
    assert fetch.fetch_s["stage1"] == pytest.approx(0.1 + 3 * p0 / 1e6 + 2 * (p1 - p0) / 1e6)
    assert fetch.holder_upload_bytes == pytest.approx(
        {"anchors": 2 * p + 2 * (p0 + p1), "stage0": 2 * p0, "stage1": 2 * p1}
    )


def test_a_stalled_holder_is_passed_over_for_the_sealer():
    sizes = payload_sizes(load_config(CONFIGS / "tiny.toml"))
    p0, p1 = sizes.stage_bytes(0), sizes.stage_bytes(1)
    # slow stage links (125 B/s): nothing from or to a stage arrives within STALL_TIMEOUT_S. The anchors
    # pass the stage authors over and the sealer serves them their slices; the stages pass the anchors
    # over, then stall on the sealer too (its payloads reach them at 125 B/s): their round fails
    slow = scale.Links(anchor_mbit=8.0, stage_mbit=0.001, coordinator_mbit=8.0, rtt_s=0.1)
    fetch = daemon_fetch(sizes, scale.Swarm(2, 1, 2), slow)
    assert fetch.requests == 2 * (3 + 1) + 2 * (2 + 1)  # an anchor: 3 holders and the sealer; a stage: 2
    assert fetch.timed_out == 2 * 2 + 2 * 2 + 2 and fetch.failed
    # at STALL_TIMEOUT_S both anchors ask the sealer for p0 + p1; the stages' batches to it are held to
    # 125 B/s by their downlinks, the anchors share the rest of its 1 MB/s uplink
    share = (1e6 - 2 * 125) / 2
    assert fetch.fetch_s["anchors"] == pytest.approx(STALL_TIMEOUT_S + 0.1 + (p0 + p1) / share)
    assert fetch.fallback_bytes > 2 * (p0 + p1)
    # a stage uplink's 125 B/s shared by the two anchors' batches, until the stall
    assert fetch.wasted_bytes["anchors"] == pytest.approx(4 * 62.5 * (STALL_TIMEOUT_S - 0.1))


def test_the_stall_clock_restarts_with_each_payload():
    sizes = payload_sizes(load_config(CONFIGS / "tiny.toml"))
    embed, layer = sizes.shard_bytes["embed"], sizes.shard_bytes["0"]
    assert sizes.stage_shards[0][:2] == ("embed", "0") and sizes.stage_shards[1][0] == "2"
    # one anchor, one chain, stage links at 300 B/s: stage 0's embedding arrives within the stall timeout
    # and its next layer (7 KB, 24 s) does not, so the anchor passes stage 0 over STALL_TIMEOUT_S after
    # the embedding came in, and gets the whole slice, embedding included, from the sealer
    links = scale.Links(anchor_mbit=8.0, stage_mbit=300 * 8 / 1e6, coordinator_mbit=8.0, rtt_s=0.1)
    assert embed / 300 < STALL_TIMEOUT_S < layer / 300
    fetch = daemon_fetch(sizes, scale.Swarm(1, 1, 2), links)
    passed_over = 0.1 + embed / 300 + STALL_TIMEOUT_S
    # the anchor got stage 1's slice from the sealer long before (stage 1 stalled on its first layer); now
    # the sealer serves it stage 0's slice, and each stage 300 B/s (their downlinks)
    assert fetch.fetch_s["anchors"] == pytest.approx(passed_over + 0.1 + sizes.stage_bytes(0) / (1e6 - 600))
    assert fetch.wasted_bytes["anchors"] == pytest.approx(
        300 * (passed_over - 0.1) + 300 * (STALL_TIMEOUT_S - 0.1)
    )


def test_the_quantum_costs_little_against_the_exact_model(small):
    swarm, links = scale.swarm_at(16, 3, 0.5), scale.Links()
    exact = daemon_fetch(small, swarm, links)
    row = _row(small, 16, "any-holder")
    quick = daemon_fetch(small, swarm, links, quantum_s=row["round_limit_s"] * QUANTUM_OF_LIMIT)
    assert quick.rate_updates <= exact.rate_updates
    assert quick.makespan_s == pytest.approx(exact.makespan_s, rel=0.03)
    assert quick.requests == exact.requests and quick.timed_out == exact.timed_out == 0


def test_each_fetcher_walks_the_holders_in_an_order_of_its_own_at_64_on_178m():
    sizes = payload_sizes(load_config(CONFIGS / "178m.toml"))
    row = _row(sizes, 64, "any-holder", stages=4)
    daemon = row["daemon"]
    # no convoy on the seal's first authors, no stage author passed over: nobody falls back to the sealer,
    # every stage author serves its slice to the R − 1 replicas that hold it, and the round stays within
    # 1.5× the busiest link's limit
    assert daemon["timed_out"] == 0 and daemon["fallback_bytes"] == 0 and not daemon["failed"]
    assert daemon["coordinator_egress_bytes"] == pytest.approx(row["coordinator_egress_bytes"])
    assert daemon["stage_download_over_slice"] == pytest.approx(row["stage_download_over_slice"])
    assert row["round_s"] < daemon["round_s"] <= 1.5 * row["round_limit_s"]


@pytest.mark.parametrize("mode", scale.MODES)
@pytest.mark.parametrize("replicas", [8, 16, 64, 256])
def test_no_round_beats_its_busiest_link(small, mode, replicas):
    row = _row(small, replicas, mode)
    assert row["round_s"] >= row["round_limit_s"] > 0


def test_fluid_model_shares_links_fairly():
    groups = {"a": NodeGroup("a", 2, 10.0, 10.0), "c": NodeGroup("c", 1, 10.0, 10.0)}
    # two uploads into one downlink of 10 B/s: 5 B/s each, then the longer one alone at 10 B/s
    transfers = [Transfer("short", "a", "c", 10, 1), Transfer("long", "a", "c", 30, 1, delay_s=0.0)]
    timeline = simulate(groups, transfers)
    assert timeline.finish_s["short"] == pytest.approx(2.0)
    assert timeline.finish_s["long"] == pytest.approx(4.0)
    assert max(link_seconds(groups, transfers).values()) == pytest.approx(4.0)
    # a milestone waits for both, a later transfer starts a delay after it
    transfers += [
        Transfer("m", "c", "c", 0, 1, ("short", "long"), 0.5),
        Transfer("back", "c", "a", 20, 2, ("m",), 1.0),
    ]
    assert simulate(groups, transfers).finish_s["back"] == pytest.approx(4.0 + 0.5 + 1.0 + 2.0)


def test_control_today_grows_with_the_swarm_and_the_target_logarithmically(small):
    rows = {(r, m): _row(small, r, m) for r in (8, 256) for m in ("hub", "seeded")}
    low, high = rows[(8, "hub")], rows[(256, "hub")]
    assert high["control_bytes_per_peer"] / low["control_bytes_per_peer"] > 10  # every record each heartbeat
    low, high = rows[(8, "seeded")], rows[(256, "seeded")]
    growth = high["control_bytes_per_peer"] / low["control_bytes_per_peer"]
    assert growth <= math.log(high["peers"]) / math.log(low["peers"])
    assert scale_control.lookup_rpcs_target(high["peers"], scale_control.ControlModel()) < high["peers"] / 10


def test_control_with_the_head_vouching_and_the_change_log_grows_logarithmically_stable_or_under_churn(small):
    """The code's scheme: a replica reads every record only when the coordinator's view digest differs
    from its own and the coordinator's change log does not lead there. Stable: the per-peer cost grows like
    the lookups (log N). With 2 % of peers changing each round, a refresh that meets a change reads the
    change log (8 steps of a few records, ~10 KB at 513 peers) instead of every record; the coordinator
    logs at most one step per heartbeat, 6 per stretched refresh, fewer than the 8 kept, so no refresh
    falls back to a full read and the cost under churn grows like the lookups too."""
    low, high = _row(small, 8, "any-holder"), _row(small, 256, "any-holder")
    allowed = math.log(high["peers"]) / math.log(low["peers"])
    assert high["control_bytes_per_peer"] / low["control_bytes_per_peer"] <= allowed
    assert high["control_bytes_per_peer_stretched"] / low["control_bytes_per_peer_stretched"] > allowed
    assert high["control_bytes_per_peer_churn"] / low["control_bytes_per_peer_churn"] <= allowed
    for row in (low, high):
        stable, before = row["control_bytes_per_peer"], row["control_bytes_per_peer_stretched"]
        assert stable < before and stable <= row["control_bytes_per_peer_churn"] < before


def test_crossover_is_near_two_bytes_over_the_payload_per_parameter(small):
    r_star = scale.crossover(small)
    assert r_star["anchor"] == 1 + math.ceil(2 * small.parameters / small.payload_bytes)
    assert 60 < r_star["anchor"] < 80  # docs/scale.md: about 2 / 0.027 ≈ 70 at k = 64


def test_cli_quick_writes_json_and_plot(tmp_path: Path):
    from hetnode.cli.main import main

    assert main(["bench", "scale", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    assert (tmp_path / "scale.png").stat().st_size > 10_000
    keys = {
        "coordinator_egress_bytes",
        "stage_download_bytes",
        "anchor_download_bytes",
        "round_s",
        "round_limit_s",
    }
    assert {(r["config"], r["replicas"], r["mode"]) for r in report["rows"]} == {
        (c, r, m) for c in ("small", "178m") for r in (8, 16, 64) for m in scale.MODES
    }
    assert all(keys | {"control_bytes_per_peer"} <= set(r) for r in report["rows"])
    assert set(report["configs"]["178m"]["crossover_R"]) >= {"anchor", "stages"}
    assert set(report["targets"]["178m"]) == {*scale.MODES, "any-holder (daemon)"}
    assert all(r.get("daemon") for r in report["rows"] if r["mode"] == "any-holder")
    # each round rule at 178m beside chains (the small config has no GPU-scale projection)
    assert set(report["pace"]) == {"178m"} and set(report["pace"]["178m"]["rules"]) == set(scale_pace.RULES)


TRIP = SealTrip(store_s=0.04, read_s=0.01)
TRANSPORT = 1e-8  # CPU seconds per byte moved
CPU = RoundCpu(
    seal_check_s=0.01, seal_prepare_s=0.2, anchor_apply_s=0.3, stage_apply_s=(0.1, 0.1), commit_s=0.05
)


def test_a_rounds_cpu_is_measured_on_real_payloads_of_the_swarm():
    config = load_config(CONFIGS / "tiny.toml")
    splits = [range(0, 1), range(1, config.model.n_layers)]
    cpu = measure_round_cpu(config, anchors=3, chains=1, splits=splits, repeats=1)
    assert 0 < cpu.seal_check_s < cpu.anchor_apply_s  # one payload against all of them
    assert 0 < cpu.seal_prepare_s <= cpu.anchor_apply_s * 1.5
    assert len(cpu.stage_apply_s) == 2 and all(0 < s < cpu.anchor_apply_s * 1.5 for s in cpu.stage_apply_s)
    assert cpu.anchor_saving_s > 0 and len(cpu.stage_saving_s) == 2 and all(s > 0 for s in cpu.stage_saving_s)
    before, after = cpu.critical_path_s(anchors_per_core=4, stage_core_work_s=0.0)
    assert before == cpu.seal_check_s + cpu.seal_prepare_s
    assert after == 4 * cpu.anchor_apply_s + 3 * cpu.anchor_saving_s  # the last anchor saves after applying


def _lab_fixture(sizes, plan) -> dict:
    """What a lab run of `plan` would write if every payload byte were as the model has it, by hand: an
    anchor fetches 6 anchors' payloads and both stages' slices, a stage the 7 anchors' slices of its layers;
    every author serves its payload to the coordinator and the 7 others; the wire adds made-up DHT bytes."""
    p, (s0, s1) = sizes.payload_bytes, (sizes.stage_bytes(0), sizes.stage_bytes(1))
    anchors, stages = plan.names()
    logs = {
        a: {"upload_bytes": p, "download_bytes": 6 * p + s0 + s1, "fetch_s": 0.05, "apply_s": 2.15}
        for a in anchors
    }
    logs |= {
        n: {"upload_bytes": s, "download_bytes": 7 * s, "fetch_s": 0.4}
        for n, s in zip(stages, (s0, s1), strict=True)
    }
    hosts = {a: {"sync_sent": 8 * p, "sync_received": 7 * p, "rx": 3e6, "tx": 3e6} for a in anchors}
    hosts |= {
        n: {"sync_sent": 8 * s, "sync_received": 7 * s, "rx": 1e6, "tx": 1e6}
        for n, s in zip(stages, (s0, s1), strict=True)
    }
    hosts["coordinator"] = {"sync_sent": 0.0, "sync_received": 7 * p + s0 + s1, "rx": 5e6, "tx": 9e6}
    return {
        "rtt_s": 0.0002,
        "round_wall_s": 12.0,
        "hosts": hosts,
        "logs": logs,
        "critical_fetch_s": 0.5,
        "critical_sync_s": 2.0,
        "stage_layers": {stages[0]: [0, 0, 1], stages[1]: [1, 2, 3]},  # tiny's 4 layers, evenly
    }


def test_calibration_table_puts_the_model_next_to_the_lab():
    plan = CalibrationPlan()  # 7 anchors and a chain of 2: R = 8
    config = lab_config(load_config(CONFIGS / "tiny.toml"), plan)
    assert config.pipeline.stages == 2 and config.outer.inner_steps == plan.inner_steps
    sizes = payload_sizes(config)
    report = calibration_report(config, plan, _lab_fixture(sizes, plan), CPU, TRIP, TRANSPORT)
    table = {c["quantity"]: c for c in report["comparison"]}
    for exact in (
        "payload p (an anchor's upload)",
        "stage 1 slice",
        "coordinator sync ingress (validation)",
        "anchor sealed download (payloads)",
        "anchor sync upload (served)",
        "stage 0 sealed download (payloads)",
        "stage 1 sync upload (served)",
    ):
        assert table[exact]["model_over_lab"] == pytest.approx(1.0), exact
        assert table[exact]["within_25pct"]
    # nothing served by the coordinator in either: the model says what the lab shows
    assert table["coordinator sync egress (fallback)"]["within_25pct"]
    # 0.4 s measured against the 20 Mbit/s link's 7 × slice: the ratio is the model's over the lab's
    fetch = table["stage 1 fetch time"]
    assert fetch["model_over_lab"] == pytest.approx(fetch["model"] / 0.4)
    # the CPU term: the sealer's check and aggregation, the seal's DHT trip, then 7 anchors applying on
    # their one core
    links_s = report["model"]["row"]["round_s"]
    assert table["sync time (last announcement → all fetched)"]["model"] == pytest.approx(links_s + 0.26)
    applied = table["sync time (last announcement → all applied)"]
    assert applied["model"] == pytest.approx(links_s + 0.26 + 7 * 0.3)
    # with drop-tail queues the stages' slices reach the anchors after their exchange: a longer round
    starved = table["sync time, drop-tail model (last announcement → all fetched)"]["model"]
    assert starved > links_s + 0.26
    # the trace's windows, when the lab traced its links
    windows = {"2": {"announced": 10.0, "sealed": 11.0, "fetched": 14.0}}
    traced = _lab_fixture(sizes, plan) | {"links": {"windows": windows}}
    rows = {
        c["quantity"]: c for c in calibration_report(config, plan, traced, CPU, TRIP, TRANSPORT)["comparison"]
    }
    assert rows["sealing (trace: last announcement → first replica holds the seal)"]["lab"] == 1.0
    assert rows["fetching (trace: first seal held → last replica fetched)"]["lab"] == 3.0
    assert table["anchor checking and applying (fetched → applied)"]["model_over_lab"] == pytest.approx(1.0)
    assert set(report["within_25pct"]) | set(report["outside_25pct"]) == set(table)
    # the planner numbers the stages, not their names: stage 0 is the daemon that logged stage 0
    swapped = _lab_fixture(sizes, plan)
    anchors, stages = plan.names()
    swapped["stage_layers"] = {stages[0]: [1, 2, 3], stages[1]: [0, 0, 1]}
    swapped["logs"][stages[1]]["download_bytes"] = 123
    table = {
        c["quantity"]: c
        for c in calibration_report(config, plan, swapped, CPU, TRIP, TRANSPORT)["comparison"]
    }
    assert table["stage 0 sealed download (payloads)"]["lab"] == 123
    # the planner's split, as the lab logged it, is the model's: 3 layers and the embedding on stage 0
    uneven = _lab_fixture(sizes, plan) | {"stage_layers": {"a": [0, 0, 2], "b": [1, 3, 3]}}
    model = calibration_report(config, plan, uneven, CPU, TRIP, TRANSPORT)["model"]
    assert model["stage_shards"] == (("embed", "0", "1", "2"), ("3", "head"))
    assert sum(model["stage_payload_bytes"]) == sizes.payload_bytes
    json.dumps(report)  # the report is JSON as written


def test_remodel_runs_the_model_again_on_the_lab_measurement_on_file(tmp_path):
    plan = CalibrationPlan()
    config = load_config(CONFIGS / "tiny.toml")
    sizes = payload_sizes(lab_config(config, plan))
    with pytest.raises(HetnodeError, match="run the calibration with the lab first"):
        remodel(config, tmp_path)
    earlier = calibration_report(
        lab_config(config, plan), plan, _lab_fixture(sizes, plan), CPU, TRIP, TRANSPORT
    )
    earlier["command"] = "the lab run"
    earlier["model"] = {}  # a model of an older version: replaced
    (tmp_path / "calibration.json").write_text(json.dumps(earlier))
    report = json.loads((tmp_path / "calibration.json").read_text()) | remodel(config, tmp_path)
    assert report["command"] == "the lab run" and report["remodelled"].endswith("--remodel")
    assert report["measured"] == earlier["measured"] and report["model"]["row"]["round_s"] > 0


def test_a_seal_of_a_given_size_is_one_the_schema_takes():
    seal = seal_of_size(3, 6000)
    assert 6000 <= len(msgpack.packb(seal, use_bin_type=True)) < 6400
    SealRecord.parse_obj(seal)  # schema-valid: a store of it is what the DHT would accept


@pytest.mark.slow
def test_the_seals_dht_trip_is_measured_on_real_nodes():
    trip = measure_seal_trip(6000, peers=3, tries=2)
    assert 0 < trip.store_s < 10 and 0 < trip.read_s < 10 and trip.total_s == trip.store_s + trip.read_s


@pytest.mark.slow
def test_moving_payloads_costs_cpu_in_proportion_to_the_bytes_measured_on_real_nodes():
    """Both daemons and both p2pds count: a payload moved through two p2pds costs some CPU per byte, and
    not the millisecond per kilobyte a broken measurement (wall time, or a missed fetch) would show."""
    per_byte = measure_transport_cpu(256 * 1024, payloads=4, rounds=3)
    assert 1e-11 < per_byte < 1e-6


def test_taskset_lists_count_their_cores():
    assert [cores_of(x) for x in ("0", "1-3", "0,2", "0-1,4")] == [1, 3, 2, 3]


def test_calibrate_needs_root(monkeypatch, tmp_path: Path, capsys):
    from hetnode.cli.main import main

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["bench", "scale", "--calibrate", "--out", str(tmp_path)]) != 0
    assert "root" in capsys.readouterr().err
    assert not (tmp_path / "calibration.json").exists()


def test_a_link_bound_calibration_keeps_its_slow_stages_stages_and_refuses_rates_out_of_order(
    tmp_path: Path, capsys
):
    from hetnode.cli.main import main
    from hetnode.lab.scale.calibrate import check_plan
    from hetnode.lab.scale.lab_runs import CalibrationPlan

    small = load_config(CONFIGS / "small.toml")
    plan = CalibrationPlan(anchor_mbit=8.0, stage_mbit=2.0)
    config = lab_config(small, plan)
    assert config.network.stage_min_up_mbps == 1.0 < small.network.stage_min_up_mbps
    assert config.network.anchor_min_up_mbps == 4.0
    check_plan(config, plan)  # 2 Mbit/s stages and 8 Mbit/s anchors take the roles the lab gives them
    from hetnode.lab.scale.calibrate import command_for

    assert command_for(plan, Path("out")).endswith("--calibrate --lab-mbit 8 2 --out out")
    assert "--lab-mbit" not in command_for(CalibrationPlan(), Path("out"))
    assert lab_config(small, CalibrationPlan()).network.stage_min_up_mbps == small.network.stage_min_up_mbps
    for rates in (["20", "30"], ["200", "20"], ["20", "0"]):
        assert main(["bench", "scale", "--calibrate", "--lab-mbit", *rates, "--out", str(tmp_path)]) == 2
        assert "--lab-mbit" in capsys.readouterr().err
