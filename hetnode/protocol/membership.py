"""Who belongs to the run, as this daemon sees it (docs/security.md, "Who is trusted with what";
docs/security.md, "Exhaust a daemon"), from each read of the peer records (`PeerDirectory`; a request from a
peer we do not know yet brings the next read forward).

- **Live peers**: peers with a live, valid record. Only they get bandwidth probes: a probe reply is
  megabytes for a request of a few dozen bytes, and served to anyone it amplifies traffic ×80,000. A
  volunteer publishes its record before it measures, so members are known by the time they probe.
- **Members** of a closed run (`bootstrap --admit allowlist FILE|tokens`): peers whose record carries an
  admission the coordinator signed for this run and this peer id, not expired. Every other peer's records,
  announcements, seals and streams are ignored (the node filters them), except the few requests a
  volunteer needs to get admitted (ping, info, admit). In an open run everyone is a member.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from hetnode.config import Config
from hetnode.errors import HetnodeError, WireError
from hetnode.net.node import StoredValue, SwarmNode
from hetnode.net.records import check_peer_record
from hetnode.net.signing import signer_key, verify_text
from hetnode.wire.admission import parse_admission_body
from hetnode.wire.manifest import Manifest

log = logging.getLogger(__name__)


def coordinator_key(manifest: Manifest, coordinator: str):  # -> RSAPublicKey (hivemind's, in net/)
    """The coordinator's public key from the manifest, checked to be the key of the coordinator we follow."""
    try:
        return signer_key(manifest.coordinator_key, coordinator)
    except HetnodeError as exc:
        raise HetnodeError(f"the manifest's coordinator key: {exc}") from None


class Membership:
    def __init__(self, node: SwarmNode, config: Config, manifest: Manifest, coordinator: str) -> None:
        self.node = node
        self.config = config
        self.run = manifest.run
        self.coordinator = coordinator
        self.closed = manifest.admission != "open"
        self.key = coordinator_key(manifest, coordinator) if self.closed else None
        self.live: frozenset[str] = frozenset()
        self.members: frozenset[str] = frozenset({coordinator})
        self._verified: dict[str, tuple[str, float]] = {}  # admission text -> (peer, expiry), checked once
        # called when a peer we do not know asks something: our last read may predate its record
        self.on_stranger: Callable[[], None] = lambda: None

    def allows_probe(self, peer: str) -> bool:
        if peer in self.live:
            return True
        self.on_stranger()
        return False

    def is_member(self, peer: str) -> bool:
        if not self.closed or peer == self.coordinator or peer in self.members:
            return True
        self.on_stranger()
        return False

    def admitted(self, peer: str, record: dict[str, Any]) -> bool:
        """In a closed run: the record carries a valid, unexpired admission of this run for this peer."""
        if not self.closed or peer == self.coordinator:
            return True
        text = record.get("admission")
        if not isinstance(text, str):
            return False
        known = self._verified.get(text)
        if known is None:
            try:
                admission = parse_admission_body(verify_text("admission", text, self.key))
            except WireError as exc:
                log.debug("peer %s: admission refused: %s", peer, exc)
                known = ("", 0.0)
            else:
                known = (admission.peer, admission.expires) if admission.run == self.run else ("", 0.0)
            if len(self._verified) > 10_000:
                self._verified.clear()
            self._verified[text] = known
        return known[0] == peer and known[1] > time.time()

    async def refresh(self) -> None:
        self.absorb(await self.node.read_field("peers", members_only=False))

    def absorb(self, entries: Mapping[str, StoredValue]) -> None:
        """The live peers and the members, from one read of every peer record (members or not)."""
        live, members = set(), {self.coordinator}
        for peer, entry in entries.items():
            try:
                record = check_peer_record(entry.value)
            except Exception:
                continue
            if self.admitted(peer, record):
                members.add(peer)
                if record["role"] != "offline":
                    live.add(peer)
        self.live, self.members = frozenset(live), frozenset(members)

    def apply_policies(self) -> None:
        """Make the node serve probes to live peers only and, in a closed run, listen to members only."""
        self.node.set_probe_policy(self.allows_probe)
        if self.closed:
            self.node.set_member_policy(self.is_member)
