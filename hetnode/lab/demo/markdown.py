"""`report.md`, rendered from the summary alone (`hetnode/lab/demo/report.py`): a pure function of its input,
tested on hand-made data. The headline is `result_line`, the same sentence the demo prints last."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hetnode.lab.demo.rounds import (
    human_bytes,
    human_ratio,
    human_seconds,
    loss_text,
    replicas_text,
    span_text,
)

CREDIT_NOTE = (
    "replica tokens: what the peer's replica trained in these rounds (a chain stage: the whole chain's). "
    "credited tokens: the peer's part of them, by the rule of docs/observability.md (Contribution credit): "
    "all of them for an anchor, a chain's split over its stages in proportion to the parameters each trains. "
    "of its replica: credited / replica tokens. share: of all tokens credited in these rounds."
)


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


def percent(share: float | None, digits: int = 0) -> str:
    return "–" if share is None else f"{100 * share:.{digits}f} %"


def result_line(summary: Mapping[str, Any]) -> str:
    """The run in one line, printed last by the demo and heading the report: rounds sealed (as many as
    requested at most), the final eval loss and the swarm's replicas and peers."""
    rounds = [r["round"] for r in summary["rounds"]]
    losses = [r for r in summary["rounds"] if r["eval_loss"] is not None]
    loss = "eval loss –"
    if losses:
        loss = f"eval loss {loss_text(losses[-1]['eval_loss'])} after round #{losses[-1]['round']}"
        if len(losses) >= 2:
            loss = f"eval loss {loss_text(losses[0]['eval_loss'])} → " + loss[len("eval loss ") :]
    swarm = summary["swarm"]
    return (
        f"{summary['outcome']}: {summary['sealed_rounds']} of {summary['requested_rounds']} rounds sealed "
        f"({span_text(rounds)}) in {human_seconds(summary['wall_s'])}; {loss}; {replicas_text(swarm)}, "
        f"{swarm['peers']} peers"
    )


def stopping_line(summary: Mapping[str, Any]) -> str | None:
    """The rounds sealed after the demo's last one (while it checked digests and stopped), or None."""
    extra = summary["stopping_rounds"]
    if not extra:
        return None
    rounds = span_text([r["round"] for r in extra])
    doing = "checked digests and stopped" if summary["outcome"] == "finished" else "stopped"
    return (
        f"also sealed while the demo {doing} the peers, and left out of the results: "
        f"{len(extra)} round(s), {rounds}"
    )


def narrative(summary: Mapping[str, Any]) -> str:
    """The 'what happened' paragraph, written from the data only."""
    n, pace, swarm = summary["sealed_rounds"], summary["seconds_per_round"], summary["swarm"]
    said = [
        f"{swarm['peers']} peers joined a coordinator: {swarm['anchors']} anchor(s) and "
        f"{swarm['edges']} edge peer(s), that is {replicas_text(swarm)}, since a chain is one replica."
    ]
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
    elif swarm["edges"]:
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
            f"All {len(digests['peers'])} peers of the {replicas_text(swarm)} published the coordinator's "
            f"layer digests for the round they held ({held}): one model, bit for bit."
        )
    else:
        bad = [f"{p['name']} ({p['reason']})" for p in digests["peers"] if not p["agree"]]
        said.append("Layer digests did not all agree: " + "; ".join(bad) + ".")
    if summary["contributions"]:
        top = summary["contributions"][0]
        said.append(
            f"{top['name']} earned the largest share of credited tokens ({percent(top['share'], 1)})."
        )
    if summary["leftovers"]:
        said.append(f"{len(summary['leftovers'])} process(es) outlived their daemon and were killed.")
    return " ".join(said)


def _round_row(r: Mapping[str, Any]) -> list[Any]:
    names = r["contributor_names"]
    return [
        r["round"],
        f"{r['contributors']} ({', '.join(names)})" if names else r["contributors"],
        f"{r['tokens'] or 0:,}",
        loss_text(r["eval_loss"]),
        human_bytes(r["bytes"]["anchor"]),
        human_bytes(r["bytes"]["stage"]),
        human_bytes(r["bytes"]["dense"]),
        human_ratio(r["ratio"]),
    ]


ROUND_HEADERS = ["round", "contributors", "tokens", "eval loss", "anchors", "stages", "dense fp32", "smaller"]
CONTRIBUTION_HEADERS = [
    "#",
    "name",
    "role",
    "rounds",
    "replica tokens",
    "credited tokens",
    "of its replica",
    "share",
]


def contribution_rows(contributions: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    return [
        [
            i,
            s["name"],
            s["role"],
            s["rounds"],
            f"{s['replica_tokens'] or 0:,}",
            f"{s['tokens'] or 0:,}",
            percent(s.get("of_replica"), 1),
            percent(s["share"], 1),
        ]
        for i, s in enumerate(contributions, 1)
    ]


def render_markdown(summary: Mapping[str, Any]) -> str:
    c = summary["config"]
    net = (
        "each process in its own network namespace; edges shaped with tc"
        if summary["shaped"]
        else "loopback; the edges' link speeds are only declared"
    )
    stopping = stopping_line(summary)
    parts = ["# hetnode demo", "", f"**{result_line(summary)}**", ""]
    parts += [stopping[0].upper() + stopping[1:] + ".", ""] if stopping else []
    parts += ["## What happened", "", narrative(summary), "", "## What ran", ""]
    parts += [
        f"- config: `{c['path']}` (run `{c['run']}`: d_model {c['d_model']}, {c['n_layers']} layers, "
        f"H = {c['inner_steps']} inner steps per round, chains of {c['stages']} stages, activation "
        f"compression `{c['compression']}`)",
        f"- network: {net}",
        f"- status page (gone with the coordinator): {summary['status_url'] or '–'}",
        "",
        table(
            ["process", "role", "link", "peer id", "exit code"],
            [
                [p["name"], p["role"], _link(p), p.get("peer_id"), p.get("exit_code")]
                for p in summary["processes"]
            ],
        ),
        "",
    ]
    if summary["chains"]:
        chains = [
            [
                ch.get("chain"),
                _stages_cell(ch),
                "yes" if ch.get("live") else "no",
                ch.get("first_seen"),
            ]
            for ch in summary["chains"]
        ]
        parts += [
            table(["chain", "stages (workers)", "live when last seen", "first seen at round"], chains),
            "",
        ]
    parts += ["## Rounds", ""]
    rows = [_round_row(r) for r in summary["rounds"]]
    parts += [table(ROUND_HEADERS, rows, "rlrrrrrr") if rows else "No round was sealed.", ""]
    parts += [
        f"Eval loss: {loss_text(summary['loss_start'])} at the start, {loss_text(summary['loss_end'])} "
        "at the end.",
        "",
    ]
    if stopping:
        parts += ["Sealed while stopping (not in the results above, the plots or the contributions):", ""]
        parts += [table(ROUND_HEADERS, [_round_row(r) for r in summary["stopping_rounds"]], "rlrrrrrr"), ""]
    last = summary["rounds"][-1]["round"] if summary["rounds"] else None
    parts += ["## Digest agreement", "", _digests_text(summary["digests"], last), ""]
    parts += ["## Contributions", ""]
    standings = contribution_rows(summary["contributions"])
    if standings:
        parts += [table(CONTRIBUTION_HEADERS, standings, "rllrrrrr"), "", CREDIT_NOTE, ""]
    else:
        parts += ["No contributions credited (or the coordinator's round history holds no credit).", ""]
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
        parts += _traffic_part(summary["peer_traffic"])
    parts += ["## Plots", ""]
    parts += [f"- [{name}]({path})" for name, path in summary["plots"].items()]
    parts += ["", "## Logs", ""]
    parts += [f"- {p['name']}: [{p['log']}]({p['log']})" for p in summary["processes"]]
    return "\n".join(parts) + "\n"


def _traffic_part(traffic: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [
        [
            t["name"],
            t["role"],
            f"{t['included']}/{t['rounds']}",
            f"{t['tokens']:,}",
            human_bytes(t["upload_bytes"]),
            human_bytes(t["download_bytes"]),
            human_bytes(t["activation_bytes_sent"]),
            percent(t.get("compute_utilization")),
        ]
        for t in traffic
    ]
    headers = [
        "peer",
        "role",
        "rounds in seal",
        "tokens through its layers",
        "payload up",
        "sealed down",
        "activations sent",
        "compute utilisation",
    ]
    return [
        "## Each peer's own round log",
        "",
        table(headers, rows, "llrrrrrr"),
        "",
        "Over the rounds of the results. Tokens through its layers: every round it trained, in the seal or "
        "not (a chain stage counts its chain's). Compute utilisation: seconds in inner steps over wall "
        "seconds, from the first round's first inner step to the last round's announcement.",
        "",
    ]


def _link(process: Mapping[str, Any]) -> str:
    rate = process.get("bandwidth_mbit")
    if rate is None:
        return "–"
    shaped = process.get("shaped") and process.get("role") == "stage"
    return f"{rate:g} Mbit/s" + (" (tc)" if shaped else " (declared)")


def _digests_text(digests: Mapping[str, Any] | None, last: int | None) -> str:
    """`last`: the results' last round; a peer may hold a later one, sealed while the demo checked."""
    if digests is None:
        return "Not checked: the digests are compared only after a run that finished."
    verdict = "Every peer agrees" if digests["agree"] else "**Disagreement**"
    rows = [
        [p["name"], p["params_round"], "yes" if p["agree"] else "no", p["reason"] or ""]
        for p in digests["peers"]
    ]
    head = f"{verdict} with the coordinator's history (rounds held: {digests['rounds'] or '–'})."
    later = [r for r in digests["rounds"] if last is not None and r > last]
    if later:
        head += (
            " The swarm trained on while the demo checked: a peer holds θ after the round it applied last."
        )
    return head + "\n\n" + table(["peer", "round held", "equal digests", "why not"], rows, "lrll")


def _stages_cell(chain: dict[str, Any]) -> str:
    """Each stage's workers (a pool's with its share of the micro-batches), and who was dropped and why."""
    served = chain.get("served") or {}
    pools = chain.get("workers") or [[m] for m in chain.get("members") or []]
    cell = " | ".join(
        ", ".join(f"{w} ({served[w]:.0%})" if isinstance(served.get(w), float) else str(w) for w in pool)
        for pool in pools
    )
    dropped = chain.get("dropped") or {}
    return cell + (f"; dropped: {', '.join(f'{p} ({why})' for p, why in dropped.items())}" if dropped else "")
