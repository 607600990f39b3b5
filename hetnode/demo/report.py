"""The demo's report: `summary.json` (machine-readable) and `report.md` (for people), built from what the run
left behind, so a report is written even after a Ctrl+C or a failure, from whatever exists.

`summarise` turns the collected data into the summary and `render_markdown` the summary into text; both are
pure functions of their input and are tested on hand-made data. Plots are in `hetnode/demo/plots.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetnode.demo.plots import PLOTS, write_plots
from hetnode.demo.rounds import (
    contributor_count,
    human_bytes,
    human_ratio,
    human_seconds,
    loss_text,
    number,
    round_bytes,
    seconds_per_round,
)
from hetnode.service.round_log import log_utilization


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
    contributions: dict[str, Any] | None = None  # GET /api/contributions
    digests: dict[str, Any] | None = None  # digests.compare_digests()
    round_logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> rounds-local.jsonl
    leftovers: list[int] = field(default_factory=list)


def _rel(path: str | Path, out: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(out.resolve()))
    except ValueError:
        return str(path)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(record: DemoRecord) -> dict[str, Any]:
    """The machine-readable summary (what `summary.json` holds)."""
    names = {p["peer_id"]: p["name"] for p in record.processes if p.get("peer_id")}
    stage_ids = {p["peer_id"] for p in record.processes if p.get("role") == "stage" and p.get("peer_id")}
    rounds = []
    for entry in sorted(record.history, key=lambda e: e.get("round", 0)):
        b = round_bytes(entry)
        contributors = entry.get("contributors")
        ids = contributors if isinstance(contributors, list) else []
        rounds.append(
            {
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
        )
    losses = [(r["round"], r["eval_loss"]) for r in rounds if r["eval_loss"] is not None]
    totals = {k: sum(r["bytes"][k] for r in rounds) for k in ("anchor", "stage", "sparse", "dense")}
    config = record.config
    standings = (record.contributions or {}).get("standings")
    keep = ("name", "peer", "role", "tokens", "share", "rounds", "bytes_sent")
    return {
        "outcome": record.outcome,
        "error": record.error,
        "requested_rounds": record.requested_rounds,
        "sealed_rounds": len(rounds),
        "wall_s": round(record.wall_s, 1),
        "seconds_per_round": seconds_per_round(record.history),
        "status_url": record.status_url,
        "shaped": record.shaped,
        "config": {
            "path": str(record.config_path),
            "run": config.get("run", {}).get("name"),
            "d_model": config.get("model", {}).get("d_model"),
            "n_layers": config.get("model", {}).get("n_layers"),
            "inner_steps": config.get("outer", {}).get("inner_steps"),
            "stages": config.get("pipeline", {}).get("stages"),
            "compression": config.get("pipeline", {}).get("compression"),
        },
        "processes": [p | {"log": _rel(p["log"], record.out)} for p in record.processes],
        "chains": record.chains,
        "first_stage_round": next((r["round"] for r in rounds if r["with_stages"]), None),
        "rounds": rounds,
        "eval_loss": [r["eval_loss"] for r in rounds],
        "loss_start": losses[0][1] if losses else None,
        "loss_end": losses[-1][1] if losses else None,
        "digests_agree": record.digests["agree"] if record.digests else None,
        "digests": record.digests,
        "contributions": [{k: s.get(k) for k in keep} for s in standings or [] if isinstance(s, Mapping)],
        "bytes": {
            "total": totals,
            "mean_per_round": {k: (v / len(rounds) if rounds else None) for k, v in totals.items()},
            "ratio": totals["dense"] / totals["sparse"] if totals["sparse"] and totals["dense"] else None,
        },
        "peer_traffic": _traffic(record.round_logs, record.processes),
        "leftovers": record.leftovers,
        "plots": dict(PLOTS),
    }


def _traffic(logs: Mapping[str, list[dict[str, Any]]], processes: list[dict[str, Any]]) -> list[dict]:
    """Per peer, from its own round log: what its rounds cost it."""
    roles = {p["name"]: p.get("role") for p in processes}
    rows = []
    for name, entries in sorted(logs.items()):
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


# -- markdown ------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A table cell: only what would break the table is escaped (a pipe, a backslash, a line break)."""
    text = "–" if value is None else str(value)
    return " ".join(text.replace("\\", "\\\\").replace("|", "\\|").split())


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A GitHub-flavoured markdown table; `align` holds one of 'l'/'r' per column (default left)."""
    marks = ["---:" if (align[i : i + 1] == "r") else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def narrative(summary: Mapping[str, Any]) -> str:
    """The 'what happened' paragraph, written from the data only."""
    n, pace = summary["sealed_rounds"], summary["seconds_per_round"]
    peers = [p for p in summary["processes"] if p["role"] != "coordinator"]
    anchors = sum(p["role"] == "anchor" for p in peers)
    edges = len(peers) - anchors
    said = [f"{anchors} anchor(s) and {edges} edge peer(s) joined a coordinator."]
    how = {"finished": "The swarm sealed", "interrupted": "Interrupted, the swarm had sealed"}
    line = f"{how.get(summary['outcome'], 'The run failed after the swarm sealed')} {n} rounds "
    line += f"({summary['requested_rounds']} requested) in {human_seconds(summary['wall_s'])}"
    said.append(line + (f", one every {pace:.1f} s." if pace else "."))
    if summary.get("error"):
        said.append(f"Error: {summary['error'].splitlines()[0]}")
    first = summary["first_stage_round"]
    if first is not None:
        live = [c for c in summary["chains"] if c.get("members")]
        which = f" ({', '.join(live[0]['members'])})" if live else ""
        said.append(f"The chain{which} formed and first contributed in round {first}.")
    elif edges:
        said.append("No chain contributed to a sealed round.")
    rounds = [r for r in summary["rounds"] if r["eval_loss"] is not None]
    if len(rounds) >= 2:
        a, b = rounds[0], rounds[-1]
        verb = "fell" if b["eval_loss"] < a["eval_loss"] else "did not fall"
        said.append(
            f"Eval loss {verb} from {a['eval_loss']:.3f} (round {a['round']}) to {b['eval_loss']:.3f} "
            f"(round {b['round']})."
        )
    elif rounds:
        said.append(f"Eval loss after round {rounds[0]['round']}: {rounds[0]['eval_loss']:.3f}.")
    mean = summary["bytes"]["mean_per_round"]
    if mean["sparse"]:
        said.append(
            f"A round moved {human_bytes(mean['sparse'])} of SparseLoCo payloads on average (anchors "
            f"{human_bytes(mean['anchor'])}, stages {human_bytes(mean['stage'])}) where dense fp32 would "
            f"have moved {human_bytes(mean['dense'])}: {human_ratio(summary['bytes']['ratio'])} less."
        )
    digests = summary["digests"]
    if digests is None:
        said.append("Layer digests were not checked (the run did not finish).")
    elif digests["agree"]:
        held = ", ".join(str(r) for r in digests["rounds"])
        said.append(
            f"All {len(digests['peers'])} replicas published the coordinator's layer digests for the "
            f"round they held ({held}): one model, bit for bit."
        )
    else:
        bad = [f"{p['name']} ({p['reason']})" for p in digests["peers"] if not p["agree"]]
        said.append("Layer digests did not all agree: " + "; ".join(bad) + ".")
    if summary["contributions"]:
        top = summary["contributions"][0]
        said.append(
            f"{top['name']} earned the largest share of credited tokens ({100 * top['share']:.1f} %)."
        )
    if summary["leftovers"]:
        said.append(f"{len(summary['leftovers'])} process(es) outlived their daemon and were killed.")
    return " ".join(said)


def render_markdown(summary: Mapping[str, Any]) -> str:
    c = summary["config"]
    net = (
        "each process in its own network namespace; edges shaped with tc"
        if summary["shaped"]
        else "loopback; the edges' link speeds are only declared"
    )
    parts = [
        "# hetnode demo",
        "",
        f"**{summary['outcome']}**: {summary['sealed_rounds']} rounds sealed "
        f"({summary['requested_rounds']} requested) in {human_seconds(summary['wall_s'])}.",
        "",
        "## What happened",
        "",
        narrative(summary),
        "",
        "## What ran",
        "",
        f"- config: `{c['path']}` (run `{c['run']}`: d_model {c['d_model']}, {c['n_layers']} layers, "
        f"H = {c['inner_steps']} inner steps per round, chains of {c['stages']} stages, activation "
        f"compression `{c['compression']}`)",
        f"- network: {net}",
        f"- status page (gone with the coordinator): {summary['status_url'] or '–'}",
        "",
        table(
            ["process", "role", "link", "peer id", "exit code"],
            [
                [
                    p["name"],
                    p["role"],
                    _link(p),
                    p.get("peer_id"),
                    p.get("exit_code"),
                ]
                for p in summary["processes"]
            ],
        ),
        "",
    ]
    if summary["chains"]:
        chains = [
            [
                ch.get("chain"),
                ", ".join(ch.get("members") or []),
                "yes" if ch.get("live") else "no",
                ch.get("first_seen"),
            ]
            for ch in summary["chains"]
        ]
        parts += [table(["chain", "members", "live when last seen", "first seen at round"], chains), ""]
    parts += ["## Rounds", ""]
    rows = [
        [
            r["round"],
            f"{r['contributors']} ({', '.join(r['contributor_names'])})"
            if r["contributor_names"]
            else r["contributors"],
            f"{r['tokens'] or 0:,}",
            loss_text(r["eval_loss"]),
            human_bytes(r["bytes"]["anchor"]),
            human_bytes(r["bytes"]["stage"]),
            human_bytes(r["bytes"]["dense"]),
            human_ratio(r["ratio"]),
        ]
        for r in summary["rounds"]
    ]
    headers = ["round", "contributors", "tokens", "eval loss", "anchors", "stages", "dense fp32", "smaller"]
    parts += [table(headers, rows, "rlrrrrrr") if rows else "No round was sealed.", ""]
    parts += [
        f"Eval loss: {loss_text(summary['loss_start'])} at the start, {loss_text(summary['loss_end'])} "
        "at the end.",
        "",
    ]
    parts += ["## Digest agreement", "", _digests_text(summary["digests"]), ""]
    parts += ["## Contributions", ""]
    standings = [
        [i, s["name"], s["role"], f"{s['tokens'] or 0:,}", f"{100 * (s['share'] or 0):.1f} %", s["rounds"]]
        for i, s in enumerate(summary["contributions"], 1)
    ]
    parts += [
        table(["#", "name", "role", "tokens", "share", "rounds"], standings, "rllrrr")
        if standings
        else "No contributions credited (or the coordinator's ledger could not be read).",
        "",
    ]
    b = summary["bytes"]
    parts += ["## Bytes per round, by replica class", ""]
    labels = {"anchor": "anchors", "stage": "chain stages", "sparse": "all SparseLoCo", "dense": "dense fp32"}
    parts += [
        table(
            ["class", "mean per round", "total"],
            [[labels[k], human_bytes(b["mean_per_round"][k]), human_bytes(b["total"][k])] for k in labels],
            "lrr",
        ),
        "",
        f"Dense fp32 / SparseLoCo: {human_ratio(b['ratio'])}.",
        "",
    ]
    if summary["peer_traffic"]:
        traffic = [
            [
                t["name"],
                t["role"],
                f"{t['included']}/{t['rounds']}",
                f"{t['tokens']:,}",
                human_bytes(t["upload_bytes"]),
                human_bytes(t["download_bytes"]),
                human_bytes(t["activation_bytes_sent"]),
                _percent(t.get("compute_utilization")),
            ]
            for t in summary["peer_traffic"]
        ]
        headers = [
            "peer",
            "role",
            "rounds in seal",
            "tokens",
            "payload up",
            "sealed down",
            "activations sent",
            "compute utilisation",
        ]
        parts += ["## Each peer's own round log", "", table(headers, traffic, "llrrrrrr"), ""]
        parts += [
            "Compute utilisation: seconds in inner steps over wall seconds, from the first round's first "
            "inner step to the last round's announcement.",
            "",
        ]
    parts += ["## Plots", ""]
    parts += [f"- [{name}]({path})" for name, path in summary["plots"].items()]
    parts += ["", "## Logs", ""]
    parts += [f"- {p['name']}: [{p['log']}]({p['log']})" for p in summary["processes"]]
    return "\n".join(parts) + "\n"


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f} %"


def _link(process: Mapping[str, Any]) -> str:
    rate = process.get("bandwidth_mbit")
    if rate is None:
        return "–"
    shaped = process.get("shaped") and process.get("role") == "stage"
    return f"{rate:g} Mbit/s" + (" (tc)" if shaped else " (declared)")


def _digests_text(digests: Mapping[str, Any] | None) -> str:
    if digests is None:
        return "Not checked: the digests are compared only after a run that finished."
    verdict = "Every replica agrees" if digests["agree"] else "**Disagreement**"
    rows = [
        [p["name"], p["params_round"], "yes" if p["agree"] else "no", p["reason"] or ""]
        for p in digests["peers"]
    ]
    head = f"{verdict} with the coordinator's history (rounds held: {digests['rounds'] or '–'})."
    return head + "\n\n" + table(["replica", "round held", "equal digests", "why not"], rows, "lrll")


def write_report(record: DemoRecord) -> Path:
    """summary.json, the plots and report.md in `record.out`; returns the report's path."""
    record.out.mkdir(parents=True, exist_ok=True)
    summary = summarise(record)
    (record.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_plots(summary, record.out)
    path = record.out / "report.md"
    path.write_text(render_markdown(summary))
    return path
