"""The report of `hetnode bench network` (`hetnode/lab/runs/network.py` runs it): per swarm run the chain's
tokens/s and what a sync round cost, the dense all-reduce baseline beside SparseLoCo, the targets' ratios
(`network.json`) and their figure (`network.png`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.config import Config  # noqa: E402
from hetnode.lab.runs.network_plan import ANCHORS, STAGES, NetworkPlan  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def critical_sync_s(logs: dict[str, list[dict]]) -> list[float]:
    """Per stage and round: from the round's last announcement (of any replica in the seal) to this stage
    having applied the round: what the sync adds to a round once every replica is ready. Waiting for a
    slower replica's training (part of `seal_wait_s`) is left out. Uses each record's `time` (made just
    before announcing)."""
    announced: dict[int, float] = {}
    for records in logs.values():
        for r in records:
            if r["included"] and "time" in r:
                announced[r["round"]] = max(announced.get(r["round"], 0.0), r["time"])
    return [
        r["time"] + r["seal_wait_s"] + r["apply_s"] - announced[r["round"]]
        for s in STAGES
        for r in logs.get(s, [])
        if r["included"] and "time" in r
    ]


def stage_times(rounds: list[dict[str, Any]], rate_bytes_per_s: float) -> dict[str, float | None]:
    """A stage's median seconds per micro-batch: in its forward/backward passes, writing frames to its
    neighbours, and what its frames need at the link rate alone (bytes sent / rate): link-bound when the
    link time exceeds the compute time."""
    timed = [r for r in rounds if r.get("compute_s") is not None and r.get("steps")]
    return {
        "compute_s": _median([r["compute_s"] / r["steps"] for r in timed]),
        "send_s": _median([r["send_s"] / r["steps"] for r in timed]),
        "link_s": _median([r["activation_bytes_sent"] / rate_bytes_per_s / r["steps"] for r in timed]),
    }


def summarise_swarm(run: dict[str, Any], plan: NetworkPlan) -> dict[str, Any]:
    """Per swarm run: the chain's tokens/s, and what a sync round cost an anchor and a slow stage."""
    logs, history = run["round_logs"], run["history"]
    rate_bytes_per_s = plan.slow_mbit * 1e6 / 8
    chain_rounds = sorted(
        set.intersection(*({r["round"] for r in logs[s]} for s in STAGES))
        if all(logs[s] for s in STAGES)
        else []
    )
    by_round = {s: {r["round"]: r for r in logs[s]} for s in STAGES}
    chain_tokens_per_s = [
        by_round[STAGES[0]][n]["tokens"] / max(by_round[s][n]["train_s"] for s in STAGES)
        for n in chain_rounds
    ]
    stage_sync = [r for s in STAGES for r in logs[s] if r["included"]]
    limits = [(r["upload_bytes"] + r["download_bytes"]) / rate_bytes_per_s for r in stage_sync]
    sync_s = [r["seal_wait_s"] + r["apply_s"] for r in stage_sync]
    critical = critical_sync_s(logs)
    limit = _median(limits)
    apply_limits = [r["download_bytes"] / rate_bytes_per_s for r in stage_sync]
    anchor_logs = [r for a in ANCHORS for r in logs.get(a, [])]
    seal_times = [e["time"] for e in history]
    rounds = max(1, len(history))
    return {
        "sealed_rounds": len(history),
        "rounds_with_chain": sum(
            set(run["peer_ids"][s] for s in STAGES) <= set(e["contributors"]) for e in history
        ),
        "round_wall_s": _median([b - a for a, b in zip(seal_times, seal_times[1:], strict=False)]),
        "chain_tokens_per_s": _median(chain_tokens_per_s),
        "activation_bytes_per_round": _median([r["activation_bytes_sent"] for r in logs[STAGES[0]]]),
        "per_micro_batch": {s: stage_times(logs[s], rate_bytes_per_s) for s in STAGES},
        "stage_sync": {
            "upload_bytes": _median([r["upload_bytes"] for r in stage_sync]),
            "download_bytes": _median([r["download_bytes"] for r in stage_sync]),
            "sync_s": _median(sync_s),
            "apply_s": _median([r["apply_s"] for r in stage_sync]),
            "fetch_s": _median([r.get("fetch_s", 0.0) for r in stage_sync]),
            "physical_limit_s": _median(limits),
            "sync_over_limit": _median([s / lim for s, lim in zip(sync_s, limits, strict=True) if lim > 0]),
            "critical_sync_s": _median(critical),
            "critical_over_limit": _ratio(_median(critical), limit),
            "apply_over_limit": _median(
                [r["apply_s"] / lim for r, lim in zip(stage_sync, apply_limits, strict=True) if lim > 0]
            ),
        },
        "anchor": {
            "tokens_per_s": _median([r["tokens_per_s"] for r in anchor_logs]),
            "upload_bytes": _median([r["upload_bytes"] for r in anchor_logs]),
            "download_bytes": _median([r["download_bytes"] for r in anchor_logs]),
            "sync_s": _median([r["seal_wait_s"] + r["apply_s"] for r in anchor_logs]),
        },
        "wire_bytes_per_round": {
            name: (counts["rx"] + counts["tx"]) / rounds for name, counts in run["wire_bytes"].items()
        },
        "eval_loss": [e["eval_loss"] for e in history],
    }


def summarise(
    config: Config,
    plan: NetworkPlan,
    runs: dict[str, dict[str, Any]],
    allreduce: dict[str, Any],
    local_tokens_per_s: float,
    local_one_core_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    solo = runs["anchor-alone"]["round_logs"][ANCHORS[0]]
    solo_tokens_per_s = _median([r["tokens_per_s"] for r in solo])
    swarms = {mode: summarise_swarm(run, plan) for mode, run in runs.items() if mode != "anchor-alone"}
    peers = allreduce["peers"]
    slow = [r for s in STAGES for r in peers[s]["rounds"] if r["ok"]]  # a wrong result is no timing
    allreduce_summary = {
        "numel": allreduce["numel"],
        "seconds": _median([r["seconds"] for r in slow]),
        "wire_bytes_slow_peer": _median([(r["tx_bytes"] or 0) + (r["rx_bytes"] or 0) for r in slow]),
        "theory_bytes_per_peer": peers[STAGES[0]]["theory_bytes_per_peer"],
        "all_ok": all(r["ok"] for p in peers.values() for r in p["rounds"]),
        "ok_rounds_slow_peers": len(slow),
        # attempts the peers agreed to repeat (hivemind stalled or came back off the mean); all peers agree
        "repeated_attempts": sum(len(r.get("failed_attempts", [])) for r in peers[STAGES[0]]["rounds"]),
    }
    compressed, plain = swarms["selective"], swarms["none"]
    alone, alone_plain = swarms["chain-only-selective"], swarms["chain-only-none"]
    sync = compressed["stage_sync"]
    sparse_bytes = (sync["upload_bytes"] or 0) + (sync["download_bytes"] or 0)
    return {
        "config": {
            "run": config.run.name,
            "parameters": count_parameters(config.model),
            "H": plan.inner_steps,
        },
        "plan": asdict(plan),
        "local_tokens_per_s": local_tokens_per_s,
        "anchor_alone_tokens_per_s": solo_tokens_per_s,
        "local_one_core_tokens_per_s": local_one_core_tokens_per_s,
        "swarms": swarms,
        "allreduce_fp16": allreduce_summary,
        "targets": {
            "round_time_over_physical_limit": sync["critical_over_limit"],
            "announce_to_applied_over_physical_limit": sync["sync_over_limit"],
            "allreduce_bytes_over_sparseloco": _ratio(
                allreduce_summary["wire_bytes_slow_peer"], sparse_bytes
            ),
            "allreduce_seconds_over_sparseloco": _ratio(
                allreduce_summary["seconds"], sync["critical_sync_s"]
            ),
            "compressed_chain_speedup": _ratio(compressed["chain_tokens_per_s"], plain["chain_tokens_per_s"]),
            "compressed_chain_speedup_alone": _ratio(
                alone["chain_tokens_per_s"], alone_plain["chain_tokens_per_s"]
            ),
            "anchor_over_local_tokens_per_s": _ratio(
                compressed["anchor"]["tokens_per_s"], local_tokens_per_s
            ),
            "anchor_alone_over_local_tokens_per_s": _ratio(solo_tokens_per_s, local_one_core_tokens_per_s),
        },
    }


def plot_network(report: dict[str, Any], path: Path) -> None:
    swarm = report["swarms"]["selective"]
    allreduce = report["allreduce_fp16"]
    sync = swarm["stage_sync"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = ["SparseLoCo\n(stage, app bytes)", "all-reduce fp16\n(slow peer, wire)"]
    sparse_bytes = (sync["upload_bytes"] or 0) + (sync["download_bytes"] or 0)
    axes[0].bar(
        labels, [sparse_bytes, allreduce["wire_bytes_slow_peer"] or 0], color=["tab:green", "tab:red"]
    )
    axes[0].set_yscale("log")
    axes[0].set_title("bytes per peer per sync round")
    axes[1].bar(
        [
            "SparseLoCo round\n(last announce\n→ applied)",
            "announce\n→ applied",
            "physical limit\n(bytes ÷ link)",
            "all-reduce\nfp16",
        ],
        [
            sync.get("critical_sync_s") or 0,
            sync["sync_s"] or 0,
            sync["physical_limit_s"] or 0,
            allreduce["seconds"] or 0,
        ],
        color=["tab:green", "tab:olive", "tab:gray", "tab:red"],
    )
    axes[1].tick_params(axis="x", labelsize=8)
    axes[1].set_yscale("log")
    axes[1].set_title(f"seconds per sync round ({report['plan']['slow_mbit']:g} Mbit/s links)")
    runs = ("selective", "none", "chain-only-selective", "chain-only-none")
    chain = [report["swarms"][m]["chain_tokens_per_s"] or 0 for m in runs]
    anchor = report["swarms"]["selective"]["anchor"]["tokens_per_s"] or 0
    axes[2].bar(
        [
            "chain k\n(swarm)",
            "chain d\n(swarm)",
            "chain k\n(alone)",
            "chain d\n(alone)",
            "anchor\n(swarm)",
            "train\n(2 cores)",
            "anchor\n(1 core)",
            "train\n(1 core)",
        ],
        [
            *chain,
            anchor,
            report["local_tokens_per_s"],
            report["anchor_alone_tokens_per_s"] or 0,
            report["local_one_core_tokens_per_s"] or 0,
        ],
        color=["tab:green", "tab:orange", "tab:green", "tab:orange"] + ["tab:blue", "tab:gray"] * 2,
    )
    axes[2].tick_params(axis="x", labelsize=8)
    axes[2].set_title("training tokens/s")
    run = report["config"]
    fig.suptitle(
        f"hetnode bench network: {run['run']} ({run['parameters'] / 1e6:.2f} M params), H={run['H']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
