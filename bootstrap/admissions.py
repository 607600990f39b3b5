"""The coordinator's side of admission to a closed run (`hetnode bootstrap --admit allowlist FILE|tokens`).

A volunteer asks for an admission over its own authenticated stream (the peer id is libp2p's, so nobody
can ask for another key). The coordinator grants one to a key on the allowlist, or in exchange for a join
token it signed (`hetnode bootstrap token --name alice`); a token is spent by the first key that presents
it. Whom it admitted and which tokens are spent survive restarts (`DATA_DIR/admissions.json`).
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

from hetnode.errors import HetnodeError, WireError
from hetnode.net.identity import Identity, check_peer_id
from hetnode.net.signing import sign_text, verify_text
from hetnode.service.datadir import DataDir
from hetnode.wire.admission import (
    Admission,
    AdmissionMode,
    JoinToken,
    admission_body,
    parse_token_body,
    token_body,
)

log = logging.getLogger(__name__)

ADMISSIONS_FILE = "admissions.json"
ADMISSION_DAYS = 30.0  # an admission outlives any run's restart; a volunteer renews it when it rejoins
MAX_ALLOWLIST = 100_000


def issue_token(identity: Identity, name: str, days: float) -> str:
    """A join token for `name`, valid `days`, signed by the coordinator's key."""
    if not 0 < len(name) <= 64:
        raise HetnodeError("--name must be 1..64 characters")
    token = JoinToken(name=name, expires=time.time() + days * 86400.0, nonce=secrets.token_hex(16))
    return sign_text(identity, "token", token_body(token))


def read_allowlist(path: Path) -> frozenset[str]:
    """Peer ids, one per line (`#` comments and blank lines skipped); each checked to be a peer id."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise HetnodeError(f"cannot read the allowlist {path}: {exc}") from None
    peers = [line.split("#", 1)[0].strip() for line in lines]
    peers = [check_peer_id(p, f"{path}") for p in peers if p]
    if len(peers) > MAX_ALLOWLIST:
        raise HetnodeError(f"{path}: more than {MAX_ALLOWLIST} peers")
    return frozenset(peers)


class Admissions:
    def __init__(
        self,
        mode: AdmissionMode,
        identity: Identity,
        run: str,
        data_dir: DataDir,
        allowlist: frozenset[str] = frozenset(),
    ) -> None:
        self.mode = mode
        self.identity = identity
        self.run = run
        self.data_dir = data_dir
        self.allowlist = allowlist
        state = data_dir.read_json(ADMISSIONS_FILE)
        self.admitted: dict[str, str] = dict(state.get("admitted", {}))  # peer -> name
        self.spent: dict[str, str] = dict(state.get("spent", {}))  # token nonce -> the peer it admitted

    def grant(self, peer: str, token: str) -> str:
        """An admission for `peer` (asking over its own stream); WireError with the reason otherwise."""
        if self.mode == "open":
            raise WireError("admit", "this run is open: no admission is needed")
        name = self.admitted.get(peer)
        if name is None and self.mode == "allowlist":
            if peer not in self.allowlist:
                raise WireError("admit", "this peer id is not on the run's allowlist")
            name = peer[-8:]
        if name is None:  # tokens
            if not token:
                raise WireError("admit", "this run admits by join token: pass --token")
            joined = parse_token_body(verify_text("token", token, self.identity.private_key.get_public_key()))
            if joined.expires < time.time():
                raise WireError("admit", "the join token has expired; ask the operator for a new one")
            if self.spent.get(joined.nonce, peer) != peer:
                raise WireError("admit", "the join token was already used by another key")
            name = joined.name
            self.spent[joined.nonce] = peer
        if peer not in self.admitted:
            self.admitted[peer] = name
            self.data_dir.write_json(ADMISSIONS_FILE, {"admitted": self.admitted, "spent": self.spent})
            log.info("admitted %s as %s", peer, name)
        admission = Admission(self.run, peer, name, time.time() + ADMISSION_DAYS * 86400.0)
        return sign_text(self.identity, "admission", admission_body(admission))
