"""`utilization.json` and `utilization.png` of `hetnode bench utilization` from its runs' logs (the
arithmetic is in `hetnode/lab/runs/utilization_figures.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hetnode.config import Config  # noqa: E402
from hetnode.lab.runs.utilization_figures import (  # noqa: E402
    cap_sweep,
    judge,
    loss_at_equal,
    loss_curve,
    measured,
    measured_seals,
    outside_share,
    p50,
    replica_figures,
    seal_intervals,
    sealed_tokens,
    swarm_tokens_per_s,
    utilization,
)
from hetnode.model import count_parameters  # noqa: E402

DISAGREES = ("disagrees", "half-applied")
RULE_ORDER = ("lockstep", "overlap", "paced", "paced+overlap")
COLOURS = {"lockstep": "tab:blue", "overlap": "tab:orange", "paced": "tab:green", "paced+overlap": "tab:red"}
MORE_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:grey")  # the extra caps
COMMAND = "sudo .venv/bin/hetnode bench utilization"


def left_out_reasons(peer: str, seals: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Why `peer`'s announced work was not in the seals that left it out: the screen's reason, or "late"
    (excluded before the screen: its payload did not arrive in time or did not check)."""
    reasons: dict[str, int] = {}
    for entry in seals:
        late = "late" if peer in entry.get("excluded", ()) else None
        reason = (entry.get("rejected") or {}).get(peer) or late
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def since_first_sealed(
    peer: str | None, seals: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A replica's figures from the first measured seal that took its work: a slow member that joins
    late (start-up under a quota, the budget still learning) is measured "while live" from there."""
    first = next((e["round"] for e in seals if peer is not None and peer in e["contributors"]), None)
    if first is None:
        return {"first_sealed_round": None, "seal_share_since_in": None, "compute_utilization_since_in": None}
    later = [e for e in seals if e["round"] >= first]
    return {
        "first_sealed_round": first,
        "seal_share_since_in": sum(peer in e["contributors"] for e in later) / len(later),
        "compute_utilization_since_in": utilization([r for r in rounds if r["round"] >= first]),
    }


def rule_summary(run: Mapping[str, Any], warmup_rounds: int, per_step: int) -> dict[str, Any]:
    """One run's `R`: each replica's figures over its measured rounds, the swarm's, the seals'; for a run
    that stalled, its reason and nothing measured. `per_step`: tokens an inner step trains (batch × seq)."""
    if "error" in run:
        return dict.fromkeys(_R_KEYS) | {"replicas": [], "eval_loss_curve": [], "error": run["error"]}
    first = run["start_round"] + warmup_rounds
    seals = measured_seals(run["history"], first, run["end"])
    ids = run.get("peer_ids") or {}
    stages = [ids[name] for name in run["round_logs"] if name.startswith("stage") and name in ids]
    tokens = sealed_tokens(per_step, {peer: 1 / len(stages) for peer in stages})  # the lab's one chain
    replicas = []
    for name, records in run["round_logs"].items():
        rounds = measured(records, first, run["end"])
        role = next((r["role"] for r in records), "stage" if name.startswith("stage") else "anchor")
        figures = replica_figures(name, role, rounds)
        # the share of the measured seals its work is in (the slow anchor and the chain: every one?)
        peer = ids.get(name)
        figures["seal_share"] = (
            sum(peer in e["contributors"] for e in seals) / len(seals) if peer and seals else None
        )
        figures["left_out"] = left_out_reasons(peer, seals) if peer else {}
        figures |= since_first_sealed(peer, seals, rounds)
        replicas.append(figures)
    total = sum(r["tokens"] for r in replicas if r["role"] == "anchor")
    total += max((r["tokens"] for r in replicas if r["role"] == "stage"), default=0)  # a chain once
    for figures in replicas:
        figures["token_share"] = figures["tokens"] / total if total else None
    checks = run["digest_checks"]
    logged = sum(run["digest_mismatches_logged"].values())
    return {
        "replicas": replicas,
        "swarm_tokens_per_s": swarm_tokens_per_s(seals, tokens),
        "eval_loss_at_equal_tokens": None,  # filled in against the other rule (`summarise`)
        "eval_loss_at_equal_wall": None,
        "seal_to_seal_s": p50(seal_intervals(seals)),
        "seal_to_seal_s_no_verify": None,
        "digest_disagreements": sum(c["verdict"] in DISAGREES for c in checks) + logged,
        "digest_checks": len(checks),
        "digest_checks_unknown_round": sum(c["verdict"] == "unknown-round" for c in checks),
        "digest_mismatches_logged": logged,
        # share of an anchor's round outside inner steps (1 − its utilisation, median over the anchors): in
        # lockstep that is the round's sync, which H is chosen to put at 30-60 %
        "anchor_sync_share": outside_share(replicas),
        "verify_s": p50([float(e.get("verify_seconds") or 0.0) for e in seals]),
        "measured_seals": len(seals),
        "start_round": run["start_round"],
        "running_at_start": run.get("running_at_start"),
        "first_measured_round": first,
        "budget_s": run["budget_s"],
        "overlap_configured": run["overlap"],
        "overlap_logged": any(r["overlap_logged"] for r in replicas),
        "cpu_throttling": run.get("throttling"),
        "load_average": run.get("load_average"),
        # the rounds sealed within the budget: the swarm runs on while its digests are read
        "eval_loss_curve": loss_curve(
            [e for e in run["history"] if e["time"] <= run["end"]], run["t0"], tokens
        ),
        "error": None,
    }


_R_KEYS = (
    "swarm_tokens_per_s", "eval_loss_at_equal_tokens", "eval_loss_at_equal_wall", "seal_to_seal_s",
    "seal_to_seal_s_no_verify", "digest_disagreements", "digest_checks", "digest_checks_unknown_round",
    "digest_mismatches_logged", "anchor_sync_share", "verify_s", "measured_seals", "start_round",
    "running_at_start", "first_measured_round", "budget_s", "overlap_configured", "overlap_logged",
    "cpu_throttling", "load_average",
)  # fmt: skip


def summarise(
    config: Config, plan: Any, runs: Mapping[str, Mapping[str, Any]], command: str = COMMAND
) -> dict[str, Any]:
    """The whole `utilization.json`: `{"rules": {"lockstep": R, "overlap": R, "paced": R, "paced+overlap":
    R}}` (those that ran), the run without verification, the ratios against lockstep and overlap and each
    target's verdict."""
    per_step = plan.batch_size * plan.seq_len
    order = [label for label in RULE_ORDER if label in runs]
    order += [label for label in runs if label not in RULE_ORDER and not label.endswith("-no-verify")]
    rules = {label: rule_summary(runs[label], plan.warmup_rounds, per_step) for label in order}
    quiet_label = next((label for label in runs if label.endswith("-no-verify")), None)
    quiet = rule_summary(runs[quiet_label], plan.warmup_rounds, per_step) if quiet_label else None
    if quiet is not None:
        rules[quiet_label.removesuffix("-no-verify")]["seal_to_seal_s_no_verify"] = quiet["seal_to_seal_s"]
    curves = {label: rule["eval_loss_curve"] for label, rule in rules.items()}
    equal = {"tokens": loss_at_equal(curves, "tokens"), "wall_s": loss_at_equal(curves, "wall_s")}
    for label, rule in rules.items():
        rule["eval_loss_at_equal_tokens"] = equal["tokens"]["loss"][label]
        rule["eval_loss_at_equal_wall"] = equal["wall_s"]["loss"][label]
    ratios, targets = judge(rules)
    real = rules["overlap"]["overlap_logged"]
    share = rules["lockstep"]["anchor_sync_share"]
    return {
        "command": command,
        "config": {
            "run": config.run.name,
            "parameters": count_parameters(config.model),
            "H": plan.inner_steps,
            "batch_size": plan.batch_size,
            "seq_len": plan.seq_len,
        },
        # H is chosen so that a lockstep round spends 30-60 % of its wall time in sync, as on slow links
        "H_check": {
            "lockstep_anchor_sync_share": share,
            "range": [0.3, 0.6],
            "met": None if share is None else 0.3 <= share <= 0.6,
        },
        "plan": asdict(plan),
        "equal_tokens_at": equal["tokens"]["at"],
        "equal_wall_s_at": equal["wall_s"]["at"],
        "rules": rules,
        "no_verify": None
        if quiet is None
        else {"rule": quiet_label.removesuffix("-no-verify"), **{k: quiet[k] for k in _QUIET_KEYS}},
        "overlap_is_real": real,
        "note": None
        if real
        else (
            "the overlap run's daemons logged no overlapped round (outer.overlap is not implemented in this "
            "tree yet): both rules ran lockstep, so the ratios measure run-to-run noise, not the overlap"
        ),
        "ratios": ratios,
        "targets": targets,
        "cap_sweep": cap_sweep(rules, plan.cap_ratio),
    }


_QUIET_KEYS = ("seal_to_seal_s", "swarm_tokens_per_s", "verify_s", "measured_seals", "digest_disagreements")


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Eval loss against wall time and against tokens for both rules; each replica's utilisation."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    extra = [label for label in report["rules"] if label not in COLOURS]
    colours = COLOURS | dict(zip(extra, MORE_COLOURS, strict=False))
    for label, rule in report["rules"].items():
        curve = rule["eval_loss_curve"]
        for ax, axis in ((axes[0], "wall_s"), (axes[1], "tokens")):
            ax.plot(
                [p[axis] for p in curve], [p["loss"] for p in curve], ".-", color=colours[label], label=label
            )
    for ax, at, xlabel in (
        (axes[0], report["equal_wall_s_at"], "seconds since the start seal (every replica running)"),
        (axes[1], report["equal_tokens_at"], "tokens sealed"),
    ):
        if at is not None:
            ax.axvline(at, color="grey", linestyle=":", label="compared here")
        ax.set(xlabel=xlabel, ylabel="eval loss")
        ax.legend(fontsize=8)
    axes[0].set_title("eval loss against wall time")
    axes[1].set_title("eval loss against tokens")
    names = max(([r["name"] for r in rule["replicas"]] for rule in report["rules"].values()), key=len)
    width = 0.8 / max(1, len(report["rules"]))
    for i, (label, rule) in enumerate(report["rules"].items()):
        by_name = {r["name"]: r["compute_utilization"] for r in rule["replicas"]}
        values = [by_name.get(name) for name in names]
        xs = [j + (i - (len(report["rules"]) - 1) / 2) * width for j in range(len(values))]
        axes[2].bar(xs, [v or 0.0 for v in values], width, color=colours[label], label=label)
        for x, value in zip(xs, values, strict=True):
            if value is None:  # no measured rounds (a chain that could not keep up, a run that stalled)
                axes[2].text(x, 0.02, "no rounds", rotation=90, ha="center", va="bottom", fontsize=7)
    axes[2].axhline(0.9, color="grey", linestyle=":", label="target (anchors)")
    axes[2].set_xticks(range(len(names)), names)
    axes[2].set(ylim=(0, 1.05), title="compute utilisation (inner-step s / wall s)")
    axes[2].legend(fontsize=8)
    c = report["config"]
    real = "" if report["overlap_is_real"] else " — overlap NOT implemented yet: both runs are lockstep"
    fig.suptitle(
        f"hetnode bench utilization: {c['run']} ({c['parameters'] / 1e6:.2f} M params), H={c['H']}{real}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
