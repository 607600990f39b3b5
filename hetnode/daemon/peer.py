"""`hetnode join`: a participant. It finds the run through one known peer, measures its link, advertises
its class and takes a role at each boundary: anchor at once, or a stage in a chain, and runs the role's
training (`AnchorLoop`, `ChainLoop`).

Which chain a stage peer is in, and how it forms, grows, continues with a spare or dissolves at a boundary
(docs/swarm.md, docs/chains.md), is `chain_membership.py`'s; this module decides the role and starts and
stops the training that goes with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST

from hetnode.config import Config
from hetnode.daemon.anchor import AnchorLoop
from hetnode.daemon.chain import ChainLoop
from hetnode.daemon.chain_links import ChainLayout
from hetnode.daemon.chain_membership import ChainMembership
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.feedback_handoff import handoff_window_s
from hetnode.daemon.peer_address import is_url, resolve_peer
from hetnode.daemon.reach import reach_swarm
from hetnode.daemon.resources import available_memory_gb, measure_tflops
from hetnode.daemon.run_tokenizer import coordinator_http, ensure_run_tokenizer
from hetnode.daemon.swarm import RunContact, find_run, local_config, read_round
from hetnode.errors import HetnodeError
from hetnode.model.decoder import count_parameters
from hetnode.net.identity import load_or_create_identity
from hetnode.net.node import SwarmNode
from hetnode.net.peer_ids import peer_id_from_maddr
from hetnode.net.probe import LinkMeasurement, combine
from hetnode.net.records import NO_CHAIN, new_peer_record
from hetnode.net.streams import PeerRequestError
from hetnode.planning.reachability import Reachability, assess
from hetnode.planning.roles import (
    ClassThresholds,
    LinkClass,
    Role,
    RoleRequest,
    classify_link,
    next_role,
    wanted_role,
)
from hetnode.protocol.membership import Membership
from hetnode.protocol.swarm_view import SwarmView
from hetnode.protocol.view import PeerDirectory, coordinator_directory
from hetnode.protocol.view_changes import coordinator_changes
from hetnode.service.datadir import DataDir
from hetnode.service.http_server import HttpServer, Response
from hetnode.service.lifecycle import Stopped, print_ready, sleep_or_stop, stop_on_signals, until_stopped
from hetnode.service.limits import limits_of
from hetnode.service.metrics import PeerMetrics
from hetnode.service.presence import Presence, keep_in_dht
from hetnode.training.warm_up import warm_up_torch
from hetnode.wire.manifest import PROTOCOL_VERSION

log = logging.getLogger(__name__)

MAX_PROBE_ANCHORS = 3
PIN_FILE = "coordinator.json"  # the coordinator this data dir follows, once it joined
REMEASURE_EVERY_BOUNDARIES = 20


@dataclass(frozen=True)
class JoinOptions:
    peer: str
    name: str
    bandwidth_mbps: float | None  # None: measure
    role: RoleRequest
    device: str
    data_dir: Path
    listen: str
    announce: tuple[str, ...] = ()
    connect_timeout_s: float = 60.0
    metrics_port: int | None = None  # None: no /metrics; 0: any free port
    http_host: str = "127.0.0.1"
    fault: str | None = None  # tests only: a hostile or faulty anchor or stage (`hetnode.daemon.faults`)
    fault_after_s: float = 0.0  # tests only: a stage's frame fault begins this long after the daemon started
    tflops: float | None = None  # the compute to advertise instead of measuring it (labs: a fixed layout)
    coordinator: str | None = None  # the coordinator's peer id we mean to follow (pinned)
    token: str | None = None  # a join token, for runs that admit by token
    data_source: str | None = None  # our own copy of the run's data (None: the bundled corpus)
    data_cache: str = "~/.cache/hetnode"  # where tokenised data is cached; never taken from a manifest
    allow_repeats: bool = False  # train past the manifest's train.max_epochs on our copy of the data
    relay_service: bool = False  # serve circuit relay to peers behind NAT (a publicly reachable anchor)


class PeerDaemon:
    def __init__(self, options: JoinOptions) -> None:
        self.options = options
        self._fault_begins_at = time.monotonic() + options.fault_after_s  # tests only (`--fault-after`)
        self.node: SwarmNode | None = None
        self.contact: RunContact | None = None
        self.presence: Presence | None = None
        self.link_class: LinkClass = "slow"
        self.chains: ChainMembership | None = None  # our chain, once we joined (`chain_membership.py`)
        self._measuring: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None  # torch's one-time costs (`warm_up_torch`)
        self._role_task: asyncio.Task | None = None  # the anchor loop or our chain stage
        self._role_key: str | None = None  # "anchor" or the chain id
        self._saying_broken: asyncio.Task | None = None  # our record says our chain broke
        self._role_loop: AnchorLoop | ChainLoop | None = None  # what `_role_task` runs
        self.metrics: PeerMetrics | None = None
        self._http: HttpServer | None = None
        self._config: Config | None = None
        self._data_dir: DataDir | None = None
        self.membership: Membership | None = None
        self.directory: PeerDirectory | None = None
        self.admission: str | None = None  # our admission to a closed run
        self.pinned: str | None = options.coordinator
        self.coordinator_url: str | None = None  # `--peer http://…`: where the coordinator serves HTTP
        self.reachability: Reachability | None = None  # from real dials (None: judged from addresses)

    @property
    def config(self) -> Config:
        assert self._config is not None, "the run's config is known once the run was found"
        return self._config

    async def run(self) -> int:
        stop = stop_on_signals()  # first: the wait for a coordinator URL ends on Ctrl+C too
        if is_url(self.options.peer):
            try:
                peer = await resolve_peer(self.options.peer, self.options.connect_timeout_s, stop)
            except Stopped as exc:
                log.info("%s", exc)
                return 0
            self.coordinator_url = self.options.peer
            self.options = dataclasses.replace(self.options, peer=peer)
            # the URL is the coordinator's own: it names the peer id to follow
            self.pinned = self.pinned or peer_id_from_maddr(peer)
        peer_id_from_maddr(self.options.peer)  # a clear error before any daemon starts
        with DataDir(self.options.data_dir) as data_dir:
            remembered = data_dir.read_json(PIN_FILE).get("coordinator")
            if self.pinned is None and isinstance(remembered, str):
                self.pinned = remembered  # a restart follows the coordinator it followed before
            self._data_dir = data_dir
            identity = load_or_create_identity(data_dir.path / "identity.key")
            self.node, self.reachability = await reach_swarm(
                identity,
                self.options.listen,
                self.options.peer,
                self.options.announce,
                self.options.connect_timeout_s,
                stop,
                self.options.relay_service,
            )
            if self.node is None:
                return 0  # stopped while waiting
            try:
                self._start_metrics()
                await self._serve(stop)
            except Stopped as exc:
                log.info("%s", exc)
            finally:
                if self._http is not None:
                    self._http.stop()
                if self._measuring is not None:
                    self._measuring.cancel()
                if self.presence is not None:
                    await self.presence.announce_offline()
                    if stop.signalled:
                        await self._hand_off_feedback(stop.again)
                await self.node.shutdown()
        return 0

    def _start_metrics(self) -> None:
        if self.options.metrics_port is None:
            return
        node = self.node
        self.metrics = PeerMetrics(
            record=lambda: self.presence.record if self.presence is not None else {},
            traffic=lambda: node.traffic,
        )
        metrics = self.metrics
        self._http = HttpServer(
            self.options.http_host,
            self.options.metrics_port,
            {
                "/metrics": lambda: Response(metrics.exposition(), CONTENT_TYPE_LATEST),
                "/healthz": self._health,
            },
            flag="--metrics-port",
        )
        self._http.start()
        log.info("metrics on %s/metrics", self._http.url)

    def _health(self) -> Response:
        ok = self.presence is not None
        body = json.dumps({"ok": ok, "role": self.presence.record["role"] if ok else None})
        return Response(body.encode(), "application/json", 200 if ok else 503)

    async def _serve(self, stop: asyncio.Event) -> None:
        self.node.set_info(self._info)
        self.contact = await find_run(
            self.node,
            self.options.peer,
            self.options.connect_timeout_s,
            stop,
            pinned=self.pinned,
            require_pin=True,
        )
        self._data_dir.write_json(PIN_FILE, {"coordinator": self.contact.coordinator, "saved": time.time()})
        self._config = local_config(
            self.contact.manifest.config,
            self.options.data_source,
            self.options.data_cache,
            allow_repeats=self.options.allow_repeats,
        )
        self.node.limits = limits_of(self.config)
        manifest = self.contact.manifest
        self.membership = Membership(self.node, self.config, manifest, self.contact.coordinator)
        self.membership.apply_policies()
        n = self.config.network
        self.directory = PeerDirectory(
            self.node,
            self.config,
            n.heartbeat_s,
            n.stable_heartbeat_s,
            on_read=self.membership.absorb,
            is_member=self.membership.is_member,
            # the coordinator stores its head every half stable heartbeat; twice the stable heartbeat
            # tolerates a lost store and some clock skew before we read every record ourselves
            vouched=lambda: coordinator_directory(
                self.node, self.contact.coordinator, 2 * n.stable_heartbeat_s
            ),
            # and when its view is a few changes ahead of ours, the records that changed
            changes=lambda: coordinator_changes(
                self.node, self.contact.coordinator, 2 * n.stable_heartbeat_s
            ),
        )
        self.membership.on_stranger = self.directory.wake
        self.admission = await self._get_admitted() if manifest.admission != "open" else None
        # a run that pins its tokenizer: the coordinator's copy, before any role may train on other ids
        http = coordinator_http(self.coordinator_url, self.options.peer, self.contact.coordinator)
        await ensure_run_tokenizer(self.config.data, http, stop)
        log.info("joined run %s (coordinator %s)", self.contact.manifest.run, self.contact.coordinator)
        await self._start_presence()
        record = self.presence.record
        maddrs = await self.node.visible_maddrs()
        reachability = self.reachability or assess(maddrs, self.options.peer)
        print(reachability.line(), flush=True)
        if reachability.verdict == "unreachable":
            log.warning("%s", reachability.line())
        print_ready(
            self.node.identity.peer_id,
            maddrs,
            run=self.contact.manifest.run,
            link_class=record["link_class"],
            up_mbps=f"{record['up_mbps']:.1f}",
            down_mbps=f"{record['down_mbps']:.1f}",
            role=record["role"],
            **({"metrics": f"{self._http.url}/metrics"} if self._http is not None else {}),
        )
        tasks = [
            asyncio.create_task(self.presence.heartbeat(stop), name="heartbeat"),
            asyncio.create_task(self._follow_boundaries(stop), name="boundaries"),
            asyncio.create_task(self.directory.follow(stop), name="peer records"),
            asyncio.create_task(
                keep_in_dht(self.node, stop, self.config.network.heartbeat_s), name="dht membership"
            ),
        ]
        self._run_role(stop)
        try:
            await until_stopped(stop, tasks)
        finally:
            stop.set()
            if self._role_task is not None:
                tasks.append(self._role_task)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _hand_off_feedback(self, quit_now: asyncio.Event) -> None:
        """A chain stage stopped while it trained: say we are offline (done: the boundary plans our
        successor) and serve our error feedback to the spare that takes our stage (`feedback_handoff`)."""
        task, loop = self._role_task, self._role_loop
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return
        if not isinstance(loop, ChainLoop) or task.result() != "stopped":
            return
        handoff = loop.handoff(self._view)
        if handoff is None:
            return
        window = handoff_window_s(self.config)
        log.info(
            "handing our stage's error feedback (norm %.6f) to the spare that takes it: up to %.0f s "
            "(stop again to quit now)",
            handoff.norm,
            window,
        )
        self.node.set_feedback(handoff)
        try:
            outcome = await handoff.wait(window, quit_now)
        finally:
            self.node.set_feedback(None)
        log.info("error feedback handoff over: %s", outcome)

    def _reap_role_task(self) -> None:
        """Note how our role's training ended, if it has: a chain's that ended other than by our stop (a
        member died, its stream broke) is broken, and the boundary that notices continues or dissolves it."""
        task = self._role_task
        if task is not None and task.done():
            self._role_task = None
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
            if self._role_key != "anchor" and task.result() != "stopped":
                self.chains.broken = True

    def _run_role(self, stop: asyncio.Event, view: SwarmView | None = None) -> None:
        """Run the training of the current role (the anchor loop, or our stage of a live chain) and stop
        it when the role or the chain changes. `view` is needed to start a chain's stage."""
        self._reap_role_task()
        task = self._role_task
        record = self.presence.record
        wanted: str | None = None
        if record["role"] == "anchor":
            wanted = "anchor"
        elif record["role"] == "stage":
            wanted = self.chains.working
        if task is not None and self._role_key != wanted:
            log.info("leaving %s: its training stops (local state is kept)", self._role_key)
            task.cancel()
            self._role_task = task = None
        if wanted is None or task is not None:
            return
        if wanted == "anchor":
            loop = AnchorLoop(
                self.config,
                self.node,
                self.presence,
                self.contact.coordinator,
                self.options.device,
                self.options.data_dir / f"anchor-state-{self.contact.manifest.run}.pt",
                faults_named(self.options.fault),  # a new one each role: a stale anchor's θ starts afresh
                self.metrics,
                self.contact.manifest.stand_ins,
                self.directory,
            )
        else:
            layout = ChainLayout.from_view(view, wanted, self.node.identity.peer_id) if view else None
            if layout is None:
                return
            loop = ChainLoop(
                self.config,
                self.node,
                self.presence,
                self.contact.coordinator,
                layout,
                self.options.data_dir,
                self.options.device,
                self.metrics,
                self.directory,
                faults_named(self.options.fault, self._fault_begins_at),
                self.chains.predecessors,
            )
        self._role_task = asyncio.create_task(loop.run(stop), name=f"role-{wanted}")
        self._role_loop = loop
        if wanted != "anchor":
            self._role_task.add_done_callback(self._chain_stage_ended)
        self._role_key = wanted

    def _chain_stage_ended(self, task: asyncio.Task) -> None:
        """Say at once that our chain broke (a neighbour left or misbehaved): the boundary's plan keeps us
        at our stage and finds a spare for the empty one (`plan_successors`), whoever reads it first."""
        if task.cancelled() or task.exception() is not None or task.result() == "stopped":
            return
        if task is self._role_task and not self.chains.broken:
            self.chains.broken = True
            blame = self._role_loop.blamed if isinstance(self._role_loop, ChainLoop) else None
            self._saying_broken = asyncio.get_running_loop().create_task(
                self.presence.update(chain_broken=True, chain_blame=blame), name="chain-broken"
            )

    def _info(self) -> dict:
        return {
            "run": self.contact.manifest.run if self.contact else "",
            "protocol": PROTOCOL_VERSION,
            "coordinator": self.contact.coordinator if self.contact else "",
            "role": self.presence.record["role"] if self.presence else "idle",
            "name": self.options.name,
        }

    # --- joining -------------------------------------------------------------------------------------

    async def _start_presence(self) -> None:
        """Publish our record (idle, link unknown) so that members serve us probes, measure the link,
        then publish what we measured and the role it gives."""
        device = self.options.device
        mem_gb = available_memory_gb(device)
        tflops = self.options.tflops if self.options.tflops is not None else measure_tflops(device)
        record = new_peer_record(
            self.options.name,
            mem_gb=round(float(mem_gb), 2),
            device=device,
            tflops=float(tflops),
            admission=self.admission,
        )
        n = self.config.network
        self.presence = Presence(self.node, record, n.heartbeat_s, n.record_ttl_s, n.stable_heartbeat_s)
        self.chains = ChainMembership(
            self.config, self.node.identity.peer_id, self.presence, self._view, self._run_role
        )
        await self.presence.publish()
        link = await self._measure_link(patient=True)
        self.link_class = self._classify(link, mem_gb)
        await self.node.serve_dht(self.link_class != "slow")  # a slow link cannot carry others' reads
        wants = wanted_role(self.link_class, self.options.role)
        role: Role = next_role("idle", False, wants)
        if wants == "stage":  # while idle: a spare stepping in must not pay them in the round it saves
            self._warming = asyncio.create_task(asyncio.to_thread(warm_up_torch), name="warm-up")
        log.info(
            "link up %.1f / down %.1f Mbit/s, %.1f GB free, %.2g TFLOP/s: class %s, role %s",
            link.up_mbps,
            link.down_mbps,
            mem_gb,
            tflops,
            self.link_class,
            role if role != "idle" else f"idle (wants {wants})",
        )
        await self.presence.update(
            link_class=self.link_class,
            up_mbps=float(link.up_mbps),
            down_mbps=float(link.down_mbps),
            rtt_ms=float(link.rtt_ms) if link.rtt_ms != float("inf") else None,
            wants=wants,
            role=role,
            layers=[0, self.config.model.n_layers - 1] if role == "anchor" else None,
        )

    async def _get_admitted(self) -> str:
        """A closed run: ask the coordinator for an admission (with our join token, or for our allowlisted
        key); it goes into our record, where every member checks it."""
        try:
            return await self.node.request_admission(self.contact.coordinator, self.options.token or "")
        except PeerRequestError as exc:
            raise HetnodeError(f"run {self.contact.manifest.run} did not admit this peer: {exc}") from None

    async def _measure_link(self, patient: bool = False) -> LinkMeasurement:
        """Our link against the coordinator and a few anchors. `patient`: on joining, members serve probes
        only once they have read our record (within a heartbeat or two), so refusals are retried."""
        if self.options.bandwidth_mbps is not None:
            rate = float(self.options.bandwidth_mbps)
            return LinkMeasurement(up_mbps=rate, down_mbps=rate, rtt_ms=float("inf"))
        deadline = time.monotonic() + (self.options.connect_timeout_s if patient else 0.0)
        while True:
            targets = [self.contact.coordinator] + await self._probe_anchors()
            results = []
            for target in targets:
                try:
                    results.append(await self.node.measure_link(target))
                except (PeerRequestError, TimeoutError) as exc:
                    log.info("bandwidth probe against %s failed: %s", target, exc)
            if results:
                return combine(results)
            if time.monotonic() > deadline:
                raise HetnodeError("could not measure the link against any peer; pass --bandwidth <Mbit/s>")
            await asyncio.sleep(self.config.network.heartbeat_s)

    async def _probe_anchors(self) -> list[str]:
        view = await self._view()
        own = self.node.identity.peer_id
        anchors = sorted(p for p, r in view.peers.items() if r["role"] == "anchor" and p != own)
        return anchors[:MAX_PROBE_ANCHORS]

    def _classify(self, link: LinkMeasurement, mem_gb: float) -> LinkClass:
        n = self.config.network
        thresholds = ClassThresholds(n.anchor_min_up_mbps, n.anchor_min_down_mbps, n.stage_min_up_mbps)
        n_params = count_parameters(self.config.model)
        return classify_link(link.up_mbps, link.down_mbps, mem_gb, n_params, thresholds)

    # --- boundaries ----------------------------------------------------------------------------------

    async def _view(self, max_age_s: float | None = None) -> SwarmView:
        """The peer records through the daemon's shared reads; `max_age_s=0` reads them now."""
        assert self.directory is not None, "the peer records are read once the run was joined"
        return await self.directory.get(max_age_s)

    async def _follow_boundaries(self, stop: asyncio.Event) -> None:
        poll_s = min(1.0, self.config.network.boundary_s / 4)
        seen: int | None = None
        while not stop.is_set():
            current = await read_round(self.node, self.contact.coordinator)
            if current is not None and current != seen:
                if seen is not None:  # the first round we see is not a fresh boundary: wait for the next
                    await self._on_boundary(current, stop)
                seen = current
            if await sleep_or_stop(stop, poll_s):
                return

    async def _on_boundary(self, boundary: int, stop: asyncio.Event) -> None:
        record = self.presence.record
        await self._apply_remeasurement(boundary)
        self._reap_role_task()  # before deciding: a chain that broke since the last boundary is left now
        view = await self._view()
        chains = self.chains
        if record["wants"] == "stage":
            view = await chains.keep_or_move(boundary, view, stop)
            if view is None:
                return
        in_live_chain = chains.in_live_chain(view)
        role = next_role(record["role"], in_live_chain, record["wants"])
        if chains.assignment is not None and not in_live_chain:
            log.info(
                "chain %s is not complete any more: dissolving, back to the pool", chains.assignment.chain
            )
        if role != record["role"] or (role != "stage" and chains.assignment is not None):
            chains.leave()
            layers = [0, self.config.model.n_layers - 1] if role == "anchor" else None
            await self.presence.update(
                **(NO_CHAIN | {"role": role, "layers": layers, "outer_step": boundary})
            )
            log.info("boundary %d: role %s", boundary, role)
        self._run_role(stop, view)
        if role == "idle" and record["wants"] == "stage":
            await chains.try_to_form(boundary, stop)

    async def _apply_remeasurement(self, boundary: int) -> None:
        """Re-measure now and then (auto bandwidth only); a new class changes the role at a boundary."""
        if self.options.bandwidth_mbps is not None:
            return
        if self._measuring is not None and self._measuring.done():
            task, self._measuring = self._measuring, None
            try:
                link = task.result()
            except HetnodeError as exc:
                log.warning("re-measurement failed: %s", exc)
                return
            new_class = self._classify(link, available_memory_gb(self.options.device))
            if new_class != self.link_class:
                log.info("link class changed %s -> %s", self.link_class, new_class)
                await self.node.serve_dht(new_class != "slow")
            self.link_class = new_class
            await self.presence.update(
                link_class=new_class,
                up_mbps=float(link.up_mbps),
                down_mbps=float(link.down_mbps),
                wants=wanted_role(new_class, self.options.role),
            )
        elif self._measuring is None and boundary % REMEASURE_EVERY_BOUNDARIES == 0:
            self._measuring = asyncio.create_task(self._measure_link(), name="remeasure")
