"""Framed request/response over hivemind P2P streams, with the wire discipline every handler shares:
size limits before reading, schema checks, a per-peer rate limit and stream budget checked before any read,
a timeout on every await, and a clear error reply plus a rate-limited log line for anything bad. A handler
failure never escapes into the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from hetnode.errors import HetnodeError, WireError
from hetnode.net.budgets import Budgets, Refused
from hetnode.net.log_limits import RefusalLog
from hetnode.wire.control import (
    HEADER_BYTES,
    MAX_CONTROL_BYTES,
    ControlMessage,
    decode_reply,
    encode_reply,
    frame_header,
    parse_frame_header,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
# a stream's first frame is the request, sent as soon as the stream opens: a stream that sends nothing
# gives its slot back soon (idle streams held open are how a crowd would fill a node's slots)
FIRST_FRAME_TIMEOUT_S = 3.0


class PeerRequestError(HetnodeError):
    """A remote daemon answered with an error, or did not answer in time."""

    def __init__(self, peer: str, message: str) -> None:
        self.peer = peer
        super().__init__(f"peer {peer[-8:]}: {message}")


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
    header = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), timeout)
    length = parse_frame_header(header, max_bytes)
    return await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""


async def write_frame(writer: asyncio.StreamWriter, data: bytes, timeout: float) -> None:
    writer.write(frame_header(len(data)) + data)
    await asyncio.wait_for(writer.drain(), timeout)


@dataclass
class RateLimiter:
    """Token bucket per remote peer: `per_minute` requests, refilled continuously."""

    per_minute: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def allow(self, peer: str) -> bool:
        now = self.clock()
        tokens, last = self._buckets.get(peer, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - last) * self.per_minute / 60.0)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > 10_000:  # forget the oldest peers rather than grow without bound
            for key in sorted(self._buckets, key=lambda k: self._buckets[k][1])[:5_000]:
                del self._buckets[key]
        return allowed


Reply = Callable[[bytes], Awaitable[None]]
RequestHandler = Callable[[str, bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REFUSAL_LINGER_S = 2.0  # how long a refused stream waits for its peer to close after the error reply
MAX_LINGERING = 64  # refused streams waiting at once; beyond, they are closed at once


def guarded_handler(
    name: str,
    limiter: RateLimiter,
    handle: RequestHandler,
    budgets: Budgets | None = None,
    refusals: RefusalLog | None = None,
    preferred: Callable[[str], bool] = lambda peer: False,
) -> Callable:
    """Wrap `handle(peer, first_frame, reader, writer)` with the shared discipline for handler `name`.

    Before reading anything the peer must pass the rate limit and hold one of `budgets.streams`' slots
    (for the peer and in total; `preferred` peers may also take the slots kept for them) until the stream
    ends, and send its request within FIRST_FRAME_TIMEOUT_S. `handle` may raise `Refused` (e.g. a byte budget)
    or `WireError`: the peer gets an error reply with the code, and the log a rate-limited warning."""
    refusals = refusals if refusals is not None else RefusalLog(log)
    lingering = 0

    async def refuse(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: str, text: str
    ) -> None:
        """Reply with the reason, then wait (briefly, without reading a request) for the peer to close.

        Closing a stream while the peer's request is still unread resets it, and the peer would see a
        broken pipe instead of the reason. The wait discards input unparsed and is bounded in time,
        bytes and in how many refused streams wait at once, so a refusal stays cheap."""
        nonlocal lingering
        await _reply_error(writer, code, text)
        if lingering >= MAX_LINGERING:
            return
        lingering += 1
        try:
            await _discard_until_eof(reader, MAX_CONTROL_BYTES, REFUSAL_LINGER_S)
        finally:
            lingering -= 1

    def count(reason: str) -> None:
        if budgets is not None:
            budgets.refusals[reason] += 1

    async def serve(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        slot = None
        try:
            if not limiter.allow(peer):
                count("rate_limited")
                refusals.warning(peer, "rate_limited", "%s: rate limit exceeded by peer %s", name, peer)
                await refuse(reader, writer, "rate_limited", "too many requests, slow down")
                return
            if budgets is not None:
                slot = budgets.streams.reserve(peer, preferred(peer))
                if slot is None:
                    count("busy")
                    scope = budgets.streams.refused_by(peer)
                    refusals.warning(
                        peer, "busy", "%s: too many open streams (%s) from peer %s", name, scope, peer
                    )
                    await refuse(reader, writer, "busy", f"too many open streams ({scope} limit)")
                    return
            first = await read_frame(reader, MAX_CONTROL_BYTES, FIRST_FRAME_TIMEOUT_S)
            await handle(peer, first, reader, writer)
        except Refused as exc:
            refusals.warning(peer, exc.code, "%s: refused peer %s: %s", name, peer, exc.reason)
            await refuse(reader, writer, exc.code, exc.reason)
        except WireError as exc:
            count("bad_request")
            refusals.warning(peer, "bad_request", "%s: bad request from peer %s: %s", name, peer, exc)
            await refuse(reader, writer, "bad_request", str(exc))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, PeerRequestError) as exc:
            count("incomplete")
            refusals.warning(
                peer, "incomplete", "%s: peer %s: stream ended early (%s)", name, peer, type(exc).__name__
            )
            await _reply_error(writer, "incomplete", "request incomplete or too slow")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: handler failed on a request from peer %s", name, peer)
            await _reply_error(writer, "internal", "internal error")
        finally:
            if slot is not None:
                slot.release()
            writer.close()

    return serve


async def _reply_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    with contextlib.suppress(Exception):  # the peer may be gone already; the caller logged the cause
        await write_frame(writer, encode_reply("error", code=code, message=message[:500]), timeout=2.0)


async def _discard_until_eof(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> None:
    async def discard() -> None:
        left = max_bytes
        while left > 0:
            chunk = await reader.read(min(left, 65536))
            if not chunk:
                return
            left -= len(chunk)

    with contextlib.suppress(Exception):  # a timeout, a reset: the stream is closed next in any case
        await asyncio.wait_for(discard(), timeout)


@dataclass
class OpenStream:
    peer: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, data: bytes, timeout: float = REQUEST_TIMEOUT_S) -> None:
        try:
            await write_frame(self.writer, data, timeout)
        except (TimeoutError, ConnectionError) as exc:
            raise PeerRequestError(self.peer, f"cannot send ({type(exc).__name__})") from None

    async def receive(self, timeout: float = REQUEST_TIMEOUT_S) -> ControlMessage:
        try:
            reply = decode_reply(await read_frame(self.reader, MAX_CONTROL_BYTES, timeout))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            raise PeerRequestError(self.peer, f"no reply ({type(exc).__name__})") from None
        except WireError as exc:
            raise PeerRequestError(self.peer, f"malformed reply: {exc}") from None
        if reply.type == "error":
            raise PeerRequestError(self.peer, f"{reply['code']}: {reply['message']}")
        return reply

    def close(self) -> None:
        self.writer.close()


async def open_stream(p2p: P2P, peer: str, handler: str, timeout: float = REQUEST_TIMEOUT_S) -> OpenStream:
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), timeout
        )
    except TimeoutError:
        raise PeerRequestError(peer, f"no stream to {handler} within {timeout:.0f} s") from None
    except Exception as exc:
        raise PeerRequestError(peer, f"cannot open {handler}: {exc}") from None
    return OpenStream(peer, reader, writer)


async def request(
    p2p: P2P, peer: str, handler: str, message: bytes, timeout: float = REQUEST_TIMEOUT_S
) -> ControlMessage:
    """One request, one reply."""
    stream = await open_stream(p2p, peer, handler, timeout)
    try:
        await stream.send(message, timeout)
        return await stream.receive(timeout)
    finally:
        stream.close()
