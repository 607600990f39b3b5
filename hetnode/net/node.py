"""A daemon's presence in the swarm: its p2pd, its DHT node, its control handler and its records.

Start order: P2P (so we can ask the coordinator which run it serves), then the DHT node with the run's
validators. Shutdown runs in reverse and is idempotent. Every DHT call has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P

from hetnode.errors import HetnodeError, WireError
from hetnode.net.identity import Identity, owner_subkey, peer_id_of_subkey, write_identity_file
from hetnode.net.probe import (
    LinkMeasurement,
    measure_download,
    measure_upload,
    serve_probe_down,
    serve_probe_up,
)
from hetnode.net.records import record_key, run_schema_validator
from hetnode.net.streams import (
    REQUEST_TIMEOUT_S,
    OpenStream,
    PeerRequestError,
    RateLimiter,
    guarded_handler,
    open_stream,
    read_frame,
    request,
    write_frame,
)
from hetnode.wire.control import (
    MAX_CONTROL_BYTES,
    ControlMessage,
    decode_request,
    encode_reply,
    encode_request,
)

log = logging.getLogger(__name__)

CONTROL_HANDLER = "hetnode.control.v1"
STAGE_HANDLER = "hetnode.stage.v1"  # one long-lived duplex stream per chain boundary
DHT_TIMEOUT_S = 10.0
logging.getLogger("hivemind").setLevel(logging.WARNING)


class PeersUnreachable(HetnodeError):
    """No initial peer answered; worth retrying (it may not have started yet)."""


@dataclass(frozen=True)
class NodeLimits:
    probe_bytes: int
    probe_s: float
    requests_per_min: int


DEFAULT_LIMITS = NodeLimits(
    probe_bytes=4 * 2**20, probe_s=5.0, requests_per_min=120
)  # until the manifest says


@dataclass(frozen=True)
class StoredValue:
    peer_id: str
    value: Any
    expiration: float


InfoProvider = Callable[[], dict[str, Any]]  # -> {"run", "protocol", "coordinator", "role", "name"}
PayloadProvider = Callable[[int, str, str], bytes | None]
StateProvider = Callable[[int, str], bytes | None]
# (peer, reader, writer): runs for the stream's life; the stream closes when it returns
NudgeHandler = Callable[[str, str, int], None]  # (peer, topic, round): look at the DHT now
NUDGE_TIMEOUT_S = 3.0
PAYLOAD_TIMEOUT_S = 60.0  # one payload frame: megabytes over a slow link
MAX_PAYLOADS_PER_STREAM = 256  # pipelined payload requests one stream may carry
StageAcceptor = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class SwarmNode:
    def __init__(self, identity: Identity, p2p: P2P, limits: NodeLimits) -> None:
        self.identity = identity
        self.p2p = p2p
        self.limits = limits
        self.dht: DHTNode | None = None
        self.run: str | None = None
        self._info: InfoProvider = lambda: {
            "run": self.run or "",
            "protocol": 0,
            "coordinator": "",
            "role": "idle",
            "name": "",
        }
        self._payloads: PayloadProvider = lambda round_, shard, replica: None
        self._state: StateProvider = lambda round_, shard: None
        self._stage: StageAcceptor | None = None
        self._nudged: NudgeHandler = lambda peer, topic, round_: None
        self._background: set[asyncio.Task] = set()  # nudges in flight, cancelled at shutdown
        self._stage_limiter = RateLimiter(limits.requests_per_min)
        self._closed = False
        # bytes by (direction, channel) for the metrics: "sync" payloads, "state" transfer, "probe"
        # (every key exists from the start: the metrics thread copies it while the loop adds to it)
        self.traffic: Counter[tuple[str, str]] = Counter(
            {(d, c): 0 for d in ("sent", "received") for c in ("sync", "state", "probe")}
        )

    @classmethod
    async def start(
        cls,
        identity: Identity,
        limits: NodeLimits,
        host_maddrs: Sequence[str],
        initial_peers: Sequence[str] = (),
        announce_maddrs: Sequence[str] = (),
        client_mode: bool = False,
    ) -> SwarmNode:
        with tempfile.TemporaryDirectory(prefix="hetnode-id-") as scratch:
            key_path = identity.path
            if key_path is None:  # p2pd must use the same key that signs our records
                key_path = Path(scratch) / "identity.key"
                write_identity_file(identity, key_path)
            p2p = await cls._start_p2p(key_path, host_maddrs, initial_peers, announce_maddrs, client_mode)
        node = cls(identity, p2p, limits)
        if p2p.peer_id.to_base58() != identity.peer_id:
            await p2p.shutdown()
            raise HetnodeError(f"p2pd runs as {p2p.peer_id}, not as our identity {identity.peer_id}")
        if not client_mode:
            limiter = RateLimiter(limits.requests_per_min)
            await p2p.add_binary_stream_handler(
                CONTROL_HANDLER, guarded_handler(CONTROL_HANDLER, limiter, node._control)
            )
            await p2p.add_binary_stream_handler(STAGE_HANDLER, node._accept_stage)
        return node

    @staticmethod
    async def _start_p2p(
        key_path: Path,
        host_maddrs: Sequence[str],
        initial_peers: Sequence[str],
        announce_maddrs: Sequence[str],
        client_mode: bool,
    ) -> P2P:
        try:
            return await P2P.create(
                initial_peers=list(initial_peers) or None,
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) or None,
                identity_path=str(key_path),
                dht_mode="client" if client_mode else "server",
                check_if_identity_free=False,  # a restart with the same key must not be refused
            )
        except Exception as exc:
            if initial_peers and "bootstrap peers" in str(exc):  # p2pd's words for "none answered"
                raise PeersUnreachable(f"none of {list(initial_peers)} answered") from None
            raise HetnodeError(f"cannot start the P2P daemon on {list(host_maddrs)}: {exc}") from exc

    def set_info(self, provider: InfoProvider) -> None:
        self._info = provider

    def set_payloads(self, provider: PayloadProvider) -> None:
        """Serve sync payloads: `provider(round, shard, replica)` returns the encoded message or None."""
        self._payloads = provider

    def set_state(self, provider: StateProvider) -> None:
        """Serve global parameters for catch-up: `provider(round, shard)` -> a dense payload or None."""
        self._state = provider

    def set_nudge_handler(self, handler: NudgeHandler) -> None:
        self._nudged = handler

    def nudge(self, peers: Sequence[str], topic: str, round_: int) -> None:
        """Tell `peers` to look at the DHT now (fire and forget: the DHT stays the record, polling the
        fallback, so a peer that is gone costs nothing but a failed stream in the background)."""
        message = encode_request("nudge", round=round_, about=topic)

        async def one(peer: str) -> None:
            try:
                await request(self.p2p, peer, CONTROL_HANDLER, message, NUDGE_TIMEOUT_S)
            except (PeerRequestError, TimeoutError, WireError) as exc:
                log.debug("nudge %s to %s failed: %s", topic, peer, exc)

        for peer in peers:
            if peer != self.identity.peer_id and not self._closed:
                task = asyncio.create_task(one(peer), name=f"nudge-{topic}")
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def set_stage_acceptor(self, acceptor: StageAcceptor | None) -> None:
        """Accept chain streams with `acceptor` (it checks who calls); None refuses them all."""
        self._stage = acceptor

    async def open_stage_stream(self, peer: str, timeout: float = 10.0) -> OpenStream:
        """A duplex stream to the next stage of our chain."""
        return await open_stream(self.p2p, peer, STAGE_HANDLER, timeout)

    async def _accept_stage(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = info.peer_id.to_base58()
        try:
            if self._stage is None or not self._stage_limiter.allow(peer):
                log.info("refusing a chain stream from peer %s (not our upstream stage now)", peer)
                return
            await self._stage(peer, reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("chain stream from peer %s failed", peer)
        finally:
            writer.close()

    async def fetch_payloads(
        self, peer: str, round_: int, wanted: Sequence[tuple[str, str]], max_bytes: int
    ) -> list[bytes]:
        """The sync payloads `wanted` ((shard, replica) pairs) of `round_` held by `peer`, in that order.

        One stream for all of them (up to MAX_PAYLOADS_PER_STREAM), requests pipelined: a stream set-up per
        payload would cost more than a small payload's transfer, and count against the peer's rate limit.
        Any payload the peer lacks fails the whole fetch."""
        payloads: list[bytes] = []
        for start in range(0, len(wanted), MAX_PAYLOADS_PER_STREAM):
            batch = wanted[start : start + MAX_PAYLOADS_PER_STREAM]
            stream = await open_stream(self.p2p, peer, CONTROL_HANDLER)

            async def send_requests(stream: OpenStream = stream, batch: Sequence = batch) -> None:
                for shard, replica in batch:
                    await stream.send(encode_request("payload", round=round_, shard=shard, replica=replica))

            # requests go out while replies come in: written first, many requests could fill the
            # buffers while the peer blocks writing a payload nobody reads yet
            sender = asyncio.create_task(send_requests())
            try:
                payloads += [await self._receive_payload(stream, max_bytes) for _ in batch]
                await sender
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)  # its error, if any, is the reply's
                stream.close()
        self.traffic["received", "sync"] += sum(len(data) for data in payloads)
        return payloads

    async def fetch_state(self, peer: str, round_: int, shard: str, max_bytes: int) -> bytes:
        data = await self._fetch(peer, encode_request("state", round=round_, shard=shard), max_bytes)
        self.traffic["received", "state"] += len(data)
        return data

    async def _fetch(self, peer: str, message: bytes, max_bytes: int) -> bytes:
        stream = await open_stream(self.p2p, peer, CONTROL_HANDLER)
        try:
            await stream.send(message)
            return await self._receive_payload(stream, max_bytes)
        finally:
            stream.close()

    @staticmethod
    async def _receive_payload(stream: OpenStream, max_bytes: int) -> bytes:
        """A `payload_ready` reply and the frame it announces."""
        ready = await stream.receive()
        if ready.type != "payload_ready" or ready["bytes"] > max_bytes:
            raise PeerRequestError(stream.peer, f"unexpected payload reply {ready.type} of {ready.fields}")
        try:
            return await read_frame(stream.reader, max_bytes, timeout=PAYLOAD_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, WireError) as exc:
            raise PeerRequestError(stream.peer, f"payload transfer failed: {exc!r}") from None

    async def join_dht(
        self,
        run: str,
        initial_peers: Sequence[str],
        client_mode: bool = False,
        require_bootstrap: bool = True,
    ) -> None:
        """Start the DHT node for `run`: records are checked against the run's schema and signatures.

        `require_bootstrap=False`: initial peers are a best guess (remembered neighbours), some may be gone.
        """
        self.run = run
        validators = CompositeValidator(
            [RSASignatureValidator(self.identity.private_key), run_schema_validator(run)]
        )
        try:
            self.dht = await asyncio.wait_for(
                DHTNode.create(
                    p2p=self.p2p,
                    initial_peers=list(initial_peers) or None,
                    record_validator=validators,
                    client_mode=client_mode,
                    ensure_bootstrap_success=bool(initial_peers) and require_bootstrap,
                    cache_locally=False,  # we poll for fresh records; never answer from a stale cache
                    cache_nearest=0,
                ),
                DHT_TIMEOUT_S * 3,
            )
        except TimeoutError:
            raise HetnodeError(f"cannot join the DHT through {list(initial_peers)}: timed out") from None

    async def visible_maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def neighbour_maddrs(self, limit: int = 64) -> list[str]:
        """Full multiaddrs of peers p2pd is connected to: what a restarted node bootstraps from."""
        found = []
        for info in await self.p2p.list_peers():
            for addr in info.addrs[:2]:
                found.append(f"{addr}/p2p/{info.peer_id.to_base58()}")
        return found[:limit]

    # --- records -------------------------------------------------------------------------------------

    async def store_own(self, field: str, value: Any, ttl_s: float) -> bool:
        """Write our own (signed) entry of `field`; True when at least one DHT node accepted it."""
        dht = self._require_dht()
        try:
            return bool(
                await asyncio.wait_for(
                    dht.store(
                        record_key(self.run, field),
                        value,
                        time.time() + ttl_s,
                        subkey=owner_subkey(self.identity),
                    ),
                    DHT_TIMEOUT_S,
                )
            )
        except TimeoutError:
            log.warning("storing %s timed out", field)
            return False

    async def read_field(self, field: str) -> dict[str, StoredValue]:
        """All valid, unexpired entries of `field`, by the peer id that signed them."""
        dht = self._require_dht()
        try:
            found = await asyncio.wait_for(dht.get(record_key(self.run, field), latest=True), DHT_TIMEOUT_S)
        except TimeoutError:
            log.warning("reading %s timed out", field)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        now = time.time()
        entries = {}
        for subkey, item in found.value.items():
            peer_id = peer_id_of_subkey(subkey)
            if peer_id is None or item.expiration_time < now:
                continue
            entries[peer_id] = StoredValue(peer_id, item.value, item.expiration_time)
        return entries

    def _require_dht(self) -> DHTNode:
        if self.dht is None or self.run is None:
            raise HetnodeError("the DHT is not joined yet")
        return self.dht

    # --- control handler: ping, info, bandwidth probe -------------------------------------------------

    async def _control(
        self, peer: str, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        message = decode_request(first, self.limits.probe_bytes)
        stream = OpenStream(peer, reader, writer)
        if message.type == "ping":
            await stream.send(encode_reply("pong", time=time.time()))
        elif message.type == "info":
            await stream.send(encode_reply("info", **self._info()))
        elif message.type == "probe_up":
            self.traffic["received", "probe"] += await serve_probe_up(
                stream, message["bytes"], self.limits.probe_s
            )
        elif message.type == "probe_down":
            self.traffic["sent", "probe"] += await serve_probe_down(
                stream, message["bytes"], message["seconds"], self.limits.probe_s
            )
        elif message.type == "nudge":
            self._nudged(peer, message["about"], message["round"])
            await stream.send(encode_reply("ack"))
        elif message.type == "payload":
            await self._serve_payloads(message, stream)
        elif message.type == "state":
            data = self._state(message["round"], message["shard"])
            if data is None:
                raise WireError("round", f"no state for round {message['round']} shard {message['shard']!r}")
            await stream.send(encode_reply("payload_ready", bytes=len(data)))
            await write_frame(writer, data, timeout=PAYLOAD_TIMEOUT_S)
            self.traffic["sent", "state"] += len(data)

    async def _serve_payloads(self, message: ControlMessage, stream: OpenStream) -> None:
        """Serve `message` and every further payload request on the stream, until the peer closes it."""
        for served in range(1, MAX_PAYLOADS_PER_STREAM + 1):
            data = self._payloads(message["round"], message["shard"], message["replica"])
            if data is None:
                what = f"payload for round {message['round']} shard {message['shard']!r}"
                raise WireError("round", f"no {what} of {message['replica'][-8:]} here")
            await stream.send(encode_reply("payload_ready", bytes=len(data)))
            await write_frame(stream.writer, data, timeout=PAYLOAD_TIMEOUT_S)
            self.traffic["sent", "sync"] += len(data)
            if served == MAX_PAYLOADS_PER_STREAM:
                return
            try:
                following = await read_frame(stream.reader, MAX_CONTROL_BYTES, REQUEST_TIMEOUT_S)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return  # the peer closed the stream: it has all it asked for
                raise
            message = decode_request(following, self.limits.probe_bytes)
            if message.type != "payload":
                raise WireError(
                    "type", f"only payload requests may follow a payload request, not {message.type}"
                )

    async def ping(self, peer: str) -> float:
        """Round-trip time in ms of one control request (stream set-up included)."""
        started = time.monotonic()
        await request(self.p2p, peer, CONTROL_HANDLER, encode_request("ping"))
        return (time.monotonic() - started) * 1000

    async def info(self, peer: str, timeout: float = 10.0) -> ControlMessage:
        return await request(self.p2p, peer, CONTROL_HANDLER, encode_request("info"), timeout)

    async def measure_link(self, peer: str) -> LinkMeasurement:
        rtt = min([await self.ping(peer) for _ in range(3)])
        stream = await open_stream(self.p2p, peer, CONTROL_HANDLER)
        try:
            up, sent = await measure_upload(stream, self.limits.probe_bytes, self.limits.probe_s)
        finally:
            stream.close()
        self.traffic["sent", "probe"] += sent
        stream = await open_stream(self.p2p, peer, CONTROL_HANDLER)
        try:
            down, received = await measure_download(stream, self.limits.probe_bytes, self.limits.probe_s)
        finally:
            stream.close()
        self.traffic["received", "probe"] += received
        return LinkMeasurement(up_mbps=up, down_mbps=down, rtt_ms=rtt)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        if self.dht is not None:
            try:
                await asyncio.wait_for(self.dht.shutdown(), 5.0)
            except Exception as exc:
                log.debug("DHT shutdown: %r", exc)
        try:
            await asyncio.wait_for(self.p2p.shutdown(), 5.0)
        except Exception as exc:
            log.debug("P2P shutdown: %r", exc)
