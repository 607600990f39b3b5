"""What a daemon answers on its control handler: ping, info, bandwidth probes, nudges, payloads and state.

Runs inside `guarded_handler` (hetnode/net/streams.py), which has already checked the rate limit and reserved
the stream slot. Everything that makes us move many bytes for a small request is budgeted here
(docs/security.md, "Exhaust a daemon"): probes need the probe policy's consent and the probe budget, payload
and state replies are charged to their byte budgets before they are sent; a refusal raises `Refused` before
any byte moves.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from hetnode.errors import WireError
from hetnode.net.budgets import Budgets, Refused
from hetnode.net.probe import serve_probe_down, serve_probe_up
from hetnode.net.state_cache import StateCache
from hetnode.net.streams import REQUEST_TIMEOUT_S, OpenStream, read_frame, write_frame
from hetnode.wire.control import (
    MAX_CONTROL_BYTES,
    OPEN_TO_STRANGERS,
    ControlMessage,
    decode_request,
    encode_reply,
)

log = logging.getLogger(__name__)

InfoProvider = Callable[[], dict[str, Any]]  # -> {"run", "protocol", "coordinator", "role", "name"}
# (round, shard, replica, asker) -> the encoded message or None, or Refused (an author's unsealed payload
# asked for by anyone but its sealers); awaitable where serving waits on something (the seal reaching us)
PayloadProvider = Callable[[int, str, str, str], bytes | None | Awaitable[bytes | None]]
InclusionProvider = Callable[[int, str], bool | None]  # (round, replica) -> in that seal (None: unknown)
OwnEntryProvider = Callable[[str], bytes | None]  # field -> our own entry of it, encoded; None: none now


class FeedbackSource(Protocol):
    """A leaving stage's error feedback for its successor (`hetnode.daemon.feedback_handoff`)."""

    async def serve(self, shard: str, asker: str) -> bytes | None:
        """The feedback of `shard` (None: none here); `Refused` to all but the spare that took the stage."""

    def taken(self, asker: str) -> bool:
        """`asker` says it holds all of it: True when that is the spare it was served to."""


class NoFeedback:
    """No handoff under way: nothing to serve, nobody's word to hear."""

    async def serve(self, shard: str, asker: str) -> bytes | None:
        return None

    def taken(self, asker: str) -> bool:
        return False


NudgeHandler = Callable[[str, str, int], None]  # (peer, topic, round): look at the DHT now
ProbePolicy = Callable[[str], bool]  # peer -> may it probe us (daemons: "it has a live record")
MemberPolicy = Callable[[str], bool]  # peer -> is it a member of the run (closed runs)
AdmitHandler = Callable[[str, str], str]  # (peer, token) -> an admission, or WireError with the reason
DialBack = Callable[
    [str, int], Awaitable[bool | None]
]  # (peer, port) -> did its port answer (None: no address)
PAYLOAD_TIMEOUT_S = 60.0  # one payload frame: megabytes over a slow link
MAX_PAYLOADS_PER_STREAM = 256  # pipelined payload requests one stream may carry


class ControlServer:
    """The providers a daemon plugs in, and the budgets every answer is charged to."""

    def __init__(
        self,
        probe_bytes: int,
        probe_s: float,
        budgets: Budgets,
        traffic: Counter[tuple[str, str]],
        info: InfoProvider,
    ) -> None:
        self.probe_bytes = probe_bytes
        self.probe_s = probe_s
        self.budgets = budgets
        self.traffic = traffic  # shared with the node's metrics
        self.info = info
        self.payloads: PayloadProvider = lambda round_, shard, replica, asker: None
        self.inclusion: InclusionProvider = lambda round_, replica: None
        self.own_entry: OwnEntryProvider = lambda field: None
        self.state = StateCache(lambda round_, shard: None)
        self.feedback: FeedbackSource = NoFeedback()
        self.nudged: NudgeHandler = lambda peer, topic, round_: None
        self.probe_policy: ProbePolicy = lambda peer: True
        self.member_policy: MemberPolicy = lambda peer: True
        self.admit: AdmitHandler | None = None
        self.dial_back: DialBack | None = None

    async def handle(
        self, peer: str, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        message = decode_request(first, self.probe_bytes)
        stream = OpenStream(peer, reader, writer)
        if message.type not in OPEN_TO_STRANGERS and not self.member_policy(peer):
            self.budgets.refusals["policy:member"] += 1
            raise Refused("not_admitted", "this run is closed and this peer is not admitted")
        if message.type == "admit":
            if self.admit is None:
                raise WireError("admit", "this daemon does not admit peers (ask the coordinator)")
            admission = await asyncio.to_thread(self.admit, peer, message["token"])
            await stream.send(encode_reply("admitted", admission=admission))
        elif message.type == "ping":
            await stream.send(encode_reply("pong", time=time.time()))
        elif message.type == "info":
            await stream.send(encode_reply("info", **self.info()))
        elif message.type == "probe_up":
            self.allow_probe(peer, message["bytes"])
            self.traffic["received", "probe"] += await serve_probe_up(stream, message["bytes"], self.probe_s)
        elif message.type == "probe_down":
            self.allow_probe(peer, message["bytes"])
            self.traffic["sent", "probe"] += await serve_probe_down(
                stream, message["bytes"], message["seconds"], self.probe_s
            )
        elif message.type == "nudge":
            self.nudged(peer, message["about"], message["round"])
            await stream.send(encode_reply("ack"))
        elif message.type == "included":
            included = self.inclusion(message["round"], peer)  # only ever about the asker's own payload
            answer = "unknown" if included is None else "yes" if included else "no"
            await stream.send(encode_reply("inclusion", round=message["round"], answer=answer))
        elif message.type == "dialback":
            answer = None if self.dial_back is None else await self.dial_back(peer, message["port"])
            word = "unknown" if answer is None else "yes" if answer else "no"
            await stream.send(encode_reply("dialed", port=message["port"], answer=word))
        elif message.type == "payload":
            await self._serve_payloads(message, stream)
        elif message.type == "own":
            await self._serve_own_entry(message, stream)
        elif message.type == "state":
            await self._serve_state(message, stream)
        elif message.type == "feedback":
            await self._serve_feedback(message, stream)
        elif message.type == "feedback_taken":
            if not self.feedback.taken(peer):
                raise Refused("not_successor", "no error feedback of ours was served to you")
            await stream.send(encode_reply("ack"))

    def allow_probe(self, peer: str, n_bytes: int) -> None:
        """Raise `Refused` unless the policy lets `peer` probe and the probe budget covers `n_bytes`:
        a 50-byte request must not make us move megabytes for anyone who asks."""
        try:
            allowed = self.probe_policy(peer)
        except Exception:
            log.exception("the probe policy failed on peer %s", peer)
            allowed = False
        if not allowed:
            self.budgets.refusals["policy:probe"] += 1
            raise Refused("policy", "this node serves probes only to peers with a live record")
        self.budgets.spend("probe", peer, n_bytes)

    async def _serve_own_entry(self, message: ControlMessage, stream: OpenStream) -> None:
        data = self.own_entry(message["field"])
        if data is None:
            raise WireError("field", f"no {message['field']} entry of ours now")
        self.budgets.spend("payload", stream.peer, len(data))
        await stream.send(encode_reply("payload_ready", bytes=len(data)))
        await write_frame(stream.writer, data, timeout=PAYLOAD_TIMEOUT_S)

    async def _serve_state(self, message: ControlMessage, stream: OpenStream) -> None:
        # encoded once per (round, shard) for all askers, off the event loop; charged before sending
        data = await self.state.get(message["round"], message["shard"])
        if data is None:
            raise WireError("round", f"no state for round {message['round']} shard {message['shard']!r}")
        await self._send_state(data, stream)

    async def _serve_feedback(self, message: ControlMessage, stream: OpenStream) -> None:
        data = await self.feedback.serve(message["shard"], stream.peer)  # Refused to all but the taker
        if data is None:
            raise WireError("shard", f"no error feedback for shard {message['shard']!r} here")
        await self._send_state(data, stream)

    async def _send_state(self, data: bytes, stream: OpenStream) -> None:
        """A state frame (θ or a stage's error feedback), charged to the asker's state budget first."""
        self.budgets.spend("state", stream.peer, len(data))
        await stream.send(encode_reply("payload_ready", bytes=len(data)))
        await write_frame(stream.writer, data, timeout=PAYLOAD_TIMEOUT_S)
        self.traffic["sent", "state"] += len(data)

    async def _serve_payloads(self, message: ControlMessage, stream: OpenStream) -> None:
        """Serve `message` and every further payload request on the stream, until the peer closes it."""
        for served in range(1, MAX_PAYLOADS_PER_STREAM + 1):
            data = self.payloads(message["round"], message["shard"], message["replica"], stream.peer)
            if inspect.isawaitable(data):
                data = await data
            if data is None:
                what = f"payload for round {message['round']} shard {message['shard']!r}"
                raise WireError("round", f"no {what} of {message['replica'][-8:]} here")
            self.budgets.spend("payload", stream.peer, len(data))
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
            message = decode_request(following, self.probe_bytes)
            if message.type != "payload":
                raise WireError(
                    "type", f"only payload requests may follow a payload request, not {message.type}"
                )
