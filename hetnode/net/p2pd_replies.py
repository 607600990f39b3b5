"""A guard for hivemind 1.1.12's p2pd client: a reply that arrives for a call its caller already gave up.

`ControlClient` keeps each unary call's future in `_pending_calls` until the call's `finally` removes it.
When a caller is cancelled (a timeout), the call first sends p2pd a cancel request and only then removes
its future; a reply landing in that window is set on a cancelled future, the `InvalidStateError` ends the
task that reads every reply from p2pd, and from then on none of the node's calls is ever answered (seen as
a peer that stalls for good: "rejoin: none of 2 known peers answered"). A call whose future is done is no
longer pending, so its late reply is dropped like any unexpected one.
"""

from __future__ import annotations

from typing import Any


class PendingCalls(dict):
    """`_pending_calls` that holds a finished call's future but no longer counts it as pending."""

    def __contains__(self, call_id: object) -> bool:
        return dict.__contains__(self, call_id) and not self[call_id].done()


def guard_late_replies(p2p: Any) -> Any:
    """Install `PendingCalls` in `p2p`'s daemon client (once); returns `p2p`."""
    client = getattr(getattr(p2p, "_client", None), "control", None)
    pending = getattr(client, "_pending_calls", None)
    if isinstance(pending, dict) and not isinstance(pending, PendingCalls):
        client._pending_calls = PendingCalls(pending)
    return p2p
