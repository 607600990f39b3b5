"""The coordinator's status page and JSON API, readable without Grafana.

The event loop calls `StatusBoard.update(snapshot)` after each sealed round and each heartbeat; the HTTP
server's threads (`hetnode.service.http_server`) call the routes. The board keeps a deep copy of the latest
snapshot and swaps it whole under a lock, so a handler never sees a half-updated one. Credit comes from
the ledger, not from the snapshot. Routes: `/` (HTML), `/api/status`, `/api/contributions`, `/healthz`
(the coordinator adds `/metrics` itself).

Snapshot schema (every key may be missing and every value None; the page shows "–" for what it lacks):

    {"run": str, "config": str, "peer_id": str, "maddrs": [str], "started": float (unix time),
     "params_round": int, "eval_loss": float | None,
     "peers": [{"peer": str, "name": str, "role": str, "link_class": str, "chain": str | None,
                "stage": int | None, "params_round": int | None, "up_mbps": float | None,
                "down_mbps": float | None, "last_seen": float}],
     "chains": [{"chain": str, "members": [str (peer ids)], "live": bool}],
     "history": [{"round": int, "contributors": int, "excluded": int, "tokens": int, "eval_loss": float,
                  "seal_seconds": float, "time": float, "payload_bytes": {"anchor": int, "stage": int}}]}

Names, roles, chain ids and everything else in the snapshot are chosen by peers: the page passes every
such string through `html.escape`, and a Content-Security-Policy forbids scripts besides. JSON maps NaN
and infinities to null (strict JSON has no spelling for them).
"""

from __future__ import annotations

import copy
import html
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from bootstrap.ledger import Ledger, Standing, Verdict
from hetnode.daemon.status import format_mbit
from hetnode.service.http_server import Response, Route

LEADERBOARD_TOP = 100
HISTORY_ROWS = 20
REFRESH_S = 5
JSON_TYPE = "application/json"
HTML_TYPE = "text/html; charset=utf-8"


class StatusBoard:
    """The latest snapshot from the event loop, served as HTML and JSON (`clock` is for tests)."""

    def __init__(
        self, ledger: Ledger, stale_after_s: float = 60.0, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.ledger = ledger
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {}
        self._updated: float | None = None

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the snapshot (copied, so the caller may keep mutating its own)."""
        if not isinstance(snapshot, Mapping):
            raise TypeError(f"snapshot must be a mapping, got {type(snapshot).__name__}")
        fresh = copy.deepcopy(dict(snapshot))
        now = self._clock()
        with self._lock:
            self._snapshot, self._updated = fresh, now

    def _latest(self) -> tuple[dict[str, Any], float | None]:
        with self._lock:
            return self._snapshot, self._updated  # replaced whole, never mutated

    def _standings(self) -> list[Standing]:
        return self.ledger.standings()  # the ledger bounds its connections, whatever the threads

    def routes(self) -> dict[str, Route]:
        return {
            "/": self.page,
            "/api/status": self.api_status,
            "/api/contributions": self.api_contributions,
            "/healthz": self.healthz,
        }

    # -- routes --------------------------------------------------------------------------------------

    def api_status(self) -> Response:
        snapshot, updated = self._latest()
        body = dict(snapshot)
        body["leaderboard"] = [s.as_dict() for s in self._standings()[:LEADERBOARD_TOP]]
        body["updated"] = updated
        return _json(body)

    def api_contributions(self) -> Response:
        standings = self._standings()
        scores = self.ledger.scores()

        def with_score(s: Standing) -> dict[str, Any]:
            entry = scores.get(s.peer)
            extra = {"score": entry.average, "rejected": entry.rejected} if entry else {"score": None}
            return s.as_dict() | extra

        return _json(
            {
                "total_tokens": sum(s.tokens for s in standings),
                "rounds": self._rounds(),
                "standings": [with_score(s) for s in standings],
                # verification (TRUST §4): contributions given no weight or credit, and why
                "rejections": self.ledger.rejections(),
                "verdicts": [v.as_dict() for v in self.ledger.recent_verdicts()],
            }
        )

    def _rounds(self) -> int:
        return self.ledger.totals().rounds

    def healthz(self) -> Response:
        snapshot, updated = self._latest()
        if updated is None:
            return _json({"ok": False, "reason": "no status update yet"}, status=503)
        age = max(0.0, self._clock() - updated)
        body = {"ok": age <= self.stale_after_s, "round": snapshot.get("params_round"), "age_s": age}
        if not body["ok"]:
            body["reason"] = f"last status update {age:.0f} s ago (stale after {self.stale_after_s:.0f} s)"
            return _json(body, status=503)
        return _json(body)

    def page(self) -> Response:
        snapshot, _ = self._latest()
        verdicts = [v for v in self.ledger.recent_verdicts() if v.reason is not None][:HISTORY_ROWS]
        scores = {peer: entry.average for peer, entry in self.ledger.scores().items()}
        html_text = render_page(
            snapshot, self._standings()[:LEADERBOARD_TOP], self._clock(), scores, verdicts
        )
        return Response(html_text.encode("utf-8"), HTML_TYPE)


# -- JSON ----------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Plain JSON values; NaN and infinities become None, unknown objects their str()."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        try:
            return _jsonable(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


def _json(body: Any, status: int = 200) -> Response:
    text = json.dumps(_jsonable(body), allow_nan=False, separators=(",", ":"))
    return Response(text.encode("utf-8"), JSON_TYPE, status)


# -- HTML ----------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:72em;padding:0 1em;color:#222}
h1{font-size:1.4em;margin:0}h2{font-size:1.1em;margin:1.6em 0 .4em}
.meta{color:#555}.meta b{color:#222}
table{border-collapse:collapse;width:100%}th,td{padding:.25em .6em;border-bottom:1px solid #ddd}
th{text-align:left;background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#888}.dead{color:#b00}svg{background:#fafafa;border:1px solid #ddd}
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


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


def render_page(
    snapshot: Mapping[str, Any],
    standings: list[Standing],
    now: float,
    scores: Mapping[str, float | None] | None = None,
    rejections: Sequence[Verdict] = (),
) -> str:
    """The whole status page; pure, so it is tested without a server. `scores`: each peer's verification
    average; `rejections`: the newest verdicts that refused a contribution."""
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
        ["#", "name", "tokens", "share", "rounds", "score", "role", "last seen"],
        [
            [(str(i), True), (f'<span title="{_e(s.peer)}">{_e(s.name or s.peer)}</span>', False)]
            + _cells(
                (_fmt_int(s.tokens), True),
                (f"{100 * s.share:.1f} %", True),
                (_fmt_int(s.rounds), True),
                (_fmt_float(scores.get(s.peer), 2), True),
                (s.role, False),
                (_ago(s.last_seen, now), False),
            )
            for i, s in enumerate(standings, 1)
        ],
        "No contributions credited yet.",
    )

    def link(p: Mapping[str, Any]) -> str:
        return f"↑ {format_mbit(p.get('up_mbps'))} / ↓ {format_mbit(p.get('down_mbps'))} Mbit/s"

    def chain_stage(p: Mapping[str, Any]) -> str:
        chain = p.get("chain")
        return "–" if chain is None else f"{chain} / {_text(p.get('stage'))}"

    live = _table(
        ["name", "role", "class", "chain / stage", "round held", "link", "last seen"],
        [
            _cells(
                (p.get("name") or p.get("peer") or "–", False),
                (_text(p.get("role")), False),
                (_text(p.get("link_class")), False),
                (chain_stage(p), False),
                (_fmt_int(p.get("params_round")), True),
                (link(p), False),
                (_ago(p.get("last_seen"), now), False),
            )
            for p in peers
        ],
        "No live peers.",
    )

    def member(peer_id: Any) -> str:
        return _text(names.get(peer_id) or peer_id) if isinstance(peer_id, str) else _text(peer_id)

    chains = _table(
        ["chain", "members", "live"],
        [
            [(_e(_text(c.get("chain"))), False)]
            + [(_e(", ".join(member(m) for m in _list(c.get("members")))), False)]
            + [("yes" if c.get("live") else '<span class="dead">no</span>', False)]
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
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>hetnode · {_e(run)}</title><style>{_CSS}</style></head><body>"
        f"<h1>hetnode run {_e(run)}</h1><p class=meta>{meta}</p><p class=muted>{ident}</p>"
        f"<h2>Leaderboard</h2>{leaderboard}"
        f"<h2>Global eval loss</h2>{chart}"
        f"<h2>Live peers</h2>{live}"
        f"<h2>Chains</h2>{chains}"
        f"<h2>Rounds (last {HISTORY_ROWS})</h2>{rounds}"
        f"<h2>Refused contributions (no weight, no credit)</h2>{refused}"
        "</body></html>\n"
    )
