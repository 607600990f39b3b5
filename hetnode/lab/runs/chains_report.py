"""`chains.json` and `chains.png` of `hetnode bench chains` from its runs' logs (the arithmetic is in
`hetnode/lab/runs/chains_figures.py`).

`chains.json`: `{"one_worker": {"tokens_per_s", …}, "two_workers": {"tokens_per_s", …}, "worker_killed":
{"sealed_rounds_lost", "boundaries_to_recover", …}, "spare": {"rounds_lost", …}, "malicious_worker":
{"rounds_to_drop", "eval_loss", "eval_loss_clean", …}, "digest_disagreements"}`, with the ratio of two
workers' tokens/s to one's, each target's verdict, the plan, the command and each case's run in short (the
whole record, history and round logs included, is `work/<case>/run.json`). A case that stalled or did not
run has its figures None and its `error`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.lab.runs.chains_figures import (  # noqa: E402
    chain_tokens_per_s,
    eval_against_clean,
    first_stage,
    rate_series,
    recovery,
    rounds_sealed_with,
    rounds_to_drop,
    rounds_without,
)
from hetnode.lab.runs.chains_plan import ANCHOR, CASES, FIRST, ChainsPlan  # noqa: E402
from hetnode.lab.runs.utilization_figures import (  # noqa: E402
    loss_curve,
    measured,
    ratio,
    replica_figures,
    target,
)
from hetnode.lab.runs.utilization_report import DISAGREES  # noqa: E402

COMMAND = "sudo .venv/bin/hetnode bench chains"
COLOURS = {
    "one_worker": "tab:blue",
    "two_workers": "tab:orange",
    "worker_killed": "tab:red",
    "spare": "tab:green",
    "malicious_worker": "tab:purple",
}
THROUGHPUT = (
    "tokens_per_s", "train_tokens_per_s", "tokens", "rounds", "rounds_included", "wall_s",
    "compute_utilization", "seal_wait_s_p50", "first_round", "last_round",
)  # fmt: skip
KEYS = {
    "one_worker": (*THROUGHPUT, "anchor_tokens_per_s", "anchor_compute_utilization"),
    "two_workers": (*THROUGHPUT, "anchor_tokens_per_s", "anchor_compute_utilization"),
    "worker_killed": (
        "sealed_rounds_lost", "boundaries_to_recover", "recovered_after_s", "recovered_at_round",
        "reference_tokens_per_s", "pre_kill_tokens_per_s", "post_kill_tokens_per_s", "back_round", "killed",
    ),
    "spare": (
        "rounds_lost", "successor_after_s", "back_round", "lineage_kept", "successor", "killed", "spare",
    ),
    "malicious_worker": (
        "rounds_to_drop", "rounds_to_blame", "eval_loss", "eval_loss_clean", "eval_loss_ratio",
        "eval_at_tokens", "eval_loss_final", "dropped_after_s", "blamed_after_s",
        "liar_rounds_sealed_after_fault", "liar_rounds_sealed_before_fault", "liar_rounds_sealed_after_drop",
        "fault_clock_from",
    ),
}  # fmt: skip


def throughput(run: Mapping[str, Any], plan: ChainsPlan, until: float | None = None) -> dict[str, Any]:
    """The chain's figures over its measured rounds (`chain_tokens_per_s`) and the anchor's beside them."""
    first_round = run["start_round"] + plan.warmup_rounds
    end = run["end"] if until is None else until
    figures = chain_tokens_per_s(run["round_logs"].get(first_stage(run), []), first_round, end)
    anchor = replica_figures(ANCHOR, "anchor", measured(run["round_logs"].get(ANCHOR, []), first_round, end))
    return figures | {
        "anchor_tokens_per_s": anchor["tokens_per_s"],
        "anchor_compute_utilization": anchor["compute_utilization"],
    }


def worker_killed(run: Mapping[str, Any], plan: ChainsPlan, one_worker: float | None) -> dict[str, Any]:
    ids, events = run["peer_ids"], run["events"]
    first, killed_at = ids[first_stage(run)], events["killed_at"]
    records = run["round_logs"].get(first_stage(run), [])
    before = throughput(run, plan, until=killed_at)["tokens_per_s"]
    after_kill = [r for r in records if float(r["time"]) > killed_at]
    after = chain_tokens_per_s(records, after_kill[0]["round"], run["end"]) if after_kill else {}
    # the rate a chain with one worker runs at: one_worker's, or the pre-kill rate where that is lower
    known = [v for v in (one_worker, before) if v is not None]
    reference = min(known) if known else None
    back = recovery(records, killed_at, reference, run["boundary_s"], plan.recover_share)
    lost = rounds_without(run["history"], first, killed_at, {first})
    return {
        "sealed_rounds_lost": lost["lost"],
        "boundaries_to_recover": back["boundaries"],
        "recovered_after_s": back["seconds"],
        "recovered_at_round": back["at_round"],
        "reference_tokens_per_s": reference,
        "pre_kill_tokens_per_s": before,
        "post_kill_tokens_per_s": after.get("tokens_per_s"),
        "back_round": lost["back_round"],
        "killed": events["killed"],
    }


def spare(run: Mapping[str, Any]) -> dict[str, Any]:
    ids, events = run["peer_ids"], run["events"]
    first, killed_at = ids[first_stage(run)], events["killed_at"]
    lost = rounds_without(run["history"], first, killed_at, {first, ids[events["spare"]]})
    before, after = run.get("layout_before") or {}, run.get("layout_after") or {}
    kept = None
    if before.get("lineage") and after.get("lineage"):
        kept = after["lineage"] == before["lineage"] and after.get("id") != before.get("id")
    return {
        "rounds_lost": lost["lost"],
        "successor_after_s": lost["back_after_s"],
        "back_round": lost["back_round"],
        "lineage_kept": kept,
        "successor": after.get("names"),
        "killed": events["killed"],
        "spare": events["spare"],
    }


def malicious_worker(run: Mapping[str, Any], clean: Mapping[str, Any] | None) -> dict[str, Any]:
    ids, events = run["peer_ids"], run["events"]
    liar, fault_at, seen = ids[events["liar"]], events["fault_at"], events.get("dropped_seen_at")
    blamed = events.get("blame_logged_at")
    loss = eval_against_clean(run["history"], (clean or {}).get("history"))
    return {
        "rounds_to_drop": rounds_to_drop(run["history"], fault_at, seen),
        # the same up to the first stage's log line that blamed it: what the status adds is its lag
        "rounds_to_blame": rounds_to_drop(run["history"], fault_at, blamed),
        "eval_loss": loss["eval_loss"],
        "eval_loss_clean": loss["eval_loss_clean"],
        "eval_loss_ratio": loss["ratio"],
        "eval_at_tokens": loss["at_tokens"],
        "eval_loss_final": loss["eval_loss_final"],
        "dropped_after_s": seen - fault_at if seen is not None else None,
        "blamed_after_s": blamed - fault_at if blamed is not None else None,
        "liar_rounds_sealed_after_fault": rounds_sealed_with(run["history"], liar, fault_at),
        # honest first? (the liar may be caught before its pool's work was ever sealed)
        "liar_rounds_sealed_before_fault": rounds_sealed_with(run["history"], liar, 0.0, fault_at),
        "liar_rounds_sealed_after_drop": rounds_sealed_with(run["history"], liar, seen) if seen else None,
        "fault_clock_from": events.get("fault_clock_from"),
    }


def case_summary(
    case: str,
    run: Mapping[str, Any] | None,
    plan: ChainsPlan,
    runs: Mapping[str, Any],
    one_worker: float | None,
) -> dict[str, Any]:
    if run is None or "error" in run:
        error = "not run (not in --cases)" if run is None else run["error"]
        return dict.fromkeys(KEYS[case]) | {"series": [], "eval_curve": [], "events_s": {}, "error": error}
    if case in ("one_worker", "two_workers"):
        figures = throughput(run, plan)
    elif case == "worker_killed":
        figures = worker_killed(run, plan, one_worker)
    elif case == "spare":
        figures = spare(run)
    else:
        clean = runs.get("two_workers")
        figures = malicious_worker(run, clean if clean and "error" not in clean else None)
    t0 = run["t0"]
    events = {k: v - t0 for k, v in run["events"].items() if k.endswith("_at") and isinstance(v, int | float)}
    chain = run.get("layout_before") or {}
    return figures | {
        "layout_before": chain.get("names"),
        "layout_after": (run.get("layout_after") or {}).get("names"),
        "layout_as_planned": bool(chain.get("names")) and chain["names"][0] == [FIRST],
        "start_round": run["start_round"],
        "rounds_sealed": len(run["history"]),
        "events_s": events,  # seconds after the first round sealed with the whole chain
        "series": rate_series(run["round_logs"].get(first_stage(run), []), t0),
        "eval_curve": loss_curve(run["history"], t0),
        "error": None,
    }


def _digests(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    checks = [c for run in runs.values() for c in run.get("digest_checks") or ()]
    logged = sum(sum((run.get("digest_mismatches_logged") or {}).values()) for run in runs.values())
    return {
        "digest_disagreements": sum(c["verdict"] in DISAGREES for c in checks) + logged,
        "digest_checks": len(checks),
        "digest_checks_unknown_round": sum(c["verdict"] == "unknown-round" for c in checks),
        "digest_mismatches_logged": logged,
    }


def _short(run: Mapping[str, Any]) -> dict[str, Any]:
    """A case's run without its history and round logs (those are in its `run.json`)."""
    return {k: v for k, v in run.items() if k not in ("history", "round_logs")}


def summarise(
    plan: ChainsPlan, runs: Mapping[str, Mapping[str, Any]], command: str = COMMAND
) -> dict[str, Any]:
    """The whole `chains.json`."""
    cases: dict[str, dict[str, Any]] = {}
    one = case_summary("one_worker", runs.get("one_worker"), plan, runs, None)
    for case in CASES:
        cases[case] = (
            one
            if case == "one_worker"
            else case_summary(case, runs.get(case), plan, runs, one["tokens_per_s"])
        )
    digests = _digests(runs)
    two = cases["two_workers"]
    killed, spared, liar = cases["worker_killed"], cases["spare"], cases["malicious_worker"]
    lost, rounds_lost, to_drop = killed["sealed_rounds_lost"], spared["rounds_lost"], liar["rounds_to_drop"]
    loss_ratio = liar["eval_loss_ratio"]
    pool_gain = ratio(two["tokens_per_s"], one["tokens_per_s"])
    targets = {
        "two_workers_over_one_tokens_per_s": target(
            pool_gain, 1.7, pool_gain is not None and pool_gain >= 1.7
        ),
        "worker_killed_sealed_rounds_lost": target(_f(lost), 0.0, lost == 0),
        "spare_rounds_lost": target(_f(rounds_lost), 1.0, rounds_lost is not None and rounds_lost <= 1),
        "malicious_worker_rounds_to_drop": target(_f(to_drop), 2.0, to_drop is not None and to_drop <= 2),
        # damage is a higher loss: a run with the liar that ends lower than the clean one (two swarms,
        # each with its own timing) shows none
        "malicious_worker_eval_loss_at_most_2pct_above_clean": target(
            loss_ratio, 1.02, loss_ratio is not None and loss_ratio <= 1.02
        ),
        "digest_disagreements": target(
            float(digests["digest_disagreements"]), 0.0, digests["digest_disagreements"] == 0
        ),
    }
    boundary = next((run.get("boundary_s") for run in runs.values() if run.get("boundary_s")), None)
    return {
        "command": command,
        "config": {
            "run": next((run.get("run_name") for run in runs.values() if run.get("run_name")), None),
            "H": plan.inner_steps,
            "batch_size": plan.batch_size,
            "seq_len": plan.seq_len,
            "stages": 2,
            "boundary_s": boundary,
            "verify": plan.verify,
        },
        "plan": asdict(plan),
        **cases,
        **digests,
        "two_over_one_tokens_per_s": pool_gain,
        # each case's chain against the anchor beside it, under the same fixed quota: how much of the
        # ratio is the machine's speed drifting between cases (a shared VM's cores are not constant)
        "two_over_one_against_anchor": ratio(
            ratio(two["tokens_per_s"], two["anchor_tokens_per_s"]),
            ratio(one["tokens_per_s"], one["anchor_tokens_per_s"]),
        ),
        "two_over_one_train_tokens_per_s": ratio(two["train_tokens_per_s"], one["train_tokens_per_s"]),
        "targets": targets,
        "runs": {case: _short(run) for case, run in runs.items()},
    }


def _f(value: int | None) -> float | None:
    return None if value is None else float(value)


def plot(report: Mapping[str, Any], path: Path) -> None:
    """The chain's tokens/s per round over time, one line per case (kills and the fault marked); eval loss
    against sealed tokens per case."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    for case, colour in COLOURS.items():
        summary = report[case]
        series = summary.get("series") or []
        label = case if not summary.get("error") else f"{case} (not measured)"
        axes[0].plot(
            [p["t"] for p in series], [p["tokens_per_s"] for p in series], ".-", color=colour, label=label
        )
        for event, at in (summary.get("events_s") or {}).items():
            style = ":" if event == "dropped_seen_at" else "--"
            axes[0].axvline(at, color=colour, linestyle=style, alpha=0.7)
        curve = summary.get("eval_curve") or []
        axes[1].plot(
            [p["tokens"] for p in curve], [p["loss"] for p in curve], ".-", color=colour, label=label
        )
    at = report["malicious_worker"].get("eval_at_tokens")
    if at is not None:
        axes[1].axvline(at, color="grey", linestyle=":", label="liar against clean, here")
    axes[0].set(
        xlabel="seconds since the first round sealed with the whole chain",
        ylabel="tokens/s of the chain (first stage), per round",
        title="the chain's pace (dashed: a kill or the fault; dotted: the liar seen dropped)",
    )
    axes[1].set(xlabel="tokens sealed", ylabel="eval loss", title="eval loss against tokens")
    for ax in axes:
        ax.legend(fontsize=8)
    c = report["config"]
    fig.suptitle(
        f"hetnode bench chains: {c['run']}, H={c['H']}, 2 stages; two workers / one: "
        f"{_show(report['two_over_one_tokens_per_s'])}x tokens/s; rounds lost to a killed worker "
        f"{_show(report['worker_killed']['sealed_rounds_lost'])}, to a spare's step-in "
        f"{_show(report['spare']['rounds_lost'])}; rounds to drop a liar "
        f"{_show(report['malicious_worker']['rounds_to_drop'])}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _show(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
