"""The coordinator's status page as HTML: pure functions of a snapshot (schema in `bootstrap/status_page.py`),
tested without a server.

Everything in the snapshot is chosen by peers or emitted by the model: every such string goes through
`_e` (`html.escape` after `clean_text`). The page runs one inline script, allowed by its hash in the
Content-Security-Policy (no other script, no external resource: it works offline). The script refetches
the page every `REFRESH_S` seconds and swaps the sections marked `data-live`, so the page stays current
without a reload and keeps its scroll position; without JavaScript a `<noscript>` refresh reloads it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bootstrap.ledger import Standing, Verdict
from hetnode.service.formatting import format_mbit

HISTORY_ROWS = 20
# the leaderboard's token columns: what the peer's replica trained, and the part of it credited to the peer
LEADERBOARD_HEADERS = [
    "#",
    "name",
    "role",
    "replica tokens",
    "credited tokens",
    "share",
    "rounds",
    "score",
    "last seen",
]
CREDIT_NOTE = (
    "replica tokens: what the peer's replica trained in its sealed rounds (a chain stage: the whole "
    "chain's). credited tokens: the peer's part of them (an anchor: all; a stage: in proportion to the "
    "parameters it trains; docs/observability.md, Contribution credit). share: of all credited tokens."
)
REFRESH_S = 5

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:72em;padding:0 1em;color:#222}
h1{font-size:1.4em;margin:0}h2{font-size:1.1em;margin:1.6em 0 .4em}
.meta{color:#555}.meta b{color:#222}
table{border-collapse:collapse;width:100%}th,td{padding:.25em .6em;border-bottom:1px solid #ddd}
th{text-align:left;background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#888}.dead{color:#b00}svg{background:#fafafa;border:1px solid #ddd}
.samples{list-style:none;padding:0;margin:0}
.samples li{border-bottom:1px solid #ddd;padding:.4em 0;display:flex;gap:1em}
.samples .r{flex:0 0 6em;color:#555;font-variant-numeric:tabular-nums}
.samples q{quotes:none;white-space:pre-wrap;overflow-wrap:anywhere;font-family:ui-monospace,monospace}
.samples q b{color:#888}
"""

# Re-fetch the page, swap the live sections; on failure say so and keep the last good view.
_SCRIPT = (
    "(()=>{const live=document.getElementById('live');"
    "async function tick(){try{"
    "const r=await fetch(location.pathname,{cache:'no-store'});"
    "if(!r.ok)throw new Error('HTTP '+r.status);"
    "const doc=new DOMParser().parseFromString(await r.text(),'text/html');"
    "for(const el of document.querySelectorAll('[data-live]')){"
    "const fresh=doc.getElementById(el.id);"
    "if(fresh)el.replaceChildren(...Array.from(fresh.childNodes,n=>document.importNode(n,true)));}"
    "document.title=doc.title;"
    "live.className='muted';live.textContent='live, updated '+new Date().toLocaleTimeString();"
    "}catch(err){live.className='dead';"
    "live.textContent='cannot reach the coordinator ('+err.message+'), retrying';}"
    f"finally{{setTimeout(tick,{REFRESH_S * 1000});}}}}"
    f"setTimeout(tick,{REFRESH_S * 1000});}})();"
)
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
    f"script-src 'sha256-{_SCRIPT_HASH}'"
)

# C0/C1 controls but tab and newline, lone surrogates (from a hand-edited rounds.jsonl) and bidi overrides
# that would reorder the rest of the page: a model's sample may hold any of them
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def clean_text(value: Any) -> str:
    """`value` as text that is safe to show: unsafe code points become U+FFFD."""
    return _UNSAFE.sub("\ufffd", str(value))


def _e(value: Any) -> str:
    return html.escape(clean_text(value), quote=True)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt_int(value: Any) -> str:
    x = _number(value)
    return "–" if x is None else f"{int(x):,}"


def _fmt_float(value: Any, digits: int = 4) -> str:
    x = _number(value)
    return "–" if x is None else f"{x:.{digits}g}"


def _fmt_bytes(value: Any) -> str:
    x = _number(value)
    if x is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(x) < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return "–"  # unreachable


def _fmt_share(value: Any) -> str:
    """A share in [0, 1] (a replica's compute utilisation) as "93 %"; "–" when unknown or out of range."""
    x = _number(value)
    return "–" if x is None or not 0 <= x <= 1 else f"{100 * x:.0f} %"


def _ago(then: Any, now: float) -> str:
    x = _number(then)
    return "–" if x is None else f"{max(0.0, now - x):.0f} s ago"


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    """A snapshot list, keeping only its dict entries (anything else is ignored, not an error)."""
    return [v for v in _list(value) if isinstance(v, Mapping)]


def _text(value: Any) -> str:
    return "–" if value is None else str(value)


def _table(headers: Iterable[str], rows: list[list[tuple[str, bool]]], empty: str) -> str:
    """`rows` of (already escaped cell html, is numeric)."""
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{c}</td>' if n else f"<td>{c}</td>" for c, n in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cells(*cells: tuple[Any, bool]) -> list[tuple[str, bool]]:
    return [(_e(c), n) for c, n in cells]


def _section(id_: str, title: str, body: str) -> str:
    """A titled part of the page that the refresh script replaces in place."""
    return f'<h2>{_e(title)}</h2><section id="{id_}" data-live>{body}</section>'


def loss_chart(points: list[tuple[float, float]], width: int = 640, height: int = 200) -> str:
    """An inline SVG line of (round, eval loss), scaled to the data; one point is drawn as a dot."""
    if not points:
        return '<p class="muted">No evaluated rounds yet.</p>'
    pad_l, pad_r, pad_y = 56, 12, 16
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        if x1 == x0:
            return (width + pad_l - pad_r) / 2
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return pad_y + (y1 - y) / (y1 - y0) * (height - 2 * pad_y)

    coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    mark = (
        f'<circle cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="3" fill="#2a6fdb"/>'
        if len(points) == 1
        else f'<polyline points="{coords}" fill="none" stroke="#2a6fdb" stroke-width="2"/>'
    )
    labels = (
        f'<text x="4" y="{pad_y + 4}" font-size="11">{_e(_fmt_float(y1))}</text>'
        f'<text x="4" y="{height - pad_y + 4}" font-size="11">{_e(_fmt_float(y0))}</text>'
        f'<text x="{pad_l}" y="{height - 2}" font-size="11">round {_e(_fmt_int(x0))}</text>'
        f'<text x="{width - pad_r}" y="{height - 2}" font-size="11" text-anchor="end">'
        f"round {_e(_fmt_int(x1))}</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="global eval loss per round">'
        f"{labels}{mark}</svg>"
    )


def samples_list(samples: Sequence[Mapping[str, Any]]) -> str:
    """Each sample as its round, the prompt in bold grey and the model's continuation as plain text."""
    if not samples:
        return '<p class="muted">No samples yet.</p>'
    items = "".join(
        f'<li><span class="r">round {_e(_fmt_int(s.get("round")))}</span>'
        f"<q><b>{_e(s.get('prompt') or '')}</b>{_e(s.get('text') or '')}</q></li>"
        for s in samples
    )
    return f'<ol class="samples">{items}</ol>'


def render_page(
    snapshot: Mapping[str, Any],
    standings: list[Standing],
    now: float,
    scores: Mapping[str, float | None] | None = None,
    rejections: Sequence[Verdict] = (),
) -> str:
    """The whole status page. `scores`: each peer's verification average; `rejections`: the newest
    verdicts that refused a contribution."""
    scores = scores or {}
    peers = _dicts(snapshot.get("peers"))
    names = {p["peer"]: p.get("name") for p in peers if isinstance(p.get("peer"), str)}
    history = sorted(
        _dicts(snapshot.get("history")), key=lambda h: _number(h.get("round")) or 0.0, reverse=True
    )
    run = _text(snapshot.get("run"))

    started = _number(snapshot.get("started"))
    meta = (
        f"round <b>{_e(_fmt_int(snapshot.get('params_round')))}</b> · "
        f"global eval loss <b>{_e(_fmt_float(snapshot.get('eval_loss')))}</b> · "
        f"<b>{len(peers)}</b> live peers · config {_e(_text(snapshot.get('config')))} · "
        f"up {_e('–' if started is None else f'{max(0.0, now - started) / 3600:.1f} h')}"
    )
    ident = f"coordinator {_e(_text(snapshot.get('peer_id')))}"
    maddrs = _list(snapshot.get("maddrs"))
    if maddrs:
        ident += " · " + " ".join(f"<code>{_e(m)}</code>" for m in maddrs)

    leaderboard = _table(
        LEADERBOARD_HEADERS,
        [
            [(str(i), True), (f'<span title="{_e(s.peer)}">{_e(s.name or s.peer)}</span>', False)]
            + _cells(
                (s.role, False),
                (_fmt_int(s.replica_tokens), True),
                (_fmt_int(s.tokens), True),
                (f"{100 * s.share:.1f} %", True),
                (_fmt_int(s.rounds), True),
                (_fmt_float(scores.get(s.peer), 2), True),
                (_ago(s.last_seen, now), False),
            )
            for i, s in enumerate(standings, 1)
        ],
        "No contributions credited yet.",
    ) + (f'<p class="muted">{_e(CREDIT_NOTE)}</p>' if standings else "")

    def link(p: Mapping[str, Any]) -> str:
        return f"↑ {format_mbit(p.get('up_mbps'))} / ↓ {format_mbit(p.get('down_mbps'))} Mbit/s"

    def chain_stage(p: Mapping[str, Any]) -> str:
        chain = p.get("chain")
        return "–" if chain is None else f"{chain} / {_text(p.get('stage'))}"

    live = _table(
        ["name", "role", "class", "chain / stage", "round held", "utilisation", "link", "last seen"],
        [
            _cells(
                (p.get("name") or p.get("peer") or "–", False),
                (_text(p.get("role")), False),
                (_text(p.get("link_class")), False),
                (chain_stage(p), False),
                (_fmt_int(p.get("params_round")), True),
                (_fmt_share(p.get("utilization")), True),
                (link(p), False),
                (_ago(p.get("last_seen"), now), False),
            )
            for p in peers
        ],
        "No live peers.",
    )

    def member(peer_id: Any) -> str:
        return _text(names.get(peer_id) or peer_id) if isinstance(peer_id, str) else _text(peer_id)

    def went_on(c: dict) -> str:
        """Where a chain that went on with a spare comes from, and whom its members caught lying."""
        lineage = c.get("lineage")
        parts = [f"from {_text(lineage)}"] if isinstance(lineage, str) and lineage != c.get("chain") else []
        blamed = [member(m) for m in _list(c.get("blamed"))]
        parts += [f"caught lying: {', '.join(blamed)}"] if blamed else []
        dropped = c.get("dropped") if isinstance(c.get("dropped"), Mapping) else {}
        left = [f"{member(p)} ({_text(why)})" for p, why in dropped.items() if why != "caught lying"]
        parts += [f"dropped: {', '.join(left)}"] if left else []
        return _e("; ".join(parts))

    def stages(c: dict) -> str:
        """Each stage's workers, a pool's with its share of the micro-batches (newest sealed round)."""
        served = c.get("served") if isinstance(c.get("served"), Mapping) else {}
        pools = _list(c.get("workers")) or [[m] for m in _list(c.get("members"))]

        def worker(peer: Any) -> str:
            share = _number(served.get(peer)) if isinstance(peer, str) else None
            return member(peer) + (f" ({share:.0%})" if share is not None else "")

        return _e(" | ".join(", ".join(worker(p) for p in _list(pool)) for pool in pools))

    chains = _table(
        ["chain", "stages (workers)", "live", "history"],
        [
            [(_e(_text(c.get("chain"))), False)]
            + [(stages(c), False)]
            + [("yes" if c.get("live") else '<span class="dead">no</span>', False)]
            + [(went_on(c), False)]
            for c in _dicts(snapshot.get("chains"))
        ],
        "No chains.",
    )

    points = [
        (r, loss)
        for h in history
        if (r := _number(h.get("round"))) is not None and (loss := _number(h.get("eval_loss"))) is not None
    ]
    chart = loss_chart(sorted(points))

    def payload(h: Mapping[str, Any]) -> str:
        pb = h.get("payload_bytes")
        pb = pb if isinstance(pb, Mapping) else {}
        return f"{_fmt_bytes(pb.get('anchor'))} / {_fmt_bytes(pb.get('stage'))}"

    rounds = _table(
        [
            "round",
            "contributors",
            "excluded",
            "tokens",
            "eval loss",
            "seal",
            "payload anchor / stage",
            "when",
        ],
        [
            _cells(
                (_fmt_int(h.get("round")), True),
                (_fmt_int(h.get("contributors")), True),
                (_fmt_int(h.get("excluded")), True),
                (_fmt_int(h.get("tokens")), True),
                (_fmt_float(h.get("eval_loss")), True),
                (f"{_fmt_float(h.get('seal_seconds'), 3)} s", True),
                (payload(h), True),
                (_ago(h.get("time"), now), False),
            )
            for h in history[:HISTORY_ROWS]
        ],
        "No sealed rounds yet.",
    )

    refused = _table(
        ["round", "peer", "reason", "score", "average"],
        [
            _cells(
                (_fmt_int(v.round), True),
                (member(v.peer), False),
                (_text(v.reason), False),
                (_fmt_float(v.score, 2), True),
                (_fmt_float(v.average, 2), True),
            )
            for v in rejections
        ],
        "No contribution refused.",
    )

    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f'<noscript><meta http-equiv="refresh" content="{REFRESH_S}"></noscript>'
        '<link rel="icon" href="data:,">'
        f"<title>hetnode · {_e(run)}</title><style>{_CSS}</style></head><body>"
        f"<h1>hetnode run {_e(run)}</h1>"
        f'<p id="meta" class="meta" data-live>{meta}</p><p class="muted">{ident}</p>'
        f'<p id="live" class="muted">updates every {REFRESH_S} s</p>'
        + _section("leaderboard", "Leaderboard", leaderboard)
        + _section("loss", "Global eval loss", chart)
        + _section("samples", "Samples from the global model", samples_list(_dicts(snapshot.get("samples"))))
        + _section("peers", "Live peers", live)
        + _section("chains", "Chains", chains)
        + _section("rounds", f"Rounds (last {HISTORY_ROWS})", rounds)
        + _section("refused", "Refused contributions (no weight, no credit)", refused)
        + f"<script>{_SCRIPT}</script></body></html>\n"
    )
