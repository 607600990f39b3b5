"""Peer ids in text: the one a multiaddr names. Light on purpose (base58 only, no hivemind), so that the
CLI can check a `--peer` without the seconds hivemind's import costs."""

from __future__ import annotations

import base58

from hetnode.errors import HetnodeError


def peer_id_from_maddr(maddr: str) -> str:
    """The peer id at the end of a `/.../p2p/<id>` multiaddr, checked to be valid base58."""
    head, sep, tail = maddr.rstrip("/").rpartition("/p2p/")
    if not sep or not head or "/" in tail:
        raise HetnodeError(f"{maddr!r} has no /p2p/<peer id> part: copy the whole address of a READY line")
    try:
        base58.b58decode(tail)
    except ValueError:
        raise HetnodeError(f"{maddr!r}: {tail!r} is not a peer id") from None
    return tail
