"""The demo's report: `summary.json` (machine-readable) and `report.md` (for people), built from what the run
left behind, so a report is written even after a Ctrl+C or a failure, from whatever exists.

The results are the rounds sealed before the demo began to stop the swarm, at most the number requested:
the swarm seals on while the demo checks digests and stops its peers, and those rounds are listed apart
(`stopping_rounds`), never mixed into the results, the plots or the contributions. The demo prints
`result_line(summary)` last and the report opens with it, so the terminal, `report.md` and `summary.json`
tell the same numbers.

`summarise` turns the collected data into the summary and `render_markdown` (`hetnode/lab/demo/markdown.py`)
the summary into text; both are pure functions of their input and are tested on hand-made data. Plots are in
`hetnode/lab/demo/plots.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetnode.lab.demo.credit import credit_standings
from hetnode.lab.demo.markdown import render_markdown, result_line, stopping_line
from hetnode.lab.demo.plots import PLOTS, write_plots
from hetnode.lab.demo.rounds import contributor_count, number, round_bytes, seconds_per_round, swarm_counts
from hetnode.service.round_log import log_utilization

__all__ = ["DemoRecord", "render_markdown", "result_line", "stopping_line", "summarise", "write_report"]


@dataclass
class DemoRecord:
    """Everything the demo collected; every part may be empty (an interrupted start has no rounds)."""

    out: Path
    config_path: Path
    config: dict[str, Any]  # Config.to_dict()
    requested_rounds: int
    outcome: str  # "finished", "interrupted" or "failed"
    wall_s: float
    error: str | None = None
    status_url: str | None = None
    shaped: bool = False
    processes: list[dict[str, Any]] = field(default_factory=list)  # DemoSwarm.describe()
    history: list[dict[str, Any]] = field(default_factory=list)  # the coordinator's rounds.jsonl
    chains: list[dict[str, Any]] = field(default_factory=list)  # {chain, members (names), live, first_seen}
    contributions: dict[str, Any] | None = None  # GET /api/contributions (the ledger, all rounds)
    digests: dict[str, Any] | None = None  # digests.compare_digests()
    round_logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> rounds-local.jsonl
    leftovers: list[int] = field(default_factory=list)
    stopping_at: float | None = None  # unix time the demo began to stop the swarm (None: never)


def _rel(path: str | Path, out: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(out.resolve()))
    except ValueError:
        return str(path)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def results_cut(history: Sequence[Mapping[str, Any]], requested: int, stopping_at: float | None) -> int:
    """How many of the sealed rounds (`history` in round order) are the results: the first `requested` at
    most, sealed before `stopping_at` (an entry without a seal time counts as before)."""
    cut = 0
    for entry in history[: max(0, requested)]:
        sealed_at = number(entry.get("time"))
        if stopping_at is not None and sealed_at is not None and sealed_at > stopping_at:
            break
        cut += 1
    return cut


def _round(entry: Mapping[str, Any], names: Mapping[str, str], stage_ids: set[str]) -> dict[str, Any]:
    b = round_bytes(entry)
    contributors = entry.get("contributors")
    ids = contributors if isinstance(contributors, list) else []
    return {
        "round": entry.get("round"),
        "contributors": contributor_count(entry),
        "contributor_names": sorted(names.get(i, str(i)[-8:]) for i in ids),
        "with_stages": bool(stage_ids & set(ids)),
        "tokens": entry.get("tokens"),
        "eval_loss": number(entry.get("eval_loss")),
        "bytes": {"anchor": b.anchor, "stage": b.stage, "sparse": b.sparse, "dense": b.dense},
        "ratio": b.ratio,
        "time": entry.get("time"),
    }


def summarise(record: DemoRecord) -> dict[str, Any]:
    """The machine-readable summary (what `summary.json` holds)."""
    names = {p["peer_id"]: p["name"] for p in record.processes if p.get("peer_id")}
    stage_ids = {p["peer_id"] for p in record.processes if p.get("role") == "stage" and p.get("peer_id")}
    history = sorted(record.history, key=lambda e: e.get("round", 0))
    cut = results_cut(history, record.requested_rounds, record.stopping_at)
    results, stopping = history[:cut], history[cut:]
    rounds = [_round(entry, names, stage_ids) for entry in results]
    losses = [(r["round"], r["eval_loss"]) for r in rounds if r["eval_loss"] is not None]
    totals = {k: sum(r["bytes"][k] for r in rounds) for k in ("anchor", "stage", "sparse", "dense")}
    config = record.config
    stages = config.get("pipeline", {}).get("stages") or 1
    per_chain = stages + (config.get("pipeline", {}).get("stage_workers") or 1) - 1  # edges a chain
    ledger = record.contributions if isinstance(record.contributions, Mapping) else {}
    return {
        "outcome": record.outcome,
        "error": record.error,
        "requested_rounds": record.requested_rounds,
        "sealed_rounds": len(rounds),
        "sealed_rounds_in_all": len(history),
        "wall_s": round(record.wall_s, 1),
        "seconds_per_round": seconds_per_round(results),
        "status_url": record.status_url,
        "shaped": record.shaped,
        "config": {
            "path": str(record.config_path),
            "run": config.get("run", {}).get("name"),
            "d_model": config.get("model", {}).get("d_model"),
            "n_layers": config.get("model", {}).get("n_layers"),
            "inner_steps": config.get("outer", {}).get("inner_steps"),
            "stages": config.get("pipeline", {}).get("stages"),
            "stage_workers": config.get("pipeline", {}).get("stage_workers") or 1,
            "compression": config.get("pipeline", {}).get("compression"),
        },
        # replicas = anchors + chains (a chain is one replica); peers = the daemons beside the coordinator
        "swarm": swarm_counts([str(p.get("role")) for p in record.processes], per_chain),
        "processes": [p | {"log": _rel(p["log"], record.out)} for p in record.processes],
        "chains": record.chains,
        "first_stage_round": next((r["round"] for r in rounds if r["with_stages"]), None),
        "rounds": rounds,
        "stopping_rounds": [_round(entry, names, stage_ids) for entry in stopping],
        "eval_loss": [r["eval_loss"] for r in rounds],
        "loss_start": losses[0][1] if losses else None,
        "loss_end": losses[-1][1] if losses else None,
        "digests_agree": record.digests["agree"] if record.digests else None,
        "digests": record.digests,
        # the ledger's credit over the results' rounds (docs/observability.md, Contribution credit)
        "contributions": credit_standings(results, names),
        "ledger": {"total_tokens": ledger.get("total_tokens"), "rounds": ledger.get("rounds")},
        "bytes": {
            "total": totals,
            "mean_per_round": {k: (v / len(rounds) if rounds else None) for k, v in totals.items()},
            "ratio": totals["dense"] / totals["sparse"] if totals["sparse"] and totals["dense"] else None,
        },
        "peer_traffic": _traffic(record.round_logs, record.processes, rounds[-1]["round"] if rounds else -1),
        "leftovers": record.leftovers,
        "plots": dict(PLOTS),
    }


def _traffic(
    logs: Mapping[str, list[dict[str, Any]]], processes: list[dict[str, Any]], last_round: int
) -> list[dict]:
    """Per peer, from its own round log: what its rounds up to `last_round` (the results') cost it."""
    roles = {p["name"]: p.get("role") for p in processes}
    rows = []
    for name, logged in sorted(logs.items()):
        entries = [e for e in logged if isinstance(e.get("round"), int) and e["round"] <= last_round]
        rows.append(
            {
                "name": name,
                "role": roles.get(name),
                "rounds": len(entries),
                "included": sum(1 for e in entries if e.get("included")),
                "tokens": sum(int(number(e.get("tokens")) or 0) for e in entries),
                "upload_bytes": sum(int(number(e.get("upload_bytes")) or 0) for e in entries),
                "download_bytes": sum(int(number(e.get("download_bytes")) or 0) for e in entries),
                "activation_bytes_sent": sum(
                    int(number(e.get("activation_bytes_sent")) or 0) for e in entries
                ),
                "tokens_per_s": _mean([v for e in entries if (v := number(e.get("tokens_per_s")))]),
                "compute_utilization": log_utilization(entries),  # the whole run
            }
        )
    return rows


def write_report(record: DemoRecord, summary: dict[str, Any] | None = None) -> Path:
    """summary.json, the plots and report.md in `record.out` (`summary`: `summarise(record)`, if the caller
    has it already); returns the report's path."""
    record.out.mkdir(parents=True, exist_ok=True)
    summary = summarise(record) if summary is None else summary
    (record.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_plots(summary, record.out)
    path = record.out / "report.md"
    path.write_text(render_markdown(summary))
    return path
