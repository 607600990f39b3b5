"""The bandwidth probe: upload, download and round-trip time against another daemon's control handler.

Throughput is timed where the bytes arrive, from the first chunk to the last: the sender's socket
buffers would make a sender-side clock read fast. Each direction stops at its byte count or time
bound, whichever comes first, so a probe over a slow link is still short.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass

from hetnode.errors import WireError
from hetnode.net.streams import OpenStream, PeerRequestError, read_frame, write_frame
from hetnode.wire.control import encode_reply, encode_request

CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024
PINGS = 3


@dataclass(frozen=True)
class LinkMeasurement:
    up_mbps: float
    down_mbps: float
    rtt_ms: float


@dataclass(frozen=True)
class Arrivals:
    """Bytes received and the time between the first and the last chunk."""

    bytes_after_first: int
    seconds: float
    total: int = 0  # every byte received, the first chunk included

    @property
    def mbps(self) -> float:
        return self.bytes_after_first * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0


async def receive_chunks(stream_reader: asyncio.StreamReader, max_total: int, deadline_s: float) -> Arrivals:
    """Read framed chunks until the empty end frame; time first to last chunk."""
    first_at = last_at = None
    total = after_first = 0
    stop_at = time.monotonic() + deadline_s
    while True:
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        chunk = await read_frame(stream_reader, MAX_CHUNK_BYTES, remaining)
        if not chunk:
            break
        now = time.monotonic()
        total += len(chunk)
        if total > max_total:
            raise WireError("bytes", f"probe sent more than the {max_total} bytes it announced")
        if first_at is None:
            first_at = now
        else:
            after_first += len(chunk)
        last_at = now
    seconds = (last_at - first_at) if first_at is not None and last_at is not None else 0.0
    return Arrivals(after_first, seconds, total)


async def send_chunks(writer: asyncio.StreamWriter, n_bytes: int, seconds: float) -> int:
    """Send up to `n_bytes` in framed chunks for at most `seconds`, then the empty end frame."""
    payload = os.urandom(CHUNK_BYTES)  # incompressible, in case a link compresses
    sent = 0
    stop_at = time.monotonic() + seconds
    while sent < n_bytes and time.monotonic() < stop_at:
        chunk = payload[: min(CHUNK_BYTES, n_bytes - sent)]
        await write_frame(writer, chunk, timeout=max(0.1, stop_at - time.monotonic()) + 5.0)
        sent += len(chunk)
    await write_frame(writer, b"", timeout=10.0)
    return sent


async def serve_probe_up(stream: OpenStream, n_bytes: int, probe_s: float) -> int:
    """Server side of an upload probe: receive, then report what arrived and how long it took.
    Returns the bytes received (for the traffic counters)."""
    await stream.send(encode_reply("probe_ready", bytes=n_bytes))
    arrivals = await receive_chunks(stream.reader, n_bytes, probe_s + 10.0)
    await stream.send(
        encode_reply("probe_result", bytes=arrivals.bytes_after_first, seconds=arrivals.seconds)
    )
    return arrivals.total


async def serve_probe_down(stream: OpenStream, n_bytes: int, seconds: float, probe_s: float) -> int:
    """Server side of a download probe; returns the bytes sent."""
    await stream.send(encode_reply("probe_ready", bytes=n_bytes))
    return await send_chunks(stream.writer, n_bytes, min(seconds, probe_s))


async def measure_upload(stream: OpenStream, n_bytes: int, seconds: float) -> tuple[float, int]:
    """Upload rate in Mbit/s as the far end saw it, and the bytes we sent."""
    await stream.send(encode_request("probe_up", bytes=n_bytes))
    await stream.receive()
    sent = await send_chunks(stream.writer, n_bytes, seconds)
    result = await stream.receive(timeout=seconds + 15.0)
    if result.type != "probe_result":
        raise PeerRequestError(stream.peer, f"expected probe_result, got {result.type}")
    return Arrivals(result["bytes"], result["seconds"]).mbps, sent


async def measure_download(stream: OpenStream, n_bytes: int, seconds: float) -> tuple[float, int]:
    """Download rate in Mbit/s, and the bytes we received."""
    await stream.send(encode_request("probe_down", bytes=n_bytes, seconds=float(seconds)))
    await stream.receive()
    try:
        arrivals = await receive_chunks(stream.reader, n_bytes, seconds + 15.0)
    except (TimeoutError, asyncio.IncompleteReadError, WireError) as exc:
        raise PeerRequestError(stream.peer, f"download probe failed: {exc!r}") from None
    return arrivals.mbps, arrivals.total


def combine(measurements: list[LinkMeasurement]) -> LinkMeasurement:
    """Our link is at least as fast as the best target showed: a slow target limits only itself."""
    if not measurements:
        raise ValueError("no measurements")
    return LinkMeasurement(
        up_mbps=max(m.up_mbps for m in measurements),
        down_mbps=max(m.down_mbps for m in measurements),
        rtt_ms=min((m.rtt_ms for m in measurements if math.isfinite(m.rtt_ms)), default=math.inf),
    )
