"""The coordinator's status page and JSON API, readable without Grafana.

The event loop calls `StatusBoard.update(snapshot)` after each sealed round and each heartbeat; the HTTP
server's threads (`hetnode.service.http_server`) call the routes. The board keeps a deep copy of the latest
snapshot and swaps it whole under a lock, so a handler never sees a half-updated one. Credit comes from
the ledger, not from the snapshot. Routes: `/` (HTML, rendered by `bootstrap/status_html.py`),
`/api/status`, `/api/swarm`, `/api/swarm/signed`, `/api/samples`, `/api/contributions`, `/healthz` (the
coordinator adds `/metrics` itself). `/api/swarm` is the snapshot's "swarm": the `hetnode status --json`
document (docs/status-json.md), which `hetnode status --peer http://…` prints without a DHT client of its own;
`/api/swarm/signed` is the same signed by the coordinator's key, which `status --peer <multiaddr>` takes.

Snapshot schema (every key may be missing and every value None; the page shows "–" for what it lacks):

    {"run": str, "config": str, "peer_id": str, "maddrs": [str], "started": float (unix time),
     "params_round": int, "eval_loss": float | None,
     "peers": [{"peer": str, "name": str, "role": str, "link_class": str, "chain": str | None,
                "stage": int | None, "params_round": int | None, "up_mbps": float | None,
                "down_mbps": float | None, "last_seen": float,
                "utilization": float | None (0..1, the replica's own figure over its last rounds)}],
     "chains": [{"chain": str, "members": [str (peer ids)], "live": bool, "lineage": str,
                 "blamed": [str (peer ids)]}],
     "history": [{"round": int, "contributors": int, "excluded": int, "tokens": int,
                  "eval_loss": float | None (None until the bookkeeping worker evaluated the round),
                  "seal_seconds": float, "time": float, "payload_bytes": {"anchor": int, "stage": int}}],
     "samples": [{"round": int, "prompt": str, "text": str, "temperature": float, "seed": int,
                  "tokens": int, "seconds": float}],  (newest first; `bootstrap/samples.py`)
     "swarm": {...} (docs/status-json.md; served at /api/swarm, left out of /api/status),
     "swarm_signed": {"document": str, "key": str, "signature": str} (at /api/swarm/signed)}

Names, roles, chain ids, samples and everything else in the snapshot are chosen by peers or emitted by the
model: the page shows every such string as text, never as markup, and its Content-Security-Policy allows
no script but its own. JSON maps NaN and infinities to null (strict JSON has no spelling for them).
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from bootstrap.ledger import Ledger, Standing
from bootstrap.status_html import HISTORY_ROWS, render_page
from hetnode.service.http_server import Response, Route

LEADERBOARD_TOP = 100
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
            "/api/swarm": self.api_swarm,
            "/api/swarm/signed": self.api_swarm_signed,
            "/api/samples": self.api_samples,
            "/api/contributions": self.api_contributions,
            "/healthz": self.healthz,
        }

    # -- routes --------------------------------------------------------------------------------------

    def api_status(self) -> Response:
        snapshot, updated = self._latest()
        body = dict(snapshot)
        body.pop("swarm", None)  # the peers again, with digests: at /api/swarm for who wants them
        body.pop("swarm_signed", None)
        body["leaderboard"] = [s.as_dict() for s in self._standings()[:LEADERBOARD_TOP]]
        body["updated"] = updated
        return _json(body)

    def api_swarm(self) -> Response:
        """The `hetnode status --json` document (503 until the first read of the swarm)."""
        snapshot, _ = self._latest()
        swarm = snapshot.get("swarm")
        if not isinstance(swarm, dict):
            return _json({"reason": "the swarm was not read yet"}, status=503)
        return _json(swarm)

    def api_swarm_signed(self) -> Response:
        """The same document signed by the coordinator's key (`hetnode/protocol/status_signed.py`)."""
        snapshot, _ = self._latest()
        signed = snapshot.get("swarm_signed")
        if not isinstance(signed, dict):
            return _json({"reason": "the swarm was not read yet"}, status=503)
        return _json(signed)

    def api_samples(self) -> Response:
        """The newest samples from the global model alone (a small document to poll)."""
        snapshot, updated = self._latest()
        samples = snapshot.get("samples")
        return _json({"samples": samples if isinstance(samples, list) else [], "updated": updated})

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
                # verification (docs/security.md, "Send useless or harmful work"): contributions given no
                # weight or credit, and why
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
