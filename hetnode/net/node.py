"""A daemon's presence in the swarm: its p2pd, its DHT node, its control handler and its records.

Start order: P2P (so we can ask the coordinator which run it serves), then the DHT node with the run's
validators. Shutdown runs in reverse and is idempotent. Every DHT call has a timeout.

Every entry point is budgeted (docs/security.md, "Exhaust a daemon", hetnode/net/budgets.py): a control stream
holds a stream slot for its peer while it runs, probes are served only to peers the probe policy allows and
within the probe bytes budget, payload and state replies are charged to their byte budgets before they are
sent, and chain streams have their own small cap. Refusals are counted in `budgets.refusals` and logged
rate-limited.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hetnode.errors import HetnodeError, WireError
from hetnode.net.budgets import Budgets, NodeBudgets
from hetnode.net.control_server import (
    MAX_PAYLOADS_PER_STREAM,
    PAYLOAD_TIMEOUT_S,
    ControlServer,
    FeedbackSource,
    InclusionProvider,
    InfoProvider,
    NoFeedback,
    NudgeHandler,
    PayloadProvider,
    ProbePolicy,
)
from hetnode.net.dialback import dial_back, libp2p_listens, reachable_through, tcp_host_port
from hetnode.net.identity import Identity, owner_subkey, peer_id_of_subkey, write_identity_file
from hetnode.net.listen_ports import refuse_taken_ports
from hetnode.net.log_limits import RefusalLog
from hetnode.net.p2pd_replies import guard_late_replies
from hetnode.net.probe import LinkMeasurement, measure_download, measure_upload
from hetnode.net.records import (
    MAX_RECORD_BYTES,
    RecordCapsValidator,
    cap_problem,
    check_direct_entry,
    record_key,
    run_schema_validator,
)
from hetnode.net.state_cache import StateCache, StateProvider
from hetnode.net.streams import (
    OpenStream,
    PeerRequestError,
    RateLimiter,
    guarded_handler,
    open_stream,
    read_frame,
    request,
)
from hetnode.wire.control import DIRECT_FIELDS, ControlMessage, encode_request

log = logging.getLogger(__name__)

CONTROL_HANDLER = "hetnode.control.v1"
STAGE_HANDLER = "hetnode.stage.v1"  # one long-lived duplex stream per chain boundary
DHT_TIMEOUT_S = 10.0
# neighbours remembered to rejoin through when the routing table has emptied (the contacts we joined
# through may be gone too: a restarting coordinator)
REMEMBERED_NEIGHBOURS = 16
REJOIN_PROBE_S = 2.0  # a contact's TCP port answering within this says our link is back
logging.getLogger("hivemind").setLevel(logging.WARNING)


class PeersUnreachable(HetnodeError):
    """No initial peer answered; worth retrying (it may not have started yet)."""


class _StaticRelayP2P(P2P):
    """p2pd with relay discovery off, so that autorelay reserves a slot on the trusted relays at once
    (with discovery on it waits minutes for more candidates from the DHT). hivemind has no argument for
    this flag; it builds p2pd's command line here."""

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **kwargs, relayDiscovery=False)


@dataclass(frozen=True)
class NodeLimits:
    probe_bytes: int
    probe_s: float
    requests_per_min: int
    budgets: NodeBudgets = NodeBudgets()  # daemons: NodeBudgets.sized(probe_bytes, max frame bytes)


DEFAULT_LIMITS = NodeLimits(
    probe_bytes=4 * 2**20, probe_s=5.0, requests_per_min=120
)  # until the manifest says


@dataclass(frozen=True)
class StoredValue:
    peer_id: str
    value: Any
    expiration: float


NUDGE_TIMEOUT_S = 3.0
_ANSWERS = {"yes": True, "no": False, "unknown": None}
# (peer, reader, writer): runs for the stream's life; the stream closes when it returns
StageAcceptor = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class SwarmNode:
    def __init__(self, identity: Identity, p2p: P2P, limits: NodeLimits) -> None:
        self.identity = identity
        self.p2p = p2p
        self._limits = limits
        self.dht: DHTNode | None = None
        self._dht_contacts: list[str] = []  # the multiaddrs we joined the DHT through
        self._remembered: list[str] = []  # peer ids of recent DHT neighbours, newest first
        self._rejoin_waits = 0  # rejoin attempts since the routing table emptied
        self.run: str | None = None
        self.coordinator: str | None = None  # the run's, whose `head` and `changes` alone we store
        self.budgets = Budgets(limits.budgets)
        self.refusals = RefusalLog(log)
        self._stage: StageAcceptor | None = None
        self._member_policy: Callable[[str], bool] = lambda peer: True
        self._preferred: frozenset[str] = frozenset()  # peers that may take the stream slots kept for them
        self._sealers: frozenset[str] | None = None  # the manifest's stand-ins (who else may store a seal)
        self._caps: RecordCapsValidator | None = None
        self._own: dict[str, tuple[Any, float]] = {}  # field -> (our latest entry, its expiry): served direct
        self._background: set[asyncio.Task] = set()  # nudges in flight, cancelled at shutdown
        self._stage_limiter = RateLimiter(limits.requests_per_min)
        self._closed = False
        # bytes by (direction, channel) for the metrics: "sync" payloads, "state" transfer, "probe"
        # (every key exists from the start: the metrics thread copies it while the loop adds to it)
        self.traffic: Counter[tuple[str, str]] = Counter(
            {(d, c): 0 for d in ("sent", "received") for c in ("sync", "state", "probe")}
        )
        self._server = ControlServer(
            limits.probe_bytes,
            limits.probe_s,
            self.budgets,
            self.traffic,
            info=lambda: {
                "run": self.run or "",
                "protocol": 0,
                "coordinator": "",
                "role": "idle",
                "name": "",
            },
        )
        self._server.own_entry = self._own_entry

    @property
    def limits(self) -> NodeLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: NodeLimits) -> None:
        """New limits (the run's manifest is read after the node starts) apply to requests from now on."""
        self._limits = limits
        self._server.probe_bytes, self._server.probe_s = limits.probe_bytes, limits.probe_s
        self.budgets.reconfigure(limits.budgets)

    @classmethod
    async def start(
        cls,
        identity: Identity,
        limits: NodeLimits,
        host_maddrs: Sequence[str],
        initial_peers: Sequence[str] = (),
        announce_maddrs: Sequence[str] = (),
        client_mode: bool = False,
        relay_service: bool = False,
        relay_via: Sequence[str] = (),
    ) -> SwarmNode:
        """`relay_service`: serve circuit relay to peers that cannot be dialled (it runs only on a node
        that counts itself publicly reachable, so this says so). `relay_via`: we cannot be dialled;
        hold a relay slot on these peers (full multiaddrs) and announce our circuit address through them
        next to `announce_maddrs` (which then need explicit ports)."""
        with tempfile.TemporaryDirectory(prefix="hetnode-id-") as scratch:
            key_path = identity.path
            if key_path is None:  # p2pd must use the same key that signs our records
                key_path = Path(scratch) / "identity.key"
                write_identity_file(identity, key_path)
            p2p = await cls._start_p2p(
                key_path, host_maddrs, initial_peers, announce_maddrs, client_mode, relay_service, relay_via
            )
        node = cls(identity, p2p, limits)
        if p2p.peer_id.to_base58() != identity.peer_id:
            await p2p.shutdown()
            raise HetnodeError(f"p2pd runs as {p2p.peer_id}, not as our identity {identity.peer_id}")
        if not client_mode:
            limiter = RateLimiter(limits.requests_per_min)
            await p2p.add_binary_stream_handler(
                CONTROL_HANDLER,
                guarded_handler(
                    CONTROL_HANDLER,
                    limiter,
                    node._server.handle,
                    node.budgets,
                    node.refusals,
                    preferred=node.is_preferred,
                ),
            )
            await p2p.add_binary_stream_handler(STAGE_HANDLER, node._accept_stage)
            node._server.dial_back = node._dial_back
        return node

    @staticmethod
    async def _start_p2p(
        key_path: Path,
        host_maddrs: Sequence[str],
        initial_peers: Sequence[str],
        announce_maddrs: Sequence[str],
        client_mode: bool,
        relay_service: bool = False,
        relay_via: Sequence[str] = (),
    ) -> P2P:
        await refuse_taken_ports(host_maddrs)  # p2pd itself would share a taken port (SO_REUSEPORT)
        kind: type[P2P] = P2P
        relaying: dict[str, Any] = {"force_reachability": "public"} if relay_service else {}
        if relay_via:
            kind = _StaticRelayP2P
            # private: autorelay holds a slot only on a node that counts itself undialable; the circuit
            # addresses are announced by us because a relay vouches only for its public addresses
            relaying = {
                "use_auto_relay": True,
                "trusted_relays": list(relay_via),
                "force_reachability": "private",
            }
            announce_maddrs = [*announce_maddrs, *(f"{relay}/p2p-circuit" for relay in relay_via)]
        try:
            p2p = await kind.create(
                initial_peers=list(initial_peers) or None,
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) or None,
                identity_path=str(key_path),
                dht_mode="client" if client_mode else "server",
                check_if_identity_free=False,  # a restart with the same key must not be refused
                **relaying,
            )
        except Exception as exc:
            if initial_peers and "bootstrap peers" in str(exc):  # p2pd's words for "none answered"
                raise PeersUnreachable(f"none of {list(initial_peers)} answered") from None
            raise HetnodeError(f"cannot start the P2P daemon on {list(host_maddrs)}: {exc}") from exc
        return guard_late_replies(p2p)

    def set_info(self, provider: InfoProvider) -> None:
        self._server.info = provider

    def set_payloads(self, provider: PayloadProvider) -> None:
        """Serve sync payloads: `provider(round, shard, replica, asker)` returns the encoded message or None,
        or raises `Refused` (an author keeps an unsealed round's payload from all but its sealers)."""
        self._server.payloads = provider

    def set_inclusion(self, provider: InclusionProvider) -> None:
        """A sealer: `provider(round, replica)` says whether that replica's payload is in the seal of that
        round (None: not known here). Each peer may ask only about itself."""
        self._server.inclusion = provider

    async def ask_included(self, peer: str, round_: int) -> bool | None:
        """Ask the sealer `peer` whether our payload is in its seal of `round_` (None: it does not know)."""
        reply = await request(self.p2p, peer, CONTROL_HANDLER, encode_request("included", round=round_))
        if reply.type != "inclusion" or reply["round"] != round_ or reply["answer"] not in _ANSWERS:
            raise PeerRequestError(peer, f"expected an inclusion answer for round {round_}, got {reply.type}")
        return _ANSWERS[reply["answer"]]

    def set_state(self, provider: StateProvider) -> None:
        """Serve global parameters for catch-up: `provider(round, shard)` -> a dense payload or None.

        The provider runs in a worker thread (encoding a shard is slow) and its answers are cached for
        the newest round, so it must read θ consistently while the loop may apply a round; a torn read
        would fail the requester's digest check, not corrupt anything."""
        self._server.state.clear()
        self._server.state = StateCache(provider)

    def set_feedback(self, source: FeedbackSource | None) -> None:
        """A leaving chain stage: serve its error feedback, shard by shard, from `source`, which refuses
        anyone but the spare that took the stage, and hear that spare say it has it (None: serve nothing)."""
        self._server.feedback = source or NoFeedback()

    async def fetch_feedback(self, peer: str, shard: str, max_bytes: int) -> bytes:
        data = await self._fetch(peer, encode_request("feedback", shard=shard), max_bytes)
        self.traffic["received", "state"] += len(data)
        return data

    async def confirm_feedback(self, peer: str) -> None:
        """Tell the leaving stage `peer` that we hold all of its feedback: it may exit now."""
        reply = await request(self.p2p, peer, CONTROL_HANDLER, encode_request("feedback_taken"))
        if reply.type != "ack":
            raise PeerRequestError(peer, f"expected ack, got {reply.type}")

    def set_probe_policy(self, policy: ProbePolicy) -> None:
        """Serve bandwidth probes only to peers for which `policy(peer)` is True (default: everyone)."""
        self._server.probe_policy = policy

    def set_member_policy(self, policy: Callable[[str], bool]) -> None:
        """A closed run: only peers for which `policy(peer)` is True are heard. Their records and
        announcements are the only ones `read_field` returns, and only they may open chain streams or ask
        anything but ping, info and admit (what a volunteer needs to get admitted)."""
        self._member_policy = policy
        self._server.member_policy = policy

    def set_admit_handler(self, handler: Callable[[str, str], str]) -> None:
        """A closed run's coordinator: `handler(peer, token)` returns an admission or raises WireError."""
        self._server.admit = handler

    async def request_admission(self, peer: str, token: str) -> str:
        """Ask `peer` (the coordinator) for an admission of our key, with a join token or ""."""
        reply = await request(self.p2p, peer, CONTROL_HANDLER, encode_request("admit", token=token))
        if reply.type != "admitted":
            raise PeerRequestError(peer, f"expected an admission, got {reply.type}")
        return reply["admission"]

    def set_nudge_handler(self, handler: NudgeHandler) -> None:
        self._server.nudged = handler

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

    def prefer(self, peers: Iterable[str]) -> None:
        """Keep stream slots for `peers` (with the coordinator): the replicas of recent seals, whose payload
        fetches a crowd of strangers must not crowd out (docs/security.md, "Exhaust a daemon")."""
        self._preferred = frozenset(peers)

    def is_preferred(self, peer: str) -> bool:
        return peer == self.coordinator or peer in self._preferred

    def set_sealers(self, stand_ins: Iterable[str]) -> None:
        """The manifest's stand-ins: with the coordinator, the only writers of `seal` this node stores."""
        self._sealers = frozenset(stand_ins)
        if self._caps is not None:
            self._caps.sealers = self._sealers

    def _own_entry(self, field: str) -> bytes | None:
        held = self._own.get(field)
        if held is None or held[1] < time.time():
            return None
        return msgpack.packb({"value": held[0], "expires": held[1]}, use_bin_type=True)

    async def read_direct(self, peer: str, field: str) -> StoredValue | None:
        """`peer`'s own current entry of `field`, asked of it directly (the stream is authenticated: the
        entry is the peer's), checked as a DHT entry is; None when it has none or answers badly. The path
        beside the DHT for the round's messages, which chosen-id DHT nodes could otherwise hide."""
        if field not in DIRECT_FIELDS or (field != "manifest" and not self._member_policy(peer)):
            return None
        try:
            data = await self._fetch(peer, encode_request("own", field=field), MAX_RECORD_BYTES[field] + 1024)
            held = msgpack.unpackb(
                data, raw=False, max_bin_len=len(data), max_map_len=4096, max_array_len=4096
            )
            value, expires = held["value"], held["expires"]
            if not isinstance(expires, float):
                raise ValueError("no expiry")
            problem = cap_problem(field, value, expires, time.time())
            if problem is not None or expires < time.time():
                raise ValueError(problem or "expired")
            check_direct_entry(field, value)
        except (PeerRequestError, WireError, TimeoutError) as exc:
            log.debug("no direct %s entry from %s: %s", field, peer, exc)
            return None
        except Exception as exc:  # msgpack's and pydantic's errors, whatever a hostile answer raises
            self.refusals.warning(
                peer, f"direct:{field}", "ignoring the %s entry %s sent: %s", field, peer, exc
            )
            return None
        return StoredValue(peer, value, expires)

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
        slot = None
        try:
            if self._stage is None:
                refusal = "not our upstream stage now"
            elif not self._member_policy(peer):
                refusal = "not admitted to this closed run"
            elif not self._stage_limiter.allow(peer):
                refusal = "rate limited"
            else:
                slot = self.budgets.stage_streams.reserve(peer)
                refusal = f"too many chain streams ({self.budgets.stage_streams.refused_by(peer)})"
            if slot is None:  # closed at once: the opener waits for an accept frame, not for a reason
                self.budgets.refusals["stage"] += 1
                self.refusals.warning(
                    peer, "stage", "refusing a chain stream from peer %s (%s)", peer, refusal
                )
                return
            await self._stage(peer, reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("chain stream from peer %s failed", peer)
        finally:
            if slot is not None:
                slot.release()
            writer.close()

    async def fetch_payloads(
        self,
        peer: str,
        round_: int,
        wanted: Sequence[tuple[str, str]],
        max_bytes: int,
        stall_s: float | None = None,
    ) -> list[bytes]:
        """The sync payloads `wanted` ((shard, replica) pairs) of `round_` held by `peer`, in that order.

        One stream for all of them (up to MAX_PAYLOADS_PER_STREAM), requests pipelined: a stream set-up per
        payload would cost more than a small payload's transfer, and count against the peer's rate limit.
        Any payload the peer lacks fails the whole fetch, and so does (TimeoutError) a wait of more than
        `stall_s` for the stream or for any one payload: a holder that stalls is not waited for."""
        payloads: list[bytes] = []
        for start in range(0, len(wanted), MAX_PAYLOADS_PER_STREAM):
            batch = wanted[start : start + MAX_PAYLOADS_PER_STREAM]
            stream = await asyncio.wait_for(open_stream(self.p2p, peer, CONTROL_HANDLER), stall_s)

            async def send_requests(stream: OpenStream = stream, batch: Sequence = batch) -> None:
                for shard, replica in batch:
                    await stream.send(encode_request("payload", round=round_, shard=shard, replica=replica))

            # requests go out while replies come in: written first, many requests could fill the
            # buffers while the peer blocks writing a payload nobody reads yet
            sender = asyncio.create_task(send_requests())
            try:
                for _ in batch:
                    payloads.append(await asyncio.wait_for(self._receive_payload(stream, max_bytes), stall_s))
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
        coordinator: str | None = None,
    ) -> None:
        """Start the DHT node for `run`: records are checked against the run's schema and signatures, and
        the coordinator-only fields against `coordinator` (the run's, once known).

        `require_bootstrap=False`: initial peers are a best guess (remembered neighbours), some may be gone.
        """
        self.run = run
        self._dht_contacts = list(initial_peers)
        self.coordinator = coordinator or self.coordinator
        self._caps = RecordCapsValidator(run, coordinator=self.coordinator)
        self._caps.sealers = self._sealers
        validators = CompositeValidator(
            [RSASignatureValidator(self.identity.private_key), run_schema_validator(run), self._caps]
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

    async def serve_dht(self, serving: bool) -> None:
        """Serve the DHT (hold replicas of others' records, answer their lookups) or only use it. A peer on
        a slow link should not serve: every read of a key goes to each of its replicas, so a replica of the
        peer records carries every reader's copy of every record. The DHT node is made anew in the other
        mode through the same contacts (a client is never put in others' routing tables; one that turned
        client in place would be); our records live on at the other replicas."""
        old = self._require_dht()
        if serving == (not old.protocol.client_mode):
            return
        assert self.run is not None
        await self.join_dht(self.run, self._dht_contacts, client_mode=not serving, require_bootstrap=False)
        try:
            await asyncio.wait_for(old.shutdown(), 5.0)  # its handlers go; the P2P daemon stays (ours)
        except Exception as exc:
            log.debug("shutting down the previous DHT node: %r", exc)
        log.info("DHT: %s", "serving records again" if serving else "a client only (a slow link)")

    def dht_neighbours(self) -> list[str]:
        """The peer ids in our DHT routing table now."""
        if self.dht is None:
            return []
        return [peer.to_base58() for peer in self.dht.protocol.routing_table.uid_to_peer_id.values()]

    async def rejoin_dht(self) -> bool:
        """Rejoin the DHT through the contacts we joined through and the neighbours we remember, if our
        routing table has emptied. hivemind drops a node from the table on every request it does not
        answer, so a link that was down for a while leaves the table empty; and the others dropped us
        as well, so nobody would ever ask us again: without this the node stays alone for good. True when
        a contact answered and the table was refilled."""
        dht = self._require_dht()
        if dht.protocol.routing_table.uid_to_peer_id:
            return False
        targets: dict[str, list[str]] = {peer: [] for peer in self._remembered}
        for maddr in self._dht_contacts:
            if "/p2p/" in maddr:
                targets.setdefault(maddr.rsplit("/p2p/", 1)[1], []).append(maddr)
        targets.pop(self.identity.peer_id, None)
        if not targets:
            return False
        self._rejoin_waits += 1
        # while our link is still down every libp2p dial fails, and each failure lengthens p2pd's dial
        # backoff for that peer (tens of seconds after a 30 s outage): look with plain TCP first, and
        # dial through libp2p only once a contact answers (or, every 4th try, the remembered peers anyway)
        addresses = [hp for hp in map(tcp_host_port, self._dht_contacts) if hp is not None][:4]
        if addresses:
            listening = await asyncio.gather(*(libp2p_listens(h, p, REJOIN_PROBE_S) for h, p in addresses))
            if not any(listening) and self._rejoin_waits % 4:
                log.debug("rejoin: no contact answers on TCP yet; waiting")
                return False

        async def ping(peer: str, maddrs: list[str]) -> bool:
            peer_id = PeerID.from_base58(peer)
            if maddrs:  # the daemon may have forgotten how to reach it; private API: P2P has no connect()
                try:
                    await asyncio.wait_for(
                        self.p2p._client.connect(peer_id, [Multiaddr(m) for m in maddrs]), 5
                    )
                except Exception as exc:
                    log.debug("rejoin: dialling %s failed: %r", peer, exc)
            return await dht.protocol.call_ping(peer_id) is not None

        answered = await asyncio.gather(*(ping(peer, maddrs) for peer, maddrs in targets.items()))
        if not any(answered):
            say = log.debug if self._rejoin_waits > 4 else log.info  # once or twice an outage, not forever
            say("rejoin: none of %d known peers answered; trying again later", len(targets))
            return False
        self._rejoin_waits = 0
        await asyncio.wait_for(dht.find_nearest_nodes([dht.node_id]), DHT_TIMEOUT_S)
        log.warning(
            "our DHT routing table had emptied (a link down?): rejoined through %d of %d known peers, "
            "%d neighbours now",
            sum(answered),
            len(targets),
            len(self.dht_neighbours()),
        )
        return True

    async def check_dht_membership(self) -> None:
        """Remember our current neighbours, or rejoin when none is left (call it every heartbeat)."""
        neighbours = self.dht_neighbours()
        if neighbours:
            kept = [peer for peer in self._remembered if peer not in neighbours]
            self._remembered = (neighbours + kept)[:REMEMBERED_NEIGHBOURS]
        else:
            await self.rejoin_dht()

    async def visible_maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    # --- reachability --------------------------------------------------------------------------------

    async def _dial_back(self, peer: str, port: int) -> bool | None:
        """Serve a dial-back: dial `port` where `peer`'s connections to us come from."""
        addrs = [
            str(a)
            for info in await self.p2p.list_peers()
            if info.peer_id.to_base58() == peer
            for a in info.addrs
        ]
        return await dial_back(addrs, port)

    async def ask_dial_back(self, peer: str, port: int) -> bool | None:
        """Ask `peer` whether it can open a fresh connection to our `port` (None: it could not tell)."""
        reply = await request(self.p2p, peer, CONTROL_HANDLER, encode_request("dialback", port=port), 15.0)
        if reply.type != "dialed" or reply["port"] != port or reply["answer"] not in _ANSWERS:
            raise PeerRequestError(peer, f"expected a dial-back answer for port {port}, got {reply.type}")
        return _ANSWERS[reply["answer"]]

    async def direct_maddrs(self) -> list[str]:
        """Our announced TCP addresses that do not go through a relay, without the /p2p/ suffix."""
        found = []
        for maddr in await self.visible_maddrs():
            if tcp_host_port(maddr) is not None:
                found.append(maddr.split("/p2p/")[0])
        return found

    async def reachable_through(self, relay_maddr: str) -> bool:
        """Does a stranger's stream reach our control handler through the relay `relay_maddr`?"""
        return await reachable_through(relay_maddr, self.identity.peer_id, CONTROL_HANDLER)

    async def neighbour_maddrs(self, limit: int = 64) -> list[str]:
        """Full multiaddrs of peers p2pd is connected to: what a restarted node bootstraps from."""
        found = []
        for info in await self.p2p.list_peers():
            for addr in info.addrs[:2]:
                found.append(f"{addr}/p2p/{info.peer_id.to_base58()}")
        return found[:limit]

    # --- records -------------------------------------------------------------------------------------

    def serve_own(self, field: str, value: Any, expires_at: float) -> None:
        """Serve `value` as our entry of `field` to whoever asks us directly (`read_direct`), whatever the
        DHT does with it: before a store, so a nudge need not wait for the DHT."""
        if field not in DIRECT_FIELDS:
            raise ValueError(f"{field} is not served directly (one of {DIRECT_FIELDS})")
        self._own[field] = (value, expires_at)

    async def store_own(self, field: str, value: Any, ttl_s: float, expires_at: float | None = None) -> bool:
        """Write our own (signed) entry of `field`, living `ttl_s` (or until `expires_at`); True when at
        least one DHT node holds it."""
        dht = self._require_dht()
        key, subkey = record_key(self.run, field), owner_subkey(self.identity)
        expiration = time.time() + ttl_s if expires_at is None else expires_at
        if field in DIRECT_FIELDS:
            self.serve_own(field, value, expiration)
        try:
            if await asyncio.wait_for(dht.store(key, value, expiration, subkey=subkey), DHT_TIMEOUT_S):
                return True
            # hivemind reports the status of the replica that answered last: one refusal (a replica that
            # holds a copy as new, a slow answer) hides the others' acceptance. Look before saying so.
            found = await asyncio.wait_for(dht.get(key, latest=True), DHT_TIMEOUT_S)
        except TimeoutError:
            log.warning("storing %s timed out", field)
            return False
        item = found.value.get(subkey) if found is not None and isinstance(found.value, dict) else None
        # ours: a copy that lives as long or longer but says something else (an earlier store that
        # outlives this one) means this store was refused
        return item is not None and item.expiration_time >= expiration - 1e-6 and item.value == value

    async def read_field(
        self, field: str, members_only: bool = True, latest: bool = True
    ) -> dict[str, StoredValue]:
        """All valid, unexpired entries of `field` within its caps, by the peer id that signed them; in a
        closed run only members' entries unless `members_only` is False (for deciding who is a member).

        `latest=False` takes the first copy found instead of asking every replica of the key (each sends
        the whole field): for polls that only look whether something changed, at a fifth of the bytes."""
        dht = self._require_dht()
        try:
            found = await asyncio.wait_for(dht.get(record_key(self.run, field), latest=latest), DHT_TIMEOUT_S)
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
            problem = cap_problem(field, item.value, item.expiration_time, now)
            if problem is not None:
                self.refusals.warning(
                    peer_id, f"record:{field}", "ignoring the %s entry of %s: %s", field, peer_id, problem
                )
                continue
            if members_only and not self._member_policy(peer_id):
                continue
            entries[peer_id] = StoredValue(peer_id, item.value, item.expiration_time)
        return entries

    async def read_entry(
        self, field: str, author: str, check: Callable[[Any], dict], latest: bool = True
    ) -> dict | None:
        """`author`'s entry of `field` as `check` (a schema's parse) returns it; None when there is none or
        `check` refuses it (a relay passed on something our schema refuses: logged, rate-limited)."""
        entry = (await self.read_field(field, latest=latest)).get(author)
        if entry is None:
            return None
        try:
            return check(entry.value)
        except Exception as exc:  # pydantic's errors, and whatever a hostile value makes a parser raise
            self.refusals.warning(
                author, f"record:{field}", "ignoring the %s entry of %s: %s", field, author, exc
            )
            return None

    def _require_dht(self) -> DHTNode:
        if self.dht is None or self.run is None:
            raise HetnodeError("the DHT is not joined yet")
        return self.dht

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
        self._server.state.clear()
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
