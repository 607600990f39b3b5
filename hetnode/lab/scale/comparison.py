"""The scale model's numbers against the lab's, quantity by quantity (`hetnode bench scale --calibrate`).

`compare` pairs every byte count, fetch and sync time and window of the lab run (`scale_lab`, traced by
`link_trace`) with the model's (`scale_calibrate.model_side`), and says whether each is within 25 %.
docs/scale.md explains each row.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from hetnode.lab.scale.lab_runs import CalibrationPlan

TOLERANCE = 0.25  # |model / lab − 1| within which a quantity counts as explained


def compare(measured: dict[str, Any], model: dict[str, Any], plan: CalibrationPlan) -> list[dict[str, Any]]:
    """Model against lab, per quantity and round. `lab` is what the lab measured (medians over the
    measured rounds; counters: change over the window ÷ rounds); `within` when |model/lab − 1| ≤ 25 %."""
    row, hosts, logs = model["row"], measured["hosts"], measured["logs"]
    anchors, stages = plan.names()
    seal = model["seal_bytes"]
    # which daemon is which stage: the planner numbers them, not their names (the names' order otherwise)
    layers = measured.get("stage_layers") or {}
    at_stage = {
        s: [n for n in stages if layers.get(n, [None])[0] == s] or stages[s :: plan.stages]
        for s in range(plan.stages)
    }

    def median_of(names: list[str], get: Any) -> float | None:
        values = sorted(v for v in (get(n) for n in names) if v is not None)
        return values[len(values) // 2] if values else None

    out: list[dict[str, Any]] = []

    def add(quantity: str, unit: str, modelled: float, lab: float | None, note: str = "") -> None:
        ratio = modelled / lab if lab else None
        within = ratio is not None and abs(ratio - 1) <= TOLERANCE
        if not lab and not modelled:  # both nothing: the model says what the lab shows
            within, ratio = True, None
        out.append(
            {"quantity": quantity, "unit": unit, "model": modelled, "lab": lab, "model_over_lab": ratio}
            | {"within_25pct": within, "note": note}
        )

    add(
        "payload p (an anchor's upload)",
        "bytes",
        model["payload_bytes"],
        median_of(anchors, lambda n: logs[n]["upload_bytes"]),
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} slice",
            "bytes",
            model["stage_payload_bytes"][s],
            median_of(names, lambda n: logs[n]["upload_bytes"]),
        )
    add(
        "coordinator sync ingress (validation)",
        "bytes/round",
        row["coordinator_ingress_bytes"],
        hosts["coordinator"]["sync_received"],
    )
    add(
        "coordinator sync egress (fallback)",
        "bytes/round",
        row["daemon"]["fallback_bytes"],
        hosts["coordinator"]["sync_sent"],
        "no fallback in a fault-free round; seals go through the DHT, not the sync channel",
    )
    add(
        "coordinator wire egress",
        "bytes/round",
        row["coordinator_egress_bytes"],
        hosts["coordinator"]["tx"],
        "the model counts seals only; the wire carries the DHT (the coordinator is the bootstrap node)",
    )
    add(
        "coordinator wire ingress",
        "bytes/round",
        row["coordinator_ingress_bytes"],
        hosts["coordinator"]["rx"],
        "payloads + DHT",
    )
    add(
        "anchor sealed download (payloads)",
        "bytes/round",
        row["anchor_download_bytes"] - seal,
        median_of(anchors, lambda n: logs[n]["download_bytes"]),
    )
    add(
        "anchor sync upload (served)",
        "bytes/round",
        row["anchor_upload_bytes"],
        median_of(anchors, lambda n: hosts[n]["sync_sent"]),
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} sealed download (payloads)",
            "bytes/round",
            row["stage_download_bytes_by_stage"][s] - seal,
            median_of(names, lambda n: logs[n]["download_bytes"]),
        )
        add(
            f"stage {s} sync upload (served)",
            "bytes/round",
            plan.replicas * model["stage_payload_bytes"][s],
            median_of(names, lambda n: hosts[n]["sync_sent"]),
        )
    add(
        "anchor fetch time",
        "s",
        row["fetch_s"]["anchors"],
        median_of(anchors, lambda n: logs[n]["fetch_s"]),
        "seal → fetched",
    )
    for s in range(plan.stages):
        names = at_stage[s]
        add(
            f"stage {s} fetch time",
            "s",
            row["fetch_s"][f"stage{s}"],
            median_of(names, lambda n: logs[n]["fetch_s"]),
            "seal → fetched",
        )
    fetched_s = row["round_s"] + model["cpu_before_seal_s"]
    add(
        "anchor checking and applying (fetched → applied)",
        "s",
        model["anchor_apply_shared_s"],
        median_of(anchors, lambda n: _apply_after_fetch(logs[n])),
        "decode, aggregate and step, and the others' hashing and saving, on the anchors' shared core",
    )
    add(
        "sync time (last announcement → all fetched)",
        "s",
        fetched_s,
        measured.get("critical_fetch_s"),
        "links (validation, seal, fetching) plus the sealer's check and aggregation",
    )
    add(
        "sync time (last announcement → all applied)",
        "s",
        fetched_s + model["cpu_after_fetch_s"],
        measured["critical_sync_s"],
        "then the busiest core's share of applying the seal",
    )
    starved = model["drop_tail"]
    add(
        "sync time, drop-tail model (last announcement → all fetched)",
        "s",
        starved["round_s"] + model["cpu_before_seal_s"],
        measured.get("critical_fetch_s"),
        "the stages' flows to the anchors start when the anchors' exchange has emptied their downlinks",
    )
    add(
        "sync time, drop-tail model (last announcement → all applied)",
        "s",
        starved["round_s"] + model["cpu_before_seal_s"] + model["cpu_after_fetch_s"],
        measured["critical_sync_s"],
    )
    windows = list((measured.get("links") or {}).get("windows", {}).values())
    if windows:
        add(
            "sealing (trace: last announcement → first replica holds the seal)",
            "s",
            row["seal_s"] + model["cpu_before_seal_s"],
            statistics.median(w["sealed"] - w["announced"] for w in windows),
            "validation downloads, the sealer's check and aggregation, the seal's store and read",
        )
        lab_fetching = statistics.median(w["fetched"] - w["sealed"] for w in windows)
        add(
            "fetching (trace: first seal held → last replica fetched)",
            "s",
            row["round_s"] - row["seal_s"],
            lab_fetching,
            "fair sharing of every link",
        )
        add(
            "fetching, drop-tail model (trace)",
            "s",
            starved["round_s"] - starved["seal_s"],
            lab_fetching,
            "the stages' flows wait for the anchors' exchange",
        )
    sync = row["anchor_download_bytes"] + row["anchor_upload_bytes"]
    wire = median_of(anchors, lambda n: hosts[n]["rx"] + hosts[n]["tx"])
    add(
        "anchor wire bytes (in + out)",
        "bytes/round",
        sync + row["control_bytes_per_peer"],
        wire,
        "sync + the code's control model (vouched), a peer's average (at the lab's heartbeat and round)",
    )
    add(
        "anchor wire bytes, model's hot peer",
        "bytes/round",
        sync + row["control_bytes_hot_peer"],
        wire,
        "sync + the control of a replica node of the `peers` key (an anchor may be one)",
    )
    return out


def _apply_after_fetch(log: Mapping[str, Any]) -> float | None:
    apply_s, fetch_s = log.get("apply_s"), log.get("fetch_s")
    return apply_s - fetch_s if apply_s is not None and fetch_s is not None else None
