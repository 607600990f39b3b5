"""The demo's terminal view: a table redrawn about once a second on a terminal, one plain line per sealed
round anywhere else (CI logs, tests, a pipe), so that logs stay readable and diffable.

Everything shown comes from the coordinator: `GET /api/status` (peers, roles, chains, in the schema of
`bootstrap/status_page.py`) and its round history. Peer names are chosen by peers, so every cell is a
`rich.text.Text` (never parsed as markup).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hetnode.lab.demo.rounds import (
    contributor_count,
    eta_s,
    human_bytes,
    human_ratio,
    human_seconds,
    loss_text,
    round_bytes,
)

ROUNDS_SHOWN = 8


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _t(value: Any) -> Text:
    return Text("–" if value is None else str(value))


def plain_line(
    entry: Mapping[str, Any],
    sealed: int,
    total: int,
    eta: float | None,
    earlier: Sequence[Mapping[str, Any]] = (),
) -> str:
    """One line per sealed round, for logs: `sealed 3/8 (round #2)  contributors 4 ... ETA 40 s`: the third
    of eight sealed rounds is round number 2 (rounds count from 0, docs/glossary.md). The coordinator
    evaluates beside the next seals, so a round just sealed may have no eval loss yet: the line then shows
    the newest one of the `earlier` rounds (the demo's last line, `result_line`, has the final one)."""
    b = round_bytes(entry)
    loss = loss_text(entry.get("eval_loss"))
    if entry.get("eval_loss") is None:
        known = next((e for e in reversed(earlier) if e.get("eval_loss") is not None), None)
        if known is not None:
            loss += f" (#{known.get('round')}: {loss_text(known.get('eval_loss'))})"
    return (
        f"sealed {sealed}/{total} (round #{entry.get('round')})  contributors {contributor_count(entry)}  "
        f"tokens {entry.get('tokens') or 0:,}  eval loss {loss}  "
        f"bytes anchors {human_bytes(b.anchor)}, stages {human_bytes(b.stage)}, "
        f"dense fp32 {human_bytes(b.dense)} ({human_ratio(b.ratio)} smaller)  ETA {human_seconds(eta)}"
    )


def render(
    status: Mapping[str, Any] | None,
    history: Sequence[Mapping[str, Any]],
    total: int,
    url: str | None,
    elapsed_s: float,
    height: int = 40,
) -> RenderableType:
    """The whole view for one refresh, sized to fit `height` lines; pure, so it is tested by printing it.
    Shows the first `total` sealed rounds at most: later ones are the report's "sealed while stopping"."""
    status = status or {}
    history = list(history)[:total]
    peers = _dicts(status.get("peers"))
    chains = _dicts(status.get("chains"))
    known = next((e for e in reversed(history) if e.get("eval_loss") is not None), {})
    loss = loss_text(known.get("eval_loss")) + (f" (#{known.get('round')})" if known else "")
    header = Text.assemble(
        ("hetnode demo", "bold"),
        f"  sealed {len(history)}/{total}  ETA {human_seconds(eta_s(history, total))}",
        f"  elapsed {human_seconds(elapsed_s)}  eval loss {loss}",
        f"  {len(peers)} peers",
    )
    if not status:
        header.append("  (waiting for the coordinator)", style="dim")
    lines: list[RenderableType] = [header, Text(f"status page {url or '–'}", style="dim")]

    names = {p.get("peer"): p.get("name") for p in peers}
    for c in chains:
        members = c.get("members") if isinstance(c.get("members"), list) else []
        line = Text(f"chain {c.get('chain')}: ")
        line.append("live" if c.get("live") else "not live", style="green" if c.get("live") else "red")
        line.append("  " + " → ".join(str(names.get(m) or m) for m in members))
        lines.append(line)

    peer_table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("peer", "role", "class", "chain / stage", "round held"):
        peer_table.add_column(column, justify="right" if column == "round held" else "left")
    for p in peers:
        chain = p.get("chain")
        where = "–" if chain is None else f"{chain} / {p.get('stage')}"
        peer_table.add_row(
            _t(p.get("name")),
            _t(p.get("role")),
            _t(p.get("link_class")),
            _t(where),
            _t(p.get("params_round")),
        )
    lines.append(peer_table)

    fixed = len(lines) + len(peers) + 8  # table headers, rules and blank lines around two tables
    shown = max(1, min(ROUNDS_SHOWN, height - fixed))
    round_table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("round", "contrib", "tokens", "eval loss", "anchors", "stages", "dense fp32", "ratio"):
        round_table.add_column(column, justify="right", no_wrap=True)
    for entry in list(history)[-shown:]:
        b = round_bytes(entry)
        round_table.add_row(
            _t(entry.get("round")),
            _t(contributor_count(entry)),
            Text(f"{entry.get('tokens') or 0:,}"),
            Text(loss_text(entry.get("eval_loss"))),
            Text(human_bytes(b.anchor)),
            Text(human_bytes(b.stage)),
            Text(human_bytes(b.dense)),
            Text(human_ratio(b.ratio)),
        )
    lines.append(round_table)
    return Group(*lines)


class LiveView:
    """`with LiveView(total, url) as view: view.update(status, history)` about once a second."""

    def __init__(
        self, total: int, url: str | None, console: Console | None = None, stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.url = url
        self.console = console or Console()
        self.stream = stream or sys.stdout
        self._live: Live | None = None
        self._printed = 0
        self._started = time.monotonic()

    @property
    def interactive(self) -> bool:
        return self.console.is_terminal

    def __enter__(self) -> LiveView:
        if self.interactive:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, status: Mapping[str, Any] | None, history: Sequence[Mapping[str, Any]]) -> None:
        """Show the first `total` sealed rounds of `history` (the demo watches no further)."""
        history = list(history)[: self.total]
        if self._live is not None:
            elapsed = time.monotonic() - self._started
            self._live.update(render(status, history, self.total, self.url, elapsed, self.console.height))
            return
        for index in range(self._printed, len(history)):
            eta = eta_s(history[: index + 1], self.total)
            line = plain_line(history[index], index + 1, self.total, eta, history[:index])
            print(line, file=self.stream, flush=True)
        self._printed = max(self._printed, len(history))
