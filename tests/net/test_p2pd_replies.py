"""hivemind's p2pd client and a reply that arrives after its caller gave up (`hetnode/net/p2pd_replies.py`):
hivemind's own reader task is fed the daemon's messages; without the guard the late reply ends it, and every
later call of that node would go unanswered."""

import asyncio
import uuid

import pytest
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import p2pd_pb2

from hetnode.net import loop
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import NodeLimits, SwarmNode
from hetnode.net.p2pd_replies import PendingCalls, guard_late_replies


def _framed(call_id: uuid.UUID, response: bytes) -> bytes:
    message = p2pd_pb2.PersistentConnectionResponse(callId=call_id.bytes)
    message.callUnaryResponse.response = response
    body = message.SerializeToString()
    varint = bytearray()
    n = len(body)
    while True:
        byte, n = n & 0x7F, n >> 7
        varint.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(varint) + body


async def _late_reply_then_a_live_one(guarded: bool) -> bytes:
    """A reply for a call already cancelled, then one for a call still waiting: what the waiting one gets."""
    client = ControlClient.__new__(ControlClient)  # the reader needs only these two tables
    client._pending_calls, client._handler_tasks = {}, {}
    client._read_task = client._write_task = None  # (what its close() looks at)
    if guarded:
        client._pending_calls = PendingCalls(client._pending_calls)
    given_up, waiting = uuid.uuid4(), uuid.uuid4()
    client._pending_calls[given_up] = asyncio.get_running_loop().create_future()
    client._pending_calls[given_up].cancel()  # its caller timed out; its `finally` has not run yet
    client._pending_calls[waiting] = answer = asyncio.get_running_loop().create_future()
    reader = asyncio.StreamReader()
    reader.feed_data(_framed(given_up, b"too late") + _framed(waiting, b"in time"))
    reader.feed_eof()
    await client._read_from_persistent_conn(reader)
    return await asyncio.wait_for(answer, 1.0)


def test_a_reply_to_a_cancelled_call_ends_hivemind_s_reader_unless_guarded():
    with pytest.raises(asyncio.InvalidStateError):  # hivemind 1.1.12 as it is
        loop.run(_late_reply_then_a_live_one(guarded=False))
    assert loop.run(_late_reply_then_a_live_one(guarded=True)) == b"in time"


def test_every_node_s_daemon_client_is_guarded():
    async def scenario():
        node = await SwarmNode.start(
            ephemeral_identity(), NodeLimits(2**20, 3.0, 600), ["/ip4/127.0.0.1/tcp/0"]
        )
        try:
            assert isinstance(node.p2p._client.control._pending_calls, PendingCalls)
            assert guard_late_replies(node.p2p) is node.p2p  # a second call changes nothing
            assert isinstance(node.p2p._client.control._pending_calls, PendingCalls)
        finally:
            await node.shutdown()

    loop.run(scenario())
