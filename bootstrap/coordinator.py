"""The coordinator: a DHT node with a persistent identity and address that publishes the signed run
manifest and opens a boundary every `network.boundary_s` (roles and chains change only at boundaries).

State in the data dir survives a restart: identity key (same peer id), the bound port (same address
when `--listen` asked for port 0), the run id and the boundary counter. Before anything there is written,
`bootstrap/run_state.py` checks that `--config` continues the stored run (or moves it aside: `--new-run`),
and θ comes from the newest usable checkpoint (`bootstrap/checkpoint_store.py`; `--resume` requires one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CONTENT_TYPE_LATEST

from bootstrap.admissions import Admissions, read_allowlist
from bootstrap.checkpoint_store import CheckpointRoutes, Restored, checkpoints_root, convert_legacy, restore
from bootstrap.ledger import Ledger
from bootstrap.round_keeper import RoundKeeper
from bootstrap.run_state import LEDGER_FILE, NEIGHBOURS_FILE, STATE_FILE, begin_new_run, go_on_with_run
from bootstrap.samples import newest_samples
from bootstrap.status_page import StatusBoard
from bootstrap.swarm_metrics import SwarmMetrics
from hetnode.config import Config, load_config
from hetnode.net.identity import Identity, load_or_create_identity
from hetnode.net.node import PeersUnreachable, SwarmNode
from hetnode.net.records import new_peer_record
from hetnode.protocol.membership import Membership
from hetnode.protocol.status_signed import sign_status
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view import PeerDirectory
from hetnode.service.datadir import DataDir
from hetnode.service.http_server import DEFAULT_STATUS_PORT, HttpServer, Response, refuse_taken_port
from hetnode.service.lifecycle import print_ready, sleep_or_stop, stop_on_signals, until_stopped
from hetnode.service.limits import limits_of
from hetnode.service.metrics import PeerMetrics
from hetnode.service.presence import Presence, keep_in_dht
from hetnode.wire.manifest import PROTOCOL_VERSION, Manifest

log = logging.getLogger(__name__)

MANIFEST_TTL_S = 600.0
MANIFEST_REFRESH_S = 60.0
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/31337"


@dataclass(frozen=True)
class BootstrapOptions:
    config_path: Path
    data_dir: Path
    listen: str = DEFAULT_LISTEN
    identity: Path | None = None
    announce: tuple[str, ...] = ()
    protocol: int = PROTOCOL_VERSION  # only tests speak another version
    http_port: int | None = DEFAULT_STATUS_PORT  # status page, API, /metrics; None: off; 0: any free port
    metrics_port: int | None = None  # a separate /metrics port (None: on http_port)
    http_host: str = "127.0.0.1"
    # peers that may seal while the coordinator is away (docs/security.md, "Who is trusted with what")
    stand_ins: tuple[str, ...] = ()
    admission: str = "open"  # open | allowlist | tokens
    allowlist: Path | None = None  # peer ids admitted in "allowlist" mode
    new_run: bool = False  # start a new run in data_dir, the old run's files moved aside (run_state.py)
    resume: bool = False  # go on from the data dir's latest checkpoint; an error when it holds none
    device: str = "cpu"  # where scoring, evaluation and samples run (checked: `hetnode.cli.device`)


def listen_address(requested: str, state: dict) -> str:
    """Port 0 means "pick one" on the first start only; later starts reuse the port picked then."""
    parts = requested.rstrip("/").split("/")
    if (
        len(parts) >= 5
        and parts[3] == "tcp"
        and parts[4] == "0"
        and state.get("listen_requested") == requested
    ):
        port = state.get("listen_port")
        if isinstance(port, int) and 0 < port < 65536:
            parts[4] = str(port)
    return "/".join(parts)


def bound_port(maddrs: list[str]) -> int | None:
    for maddr in maddrs:
        parts = maddr.split("/")
        if "tcp" in parts:
            return int(parts[parts.index("tcp") + 1])
    return None


class Coordinator:
    def __init__(self, options: BootstrapOptions) -> None:
        self.options = options
        self.config: Config = load_config(options.config_path)
        self._bootstrapped_from: list[str] = []
        self._allowlist: frozenset[str] = frozenset()
        self._restored: Restored | None = None  # θ from the data dir, until the round keeper takes it

    async def run(self) -> int:
        stop = stop_on_signals()
        o = self.options
        refuse_taken_port(o.http_host, o.http_port, "--http-port")  # before p2pd, the model or the data dir
        refuse_taken_port(o.http_host, o.metrics_port, "--metrics-port")
        with DataDir(self.options.data_dir) as data_dir:
            # every check reads only: a refused start leaves the data dir as it found it
            self._allowlist = read_allowlist(o.allowlist) if o.allowlist is not None else frozenset()
            if o.new_run:
                state = begin_new_run(data_dir, self.config)
            else:
                state = go_on_with_run(data_dir, self.config, o.config_path)  # written once the node is up
            # before the node starts: a start that cannot go on from the checkpoints fails at once
            convert_legacy(data_dir.path, self.config, state["run"])  # an old global.pt, once
            self._restored = restore(data_dir.path, self.config, state["run"], resume=o.resume)
            identity = load_or_create_identity(o.identity or data_dir.path / "identity.key")
            listen = listen_address(o.listen, state)
            remembered = [
                m for m in data_dir.read_json(NEIGHBOURS_FILE).get("maddrs", []) if isinstance(m, str)
            ]
            node = await self._start_node(identity, listen, remembered)
            try:
                await self._serve(node, data_dir, state, stop)
            finally:
                await node.shutdown()
        return 0

    async def _start_node(self, identity: Identity, listen: str, remembered: list[str]) -> SwarmNode:
        limits, announce = limits_of(self.config), self.options.announce
        relay = self.config.network.relay_service  # volunteers behind NAT hold a relay slot here
        self._bootstrapped_from = remembered
        if remembered:
            try:
                return await SwarmNode.start(
                    identity, limits, [listen], remembered, announce_maddrs=announce, relay_service=relay
                )
            except PeersUnreachable:
                log.info(
                    "none of the %d remembered neighbours answered: starting a fresh swarm", len(remembered)
                )
        self._bootstrapped_from = []
        return await SwarmNode.start(
            identity, limits, [listen], announce_maddrs=announce, relay_service=relay
        )

    async def _serve(self, node: SwarmNode, data_dir: DataDir, state: dict, stop: asyncio.Event) -> None:
        run = state["run"]
        node.set_info(
            lambda: {
                "run": run,
                "protocol": self.options.protocol,
                "coordinator": node.identity.peer_id,
                "role": "coordinator",
                "name": "coordinator",
            }
        )
        maddrs = await node.visible_maddrs()
        state.update(listen_requested=self.options.listen, listen_port=bound_port(maddrs))
        data_dir.write_json(STATE_FILE, state)
        # a restarted coordinator finds the swarm again through the neighbours it remembers
        await node.join_dht(
            run, self._bootstrapped_from, require_bootstrap=False, coordinator=node.identity.peer_id
        )
        o = self.options
        manifest = Manifest(
            o.protocol,
            run,
            self.config,
            float(state["created"]),
            o.stand_ins,
            o.admission,
            node.identity.private_key.get_public_key().to_bytes().decode(),
        )
        node.set_sealers(o.stand_ins)  # with us, the only writers of a seal our DHT node keeps
        if o.admission != "open":
            admissions = Admissions(o.admission, node.identity, run, data_dir, self._allowlist)
            node.set_admit_handler(admissions.grant)
            log.info("closed run: admission by %s", o.admission)
        membership = Membership(node, self.config, manifest, node.identity.peer_id)
        membership.apply_policies()
        # the coordinator follows every change: its reads keep the base heartbeat
        directory = PeerDirectory(
            node,
            self.config,
            self.config.network.heartbeat_s,
            self.config.network.heartbeat_s,
            on_read=membership.absorb,
            is_member=membership.is_member,
        )
        membership.on_stranger = directory.wake
        if not await node.store_own("manifest", manifest.envelope(), MANIFEST_TTL_S):
            log.warning("the DHT did not accept the manifest yet; retrying")
        n = self.config.network
        presence = Presence(node, self._record(), n.heartbeat_s, n.record_ttl_s)
        await presence.publish()
        with Ledger(data_dir.path / LEDGER_FILE) as ledger:
            peer_metrics = PeerMetrics(lambda: presence.record, lambda: node.traffic, trains=False)
            swarm_metrics = SwarmMetrics(peer_metrics, ledger)
            # θ is built in a worker thread (tens of seconds for a big model), our record kept alive meanwhile
            keeper = await presence.beating(
                RoundKeeper.create(
                    self.config,
                    node,
                    presence,
                    data_dir,
                    ledger,
                    swarm_metrics,
                    self.options.stand_ins,
                    directory,
                    restored=self._restored,
                )
            )
            self._restored = None  # the keeper copied θ: one copy in memory
            keeper.bookkeeping.device = torch.device(self.options.device)  # before `keeper.run` builds it
            board = StatusBoard(ledger, stale_after_s=max(60.0, 6 * n.heartbeat_s))
            servers = self._http_servers(board, peer_metrics, checkpoints_root(data_dir.path))
            try:
                for server in servers.values():
                    server.start()
                urls = {name: server.url for name, server in servers.items()}
                await self._publish_status(keeper, board, swarm_metrics, state, maddrs)
                print_ready(node.identity.peer_id, maddrs, run=run, **urls)
                log.info(
                    "coordinator of run %s (%s, protocol %d)%s",
                    run,
                    self.config.run.name,
                    self.options.protocol,
                    f"; status page {urls['http']}/" if "http" in urls else "",
                )
                tasks = [
                    asyncio.create_task(presence.heartbeat(stop), name="heartbeat"),
                    asyncio.create_task(
                        self._open_boundaries(node, data_dir, state, stop), name="boundaries"
                    ),
                    asyncio.create_task(self._refresh_manifest(node, manifest, stop), name="manifest"),
                    asyncio.create_task(self._remember_neighbours(node, data_dir, stop), name="neighbours"),
                    asyncio.create_task(keeper.run(stop), name="rounds"),
                    asyncio.create_task(directory.follow(stop), name="peer records"),
                    asyncio.create_task(keeper.keep_head(stop), name="head"),
                    asyncio.create_task(
                        keep_in_dht(node, stop, self.config.network.heartbeat_s), name="dht membership"
                    ),
                    asyncio.create_task(
                        self._keep_status(keeper, board, swarm_metrics, state, maddrs, stop), name="status"
                    ),
                ]
                try:
                    await until_stopped(stop, tasks)
                finally:
                    stop.set()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    await presence.announce_offline()
            finally:
                for server in servers.values():
                    server.stop()

    def _http_servers(
        self, board: StatusBoard, metrics: PeerMetrics, checkpoints: Path
    ) -> dict[str, HttpServer]:
        """The status page, API and newest checkpoint (with /metrics unless it has a port of its own), and
        that port."""
        o = self.options
        metrics_route = {"/metrics": lambda: Response(metrics.exposition(), CONTENT_TYPE_LATEST)}
        servers = {}
        if o.http_port is not None:
            routes = board.routes() | CheckpointRoutes(checkpoints).routes()
            routes |= metrics_route if o.metrics_port is None else {}
            servers["http"] = HttpServer(o.http_host, o.http_port, routes, flag="--http-port")
        if o.metrics_port is not None:
            health = {"/healthz": board.routes()["/healthz"]}
            servers["metrics"] = HttpServer(
                o.http_host, o.metrics_port, metrics_route | health, flag="--metrics-port"
            )
        return servers

    async def _keep_status(
        self,
        keeper: RoundKeeper,
        board: StatusBoard,
        metrics: SwarmMetrics,
        state: dict,
        maddrs: list[str],
        stop: asyncio.Event,
    ) -> None:
        while not await sleep_or_stop(stop, self.config.network.heartbeat_s):
            try:
                await self._publish_status(keeper, board, metrics, state, maddrs)
            except Exception:  # the page is a view: a failure here must never stop the rounds
                log.exception("updating the status page failed")

    async def _publish_status(
        self, keeper: RoundKeeper, board: StatusBoard, metrics: SwarmMetrics, state: dict, maddrs: list[str]
    ) -> None:
        view = await keeper.view.get()
        chains = view.chains()
        metrics.observe_view(view.peers, sum(1 for c in chains if c.live))
        snapshot = status_snapshot(self.config, state, keeper, view, maddrs)
        # signed once a heartbeat, off the loop: `status --peer <multiaddr>` reads it without the DHT
        snapshot["swarm_signed"] = await asyncio.to_thread(
            sign_status, keeper.node.identity.private_key, snapshot["swarm"]
        )
        board.update(snapshot)

    def _record(self) -> dict:
        return new_peer_record("coordinator", link_class="high", role="coordinator")

    async def _open_boundaries(
        self, node: SwarmNode, data_dir: DataDir, state: dict, stop: asyncio.Event
    ) -> None:
        period = self.config.network.boundary_s
        boundary = int(state.get("round", 0))
        while not stop.is_set():
            record = {"round": boundary, "started": time.time(), "period_s": float(period)}
            if await node.store_own("round", record, period * 4):
                state["round"] = boundary
                data_dir.write_json(STATE_FILE, state)
            if await sleep_or_stop(stop, period):
                return
            boundary += 1

    async def _remember_neighbours(self, node: SwarmNode, data_dir: DataDir, stop: asyncio.Event) -> None:
        saved: list[str] = []
        while not await sleep_or_stop(stop, self.config.network.heartbeat_s):
            maddrs = sorted(await node.neighbour_maddrs())
            if maddrs and maddrs != saved:
                data_dir.write_json(NEIGHBOURS_FILE, {"maddrs": maddrs, "saved": time.time()})
                saved = maddrs

    async def _refresh_manifest(self, node: SwarmNode, manifest: Manifest, stop: asyncio.Event) -> None:
        while not await sleep_or_stop(stop, MANIFEST_REFRESH_S):
            await node.store_own("manifest", manifest.envelope(), MANIFEST_TTL_S)


def served_shares(workers: Sequence[Sequence[str]], history: Sequence[Mapping]) -> dict[str, float]:
    """For each stage with a pool: each worker's share of the stage's micro-batches in the newest sealed
    round that had any of them (the steps each announced)."""
    shares: dict[str, float] = {}
    for pool in workers:
        if len(pool) < 2:
            continue
        for entry in reversed(history):
            steps = entry.get("steps") or {}
            served = {p: steps[p] for p in pool if isinstance(steps.get(p), int)}
            total = sum(served.values())
            if total > 0:
                shares |= {p: round(n / total, 3) for p, n in served.items()}
                break
    return shares


def status_snapshot(
    config: Config, state: dict, keeper: RoundKeeper, view: SwarmView, maddrs: list[str]
) -> dict:
    """What the status page and `/api/status` show (schema in `bootstrap/status_page.py`)."""
    peers = [
        {
            "peer": peer,
            "name": r["name"],
            "role": r["role"],
            "link_class": r["link_class"],
            "chain": r["chain"],
            "stage": r["stage"],
            "params_round": r["params_round"],
            "up_mbps": r["up_mbps"],
            "down_mbps": r["down_mbps"],
            "last_seen": r["last_seen"],
        }
        for peer, r in view.peers.items()
        if r["role"] != "coordinator"
    ]
    history = [
        {
            "round": h["round"],
            "contributors": len(h["contributors"]),
            "excluded": len(h["excluded"]),
            "tokens": h["tokens"],
            "eval_loss": h["eval_loss"],
            "seal_seconds": h["seal_seconds"],
            "time": h["time"],
            "payload_bytes": h.get("payload_bytes", {}),
            "dense_bytes": h.get("dense_bytes", 0),
        }
        for h in keeper.history
    ]
    return {
        "run": state["run"],
        "config": config.run.name,
        "peer_id": keeper.node.identity.peer_id,
        "maddrs": list(maddrs),
        "started": float(state["created"]),
        "params_round": keeper.global_model.params_round,
        "eval_loss": keeper.eval_loss,
        "peers": sorted(peers, key=lambda p: (p["role"], p["chain"] or "", p["stage"] or 0, p["name"])),
        "chains": [
            {
                "chain": c.chain,
                "members": [m for m in c.stages if m],
                "workers": [list(w) for w in c.workers],
                # a pool's workers: each one's share of the stage's micro-batches, newest sealed round
                "served": served_shares(c.workers, keeper.history),
                "dropped": c.dropped,
                "live": c.live,
                "lineage": c.lineage,
                "blamed": list(c.blamed),
            }
            for c in view.chains()
        ],
        "history": history,
        "samples": newest_samples(keeper.history),  # in the history: a restart keeps them
        # `hetnode status --peer http://…` prints this (served at /api/swarm): the DHT query's document
        "swarm": view.status_document(state["run"], int(state.get("round", -1)))
        | {"coordinator": keeper.node.identity.peer_id, "config": config.run.name, "time": time.time()},
    }
