"""A hostile peer built from hetnode's own client code: `python tests/swarm/attacker.py ATTACK --peer MADDR`.

It joins the run like any volunteer would (its own p2pd, the run's DHT, the coordinator's manifest), then
does one attack class of docs/security.md for `--seconds`, and prints one `RESULT {json}` line saying what the
swarm let it do (which writes the DHT accepted, what it was served). The tests assert on the swarm
afterwards; this script only attacks. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, PeerID

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.daemon.swarm import find_run  # noqa: E402
from hetnode.lab.nodes import nodes_on_loopback  # noqa: E402
from hetnode.model.shards import layer_digests  # noqa: E402
from hetnode.net.identity import ephemeral_identity, owner_subkey  # noqa: E402
from hetnode.net.node import CONTROL_HANDLER, SwarmNode  # noqa: E402
from hetnode.net.records import (  # noqa: E402
    RecordCapsValidator,
    new_changes_record,
    new_head_record,
    new_peer_record,
    record_key,
)
from hetnode.net.signing import sign_payload  # noqa: E402
from hetnode.net.streams import PeerRequestError, open_stream, request  # noqa: E402
from hetnode.planning.roles import chain_id, format_layout  # noqa: E402
from hetnode.protocol.swarm_view import SwarmView  # noqa: E402
from hetnode.replica.global_model import GlobalModel, sha256_hex  # noqa: E402
from hetnode.wire.control import encode_request, frame_header  # noqa: E402
from hetnode.wire.sync_payload import SyncPayload, encode_payload  # noqa: E402

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TEN_YEARS_S = 10 * 365 * 86400.0


class Attacker:
    def __init__(
        self, node: SwarmNode, coordinator: str, model: GlobalModel, seconds: float, name: str
    ) -> None:
        self.name = name
        self.node = node
        self.coordinator = coordinator
        self.model = model
        self.config = model.config
        self.seconds = seconds
        self.until = time.monotonic() + seconds
        self.begun = False
        self.served: dict[tuple[int, str], bytes] = {}
        self.peer_maddr = ""  # the swarm's address we joined through
        self.targets: list[str] = []  # honest peers' multiaddrs (crowd)
        self.identities = 0
        self.result: dict[str, Any] = {"peer_id": node.identity.peer_id}
        node.set_payloads(lambda round_, shard, replica, asker: self.served.get((round_, shard)))

    def begin(self) -> None:
        """The attack proper starts now (its `--seconds` from here): an `ATTACKING` line says so, once. An
        attack that sets up first (a crowd's p2pd daemons) calls it when set up, so that a test can tell the
        attack's effect from the set-up's CPU, which a real attacker spends on its own machines."""
        if not self.begun:
            self.begun = True
            self.until = time.monotonic() + self.seconds
            print("ATTACKING", flush=True)

    def record(self, **changes: Any) -> dict[str, Any]:
        """A schema-valid peer record claiming to be a fast anchor."""
        return (
            new_peer_record(
                self.name,
                link_class="high",
                up_mbps=10000.0,
                down_mbps=10000.0,
                rtt_ms=1.0,
                mem_gb=512.0,
                device="cuda",
                tflops=1000.0,
                wants="anchor",
                role="anchor",
                layers=[0, self.config.model.n_layers - 1],
            )
            | changes
        )

    async def coordinator_round(self) -> int:
        view = await SwarmView.read(self.node, self.config)
        held = view.peers.get(self.coordinator, {}).get("params_round")
        return held if isinstance(held, int) else -1

    def message(
        self, round_: int, shard: str, shift: float, scale: float = 1e-4, author: str | None = None
    ) -> bytes:
        """A payload message for `shard` with small random values, its quantisation shift set to `shift`
        (packed as float64, so a value beyond float32 stays finite on the wire). The values depend on the
        round only: messages of several `author`s carry one and the same update."""
        codec = SparseLoCoCodec(self.config.outer.topk, self.config.outer.tile)
        generator = torch.Generator().manual_seed(round_)
        tensors = {}
        for name in self.model.shards[shard]:
            delta = torch.randn(self.model.params[name].shape, generator=generator) * scale
            tensors[name] = codec.compress(delta)
        author = author or self.node.identity.peer_id
        data = encode_payload(SyncPayload(author, round_, shard, "sparseloco", tensors))
        if shift == 0.0:
            return data
        message = msgpack.unpackb(data, raw=False)
        for entry in message["tensors"]:
            entry["q"][0] = shift
        return msgpack.packb(message, use_bin_type=True, use_single_float=False)

    async def contribute(self, shift: float, tokens: int, steps: int) -> None:
        """Announce a signed contribution of every shard for each round the coordinator opens."""
        announced = -1
        accepted, refused = 0, 0
        await self.node.store_own("peers", self.record(), 60.0)
        while time.monotonic() < self.until:
            round_ = await self.coordinator_round() + 1
            if round_ != announced:
                run = self.node.run or ""
                digests = {}
                for shard in self.model.shards:
                    signed = sign_payload(self.node.identity, run, self.message(round_, shard, shift))
                    self.served[(round_, shard)] = signed
                    digests[shard] = sha256_hex(signed)
                ok = await self.node.store_own(
                    "announce", {"round": round_, "shards": digests, "tokens": tokens, "steps": steps}, 300.0
                )
                accepted, refused = accepted + ok, refused + (not ok)
                self.node.nudge([self.coordinator], "announce", round_)
                announced = round_
            await self.node.store_own("peers", self.record(), 60.0)
            await asyncio.sleep(0.5)
        self.result.update(announcements_accepted=accepted, announcements_refused=refused)


async def overflow(a: Attacker) -> None:
    """crash: a shift finite in float64 that overflows float32, then one beyond the run's value bound."""
    half = (a.until - time.monotonic()) / 2
    a.until = time.monotonic() + half
    await a.contribute(shift=1e39, tokens=1, steps=1)
    a.until = time.monotonic() + half
    await a.contribute(shift=1e6, tokens=1, steps=1)


async def ledger(a: Attacker) -> None:
    """game the ledger: overflowing claims (refused by the schema), then the largest the schema allows
    with a well-formed contribution that gets sealed."""
    huge = {"round": 0, "shards": {}, "tokens": 2**62, "steps": 2**62}
    a.result["huge_claim_stored"] = await a.node.store_own("announce", huge, 60.0)
    await a.contribute(shift=0.0, tokens=2**40, steps=2**20)


async def hijack(a: Attacker) -> None:
    """hijack + stall: forged seals (next round with a fabricated contribution under an honest name,
    a far-future round, a 10-year TTL) and a record claiming θ of zeros for a far round."""
    zeros = {name: torch.zeros_like(p) for name, p in a.model.params.items()}
    with torch.no_grad():  # the θ we offer anyone who would catch up from us
        for name, p in a.model.params.items():
            p.copy_(zeros[name])
    a.result["ten_year_seal_stored"] = False
    while time.monotonic() < a.until:
        held = await a.coordinator_round()
        view = await SwarmView.read(a.node, a.config)
        honest = sorted(
            p for p, r in view.peers.items() if r["role"] == "anchor" and p != a.node.identity.peer_id
        )
        forged = {
            "round": held + 1,
            "contributions": [{"peer": p, "shards": {"embed": "0" * 64}, "tokens": 1} for p in honest[:1]],
            "excluded": [],
            "sealed_at": time.time(),
            "prev": "0" * 64,
        }
        far = forged | {"round": held + 10**9, "contributions": []}
        a.result["ten_year_seal_stored"] |= await a.node.store_own("seal", far, TEN_YEARS_S)
        a.result["far_seal_stored"] = await a.node.store_own("seal", far, 3000.0)
        a.result["forged_seal_stored"] = await a.node.store_own("seal", forged, 3000.0)
        claim = a.record(params_round=held + 5, layer_digests=layer_digests(zeros), outer_step=held + 5)
        await a.node.store_own("peers", claim, 60.0)
        a.model.params_round = held + 5
        a.node.set_state(lambda round_, shard: a.model.state_payload(shard))
        await asyncio.sleep(1.0)


async def held_by_others(a: Attacker, field: str) -> tuple[int, int]:
    """(honest DHT nodes asked, how many of them hold an entry of ours under `field`), asking each node
    in our routing table directly (a plain get would also find our own copy)."""
    dht = a.node.dht
    key = DHTID.generate(source=record_key(a.node.run, field))
    ours = owner_subkey(a.node.identity)
    asked = held = 0
    for peer in list(dht.protocol.routing_table.uid_to_peer_id.values()):
        found = await dht.protocol.call_find(peer, [key])
        if found is None:
            continue
        asked += 1
        value = found[key][0]
        if value is not None and isinstance(value.value, DictionaryDHTValue):
            held += any(ours in subkey for subkey, _ in value.value.items())
    return asked, held


async def records(a: Attacker) -> None:
    """hide the swarm: an oversized record, a record full of shards the model does not have, a
    stranger's claim on a chain name; and entries under the coordinator's own fields (`head`, `changes`,
    `manifest`) and under `seal`, which a thousand identities could otherwise use to push those keys past
    the DHT's reply limit (a new volunteer would find no manifest)."""
    # an attacker runs code without the coordinator-only rule: only the honest nodes' copy of it refuses
    for validator in a.node.dht.protocol.record_validator._validators:  # noqa: SLF001
        if isinstance(validator, RecordCapsValidator):
            validator.coordinator = None
    await a.node.store_own("head", new_head_record(0, {}, "0" * 16), 600.0)
    await a.node.store_own("changes", new_changes_record([]), 600.0)
    seal = {"round": 10**6, "contributions": [], "excluded": ["x" * 128] * 1000, "sealed_at": 0.0, "prev": ""}
    await a.node.store_own("seal", seal, 600.0)
    manifest = {"protocol": 0, "run": a.node.run or "", "body": b"x" * 60_000}
    await a.node.store_own("manifest", manifest, 600.0)
    for field in ("head", "changes", "seal", "manifest"):
        a.result[f"{field}_asked"], a.result[f"{field}_held"] = await held_by_others(a, field)
    huge = {str(i): "f" * 64 for i in range(1000)}
    a.result["huge_record_stored"] = await a.node.store_own("peers", a.record(layer_digests=huge), 60.0)
    foreign = {str(5000 + i): "f" * 64 for i in range(20)}
    a.result["foreign_record_stored"] = await a.node.store_own("peers", a.record(layer_digests=foreign), 60.0)
    while time.monotonic() < a.until:
        await a.node.store_own("peers", a.record(layer_digests=foreign), 60.0)
        await asyncio.sleep(1.0)


async def exhaust(a: Attacker) -> None:
    """exhaust: hold many idle streams, ask for 4 MB probes without a live record, hammer state requests."""
    target = a.coordinator
    opened = []
    for _ in range(64):
        try:
            stream = await open_stream(a.node.p2p, target, CONTROL_HANDLER, timeout=5.0)
            stream.writer.write(frame_header(1 << 16)[:2])  # half a header, then silence
            opened.append(stream)
        except PeerRequestError:
            pass

    async def refused(stream) -> bool:  # a refused stream answers with its reason at once
        try:
            await stream.receive(timeout=2.0)
        except PeerRequestError as exc:
            return "no reply" not in str(exc)
        return False

    verdicts = await asyncio.gather(*(refused(s) for s in opened))
    refused_streams = sum(verdicts)
    held = [s for s, r in zip(opened, verdicts, strict=True) if not r]
    probe_bytes = 0
    probe_refused = 0
    for _ in range(4):
        try:
            stream = await open_stream(a.node.p2p, target, CONTROL_HANDLER, timeout=5.0)
            await stream.send(encode_request("probe_down", bytes=4 * 2**20, seconds=3.0))
            reply = await stream.receive(timeout=10.0)
            if reply.type == "probe_ready":
                while chunk := await asyncio.wait_for(stream.reader.read(1 << 16), 10.0):
                    probe_bytes += len(chunk)
            stream.close()
        except (PeerRequestError, TimeoutError):
            probe_refused += 1
    state_bytes, state_refused = 0, 0
    while time.monotonic() < a.until:
        round_ = await a.coordinator_round()
        try:
            data = await a.node.fetch_state(target, max(round_, 0), "embed", 64 * 2**20)
            state_bytes += len(data)
        except PeerRequestError:
            state_refused += 1
        await asyncio.sleep(0.05)
    for stream in opened:
        stream.close()
    a.result.update(
        streams_held=len(held),
        streams_refused=refused_streams,
        probe_bytes=probe_bytes,
        probes_refused=probe_refused,
        state_bytes=state_bytes,
        state_refused=state_refused,
    )
    try:  # the coordinator still answers us after all that (when the budget refills)
        await request(a.node.p2p, target, CONTROL_HANDLER, encode_request("ping"), 10.0)
        a.result["ping_after"] = True
    except PeerRequestError:
        a.result["ping_after"] = False


async def redirect(a: Attacker) -> None:
    """redirect a volunteer: a member answering `info` with another coordinator (a rogue one's id)."""
    run = a.node.run or ""
    rogue = ephemeral_identity().peer_id
    a.node.set_info(
        lambda: {
            "run": run,
            "protocol": 0,
            "coordinator": rogue,
            "role": "anchor",
            "name": "rogue",
        }
    )
    maddrs = await a.node.visible_maddrs()
    print("MADDR " + maddrs[0], flush=True)
    while time.monotonic() < a.until:
        await asyncio.sleep(0.5)


async def slow_author(a: Attacker) -> None:
    """stall: announce valid work the moment each round opens, then serve it as slowly as the stream
    timeouts allow (one payload every 9 s: within the 10 s a request may take)."""

    async def slowly(round_: int, shard: str, replica: str, asker: str) -> bytes | None:
        a.result["asked"] = a.result.get("asked", 0) + 1
        await asyncio.sleep(9.0)
        return a.served.get((round_, shard))

    a.node.set_payloads(slowly)
    await a.contribute(shift=0.0, tokens=1, steps=1)


async def liar_holder(a: Attacker) -> None:
    """stall a catch-up: claim θ of the swarm's newest round (its digests are public: an anchor's record
    has them) and answer every state request as slowly as the timeouts allow, with nothing."""

    def nothing_slowly(round_: int, shard: str) -> bytes | None:
        time.sleep(30.0)
        return None

    a.node.set_state(nothing_slowly)
    me = a.node.identity.peer_id
    claimed = -1
    while time.monotonic() < a.until:
        view = await SwarmView.read(a.node, a.config)
        held = [
            (record["params_round"], record["layer_digests"])
            for peer, record in view.peers.items()
            if peer != me
            and record.get("role") == "anchor"
            and isinstance(record.get("params_round"), int)
            and record.get("layer_digests")
        ]
        if held:
            round_, digests = max(held, key=lambda claim: claim[0])
            claimed = max(claimed, round_)
            await a.node.store_own("peers", a.record(params_round=round_, layer_digests=digests), 60.0)
        await asyncio.sleep(0.5)
    a.result.update(claimed=claimed)


async def eclipse(a: Attacker) -> None:
    """eclipse: DHT nodes with ids chosen next to the run's `announce` and `seal` keys (nothing binds a
    hivemind node id to its key), each accepting every store and keeping nothing, so the DHT path of
    every round message ends with them."""
    run = a.node.run or ""
    near = [
        DHTID(int(DHTID.generate(source=record_key(run, field))) ^ offset)
        for field in ("announce", "seal")
        for offset in range(1, 6)
    ]
    sybils: list[tuple[P2P, DHTNode]] = []
    dropped = [0]

    def drop(*args: Any, **kwargs: Any) -> bool:
        dropped[0] += 1
        return True  # "stored"

    try:
        for node_id in near:
            p2p = await P2P.create(initial_peers=[a.peer_maddr], host_maddrs=[LOOPBACK])
            dht = await DHTNode.create(
                p2p=p2p, node_id=node_id, initial_peers=[a.peer_maddr], cache_locally=False, cache_nearest=0
            )
            dht.protocol.storage.store = drop
            dht.protocol.storage.store_subkey = drop
            sybils.append((p2p, dht))
        a.result["sybils"] = len(sybils)
        while time.monotonic() < a.until:
            await asyncio.sleep(0.5)
        a.result["stores_dropped"] = dropped[0]  # the run's nodes found us nearest to its keys
    finally:
        for p2p, dht in sybils:
            await dht.shutdown()
            await p2p.shutdown()


async def crowd(a: Attacker) -> None:
    """exhaust the honest replicas' stream slots: `--identities` identities (a p2pd each), each keeping 8
    idle control streams open to every `--target`, opening a new one a second after one is closed, so that the
    sealer's fetch of a replica's payload would find no slot and the replica would be left out."""
    targets = [maddr.rsplit("/p2p/", 1)[1] for maddr in a.targets]
    crowd = await asyncio.gather(
        *(P2P.create(initial_peers=a.targets, host_maddrs=[LOOPBACK]) for _ in range(a.identities))
    )
    opened = [0]
    a.begin()

    async def hold(p2p: P2P, target: str) -> None:
        while time.monotonic() < a.until:
            try:
                _, reader, writer = await asyncio.wait_for(
                    p2p.call_binary_stream_handler(PeerID.from_base58(target), CONTROL_HANDLER), 5.0
                )
            except Exception:  # refused or not reachable now: try again
                await asyncio.sleep(0.2)
                continue
            opened[0] += 1
            with contextlib.suppress(Exception):  # idle: no request, until the target closes the stream
                await asyncio.wait_for(reader.read(), max(0.1, a.until - time.monotonic()))
            writer.close()
            await asyncio.sleep(1.0)  # holding slots, not flooding: the rate limit is another test's

    try:
        await asyncio.gather(*(hold(p2p, t) for p2p in crowd for t in targets for _ in range(8)))
    finally:
        for p2p in crowd:
            await p2p.shutdown()
    a.result.update(identities=len(crowd), streams_opened=opened[0])


async def duplicates(a: Attacker) -> None:
    """one update announced under `--identities` identities (each its own p2pd, record and signature) for
    every round the coordinator opens: the sealer must weigh and credit it as one training at most."""
    # each identity in the run's DHT, as the first one joined it
    more = nodes_on_loopback(
        a.identities - 1, a.node.run or "", initial_peers=[a.peer_maddr], coordinator=a.coordinator
    )
    async with more as others:
        nodes = [a.node, *others]
        served: dict[tuple[str, int, str], bytes] = {}
        for node in nodes:
            node.set_payloads(
                lambda round_, shard, replica, asker, me=node.identity.peer_id: served.get(
                    (me, round_, shard)
                )
            )
        announced, rounds = -1, 0
        while time.monotonic() < a.until:
            round_ = await a.coordinator_round() + 1
            if round_ != announced:
                for node in nodes:
                    me, run = node.identity.peer_id, node.run or ""
                    digests = {}
                    for shard in a.model.shards:
                        body = a.message(round_, shard, 0.0, author=me)
                        served[(me, round_, shard)] = sign_payload(node.identity, run, body)
                        digests[shard] = sha256_hex(served[(me, round_, shard)])
                    announcement = {"round": round_, "shards": digests, "tokens": 1, "steps": 1}
                    await node.store_own("announce", announcement, 300.0)
                    node.nudge([a.coordinator], "announce", round_)
                announced, rounds = round_, rounds + 1
            for i, node in enumerate(nodes):
                await node.store_own("peers", a.record(name=f"{a.name}-{i}"), 60.0)
            await asyncio.sleep(0.5)
    a.result.update(identities=[node.identity.peer_id for node in nodes], rounds_announced=rounds)


async def successor(a: Attacker) -> None:
    """strangers around a live chain's successor, five identities: two hold a live chain under the chain's
    lineage (which stopped the lineage being continued after a break), two more a newer one under it whose
    members say it broke (which was continued in the broken chain's place), and the fifth says it is an
    idle spare a thousand times faster than anyone and never steps in (the plan's first spare, always).
    Claims are renewed each second under the round before the coordinator's: always older than the boundary
    that plans."""
    more = nodes_on_loopback(4, a.node.run or "", initial_peers=[a.peer_maddr], coordinator=a.coordinator)
    async with more as others:
        nodes = [a.node, *others]
        victim = None
        while victim is None and time.monotonic() < a.until:
            chains = (await SwarmView.read(a.node, a.config)).chains()
            victim = next((c for c in chains if c.live), None)
            await asyncio.sleep(0.5)
        if victim is None:
            a.result["victim"] = None
            return
        layers = [(first, last) for _, first, last in victim.layout]
        a.result.update(victim=victim.chain, lineage=victim.lineage, noshow=nodes[4].identity.peer_id)
        idle = a.record(name=f"{a.name}-4", link_class="low", wants="stage", role="idle", layers=None)
        stored, names = 0, set()
        while time.monotonic() < a.until:
            formed = max(await a.coordinator_round() - 1, 0)
            for pair, broken in ((nodes[:2], False), (nodes[2:4], True)):
                layout = tuple((n.identity.peer_id, f, la) for n, (f, la) in zip(pair, layers, strict=True))
                name = chain_id(formed, [(p, (f, la)) for p, f, la in layout], victim.lineage)
                names.add(name)
                for i, node in enumerate(pair):
                    record = a.record(
                        name=f"{a.name}-{nodes.index(node)}",
                        link_class="low",
                        wants="stage",
                        role="stage",
                        chain=name,
                        stage=i,
                        layers=list(layout[i][1:]),
                        chain_layout=format_layout(layout),
                        chain_lineage=victim.lineage,
                        chain_broken=True if broken else None,
                    )
                    stored += await node.store_own("peers", record, 10.0)
            stored += await nodes[4].store_own("peers", idle, 10.0)
            await asyncio.sleep(1.0)
        a.result.update(
            identities=[node.identity.peer_id for node in nodes], claims_stored=stored, chains=sorted(names)
        )


SETS_UP_FIRST = {"crowd"}  # these call `Attacker.begin` themselves
ATTACKS = {
    f.__name__: f
    for f in (
        overflow,
        ledger,
        hijack,
        records,
        exhaust,
        redirect,
        slow_author,
        liar_holder,
        eclipse,
        crowd,
        duplicates,
        successor,
    )
}


async def main(args: argparse.Namespace) -> None:
    async with nodes_on_loopback(1, initial_peers=[args.peer]) as (node,):
        contact = await find_run(node, args.peer, 30.0, asyncio.Event())
        model = GlobalModel(contact.manifest.config)
        attacker = Attacker(node, contact.coordinator, model, args.seconds, f"attacker-{args.attack}")
        attacker.peer_maddr = args.peer
        attacker.targets, attacker.identities = args.target, args.identities
        if args.attack not in SETS_UP_FIRST:
            attacker.begin()
        await ATTACKS[args.attack](attacker)
        print("RESULT " + json.dumps(attacker.result), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--peer", required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--target", action="append", default=[], help="a peer's multiaddr (crowd)")
    parser.add_argument("--identities", type=int, default=33, help="identities of a crowd")
    asyncio.run(main(parser.parse_args()))
