"""How every holder of θ opens a sync payload: the author's signature is checked before anything else, so
anchors, chain stages and the coordinator take the same bytes or refuse the same bytes."""

from __future__ import annotations

from hetnode.config import Config
from hetnode.net.signing import open_payload
from hetnode.replica.global_model import PayloadOpener


def payload_opener(run: str, config: Config) -> PayloadOpener:
    """How daemons of `run` open sync payloads: the author's signature is checked before anything else."""
    max_bytes = int(config.network.max_frame_mb * 2**20)
    return lambda data: open_payload(run, data, max_bytes)
