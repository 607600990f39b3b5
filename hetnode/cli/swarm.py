"""`hetnode bootstrap`, `hetnode join`, `hetnode status`: the swarm's three commands.

Parsers use light modules only; each handler imports the daemon it runs (hivemind, torch) itself."""

from __future__ import annotations

import argparse
import json
import math
import socket
import time
from pathlib import Path

from hetnode.daemon.faults import FAULT_NAMES
from hetnode.errors import ConfigError, HetnodeError
from hetnode.service.http_server import DEFAULT_STATUS_PORT

DEFAULT_HOME = Path("~/.hetnode")
SIGNED_STATUS_TIMEOUT_S = 2.0  # the coordinator's HTTP port answers at once or not at all; then the DHT


def port_or_off(text: str) -> int | None:
    """A TCP port, 0 (let the OS pick), or "off"."""
    if text.lower() in ("off", "none", "no"):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def positive_number(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    boot = commands.add_parser(
        "bootstrap",
        help="run the coordinator: DHT entry point, manifest, boundaries (`bootstrap token`: a join token)",
    )
    boot.add_argument(
        "action",
        nargs="?",
        choices=("token",),
        help="token: print a join token for --name, signed by this coordinator's key (closed runs)",
    )
    boot.add_argument("--config", type=Path, help="run config (TOML), e.g. configs/tiny.toml")
    boot.add_argument("--listen", default=None, help="listen multiaddr (default /ip4/0.0.0.0/tcp/31337)")
    boot.add_argument("--announce-maddr", action="append", default=[], help="public multiaddr to announce")
    boot.add_argument(
        "--identity", type=Path, default=None, help="private key file (default DATA_DIR/identity.key)"
    )
    boot.add_argument("--data-dir", type=Path, default=DEFAULT_HOME / "bootstrap", help="state folder")
    boot.add_argument(
        "--new-run",
        action="store_true",
        help="start a new run in --data-dir even though it holds one: the old run's files move to "
        "DATA_DIR/previous-runs/ (nothing is deleted; same peer id and address). Without it, a --config "
        "that does not continue the stored run is refused and nothing is changed",
    )
    boot.add_argument(
        "--resume",
        action="store_true",
        help="go on from the latest checkpoint in DATA_DIR/checkpoints/ (a damaged one falls back to the one "
        "before it) and fail, changing nothing, when there is none or it is another config's. A start "
        "without it goes on from the latest checkpoint too, or begins from the seeded θ when there is none",
    )
    boot.add_argument(
        "--http-port",
        type=port_or_off,
        default=DEFAULT_STATUS_PORT,
        help=f"status page, API, /metrics, /healthz (default {DEFAULT_STATUS_PORT}; 0: any free port; off)",
    )
    boot.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        help="a separate port for /metrics only (default: served on --http-port)",
    )
    boot.add_argument("--http-host", default="127.0.0.1", help="address the HTTP server binds (0.0.0.0: all)")
    boot.add_argument(
        "--stand-in",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="a peer (an anchor) that may seal rounds while the coordinator is away; repeatable "
        "(default: none, the swarm waits for the coordinator)",
    )
    boot.add_argument(
        "--admit",
        nargs="+",
        default=["open"],
        metavar="MODE",
        help="who may take part: open (default), allowlist FILE (peer ids, one per line), or tokens "
        "(volunteers join with `join --token` from `bootstrap token --name NAME`)",
    )
    boot.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="where the coordinator scores contributions, evaluates and samples (default %(default)s; cuda "
        "needs a CUDA build of torch and a GPU; auto: cuda when it can run, else cpu). θ, the outer step, "
        "digests and checkpoints stay on CPU in fp32",
    )
    boot.add_argument("--name", default=None, help="bootstrap token: the volunteer's name on the leaderboard")
    boot.add_argument("--days", type=float, default=7.0, help="bootstrap token: days it stays valid")
    boot.add_argument("--protocol-version", type=int, default=None, help=argparse.SUPPRESS)  # tests only
    boot.set_defaults(handler=run_bootstrap)

    join = commands.add_parser("join", help="join a swarm as a participant (anchor or chain stage)")
    join.add_argument(
        "--peer",
        required=True,
        help="the coordinator's status URL http://HOST:PORT (PORT: its --http-port, default "
        f"{DEFAULT_STATUS_PORT}), or the multiaddr of any swarm member from its READY line (ending in "
        "/p2p/<peer id>); waited for up to --connect-timeout",
    )
    join.add_argument(
        "--coordinator",
        default=None,
        metavar="PEER_ID",
        help="the coordinator to follow (its READY line and status page show the id); needed when --peer "
        "is another member's multiaddr, implied by the coordinator's own address or URL",
    )
    join.add_argument(
        "--data-source",
        default=None,
        help="your copy of the run's data (tokens:FOLDER, dir:FOLDER, bin:FILE, parquet:PATH, arrow:PATH or "
        "hf:NAME) when the run does not train on the bundled corpus; a manifest never picks a path on your "
        "machine",
    )
    join.add_argument(
        "--allow-repeats",
        action="store_true",
        help="train even when the run's steps pass over your data more than its train.max_epochs times",
    )
    join.add_argument(
        "--data-cache",
        default="~/.cache/hetnode",
        help="where tokenised data is cached (default %(default)s)",
    )
    join.add_argument(
        "--token", default=None, help="a join token from the operator (runs that admit by token)"
    )
    join.add_argument("--name", default=None, help="name on the leaderboard (default: host name)")
    join.add_argument("--bandwidth", default="auto", help="auto (measure) or this link's Mbit/s")
    join.add_argument(
        "--role",
        choices=("auto", "anchor", "stage"),
        default="auto",
        help="auto (default): the link's class decides (anchor on a fast link, a chain stage otherwise); "
        "anchor or stage: ask for that role",
    )
    join.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where this peer trains (default %(default)s; cuda needs a CUDA build of torch and a GPU)",
    )
    join.add_argument(
        "--data-dir", type=Path, default=None, help="state folder (default ~/.hetnode/peers/NAME)"
    )
    join.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0", help="listen multiaddr")
    join.add_argument("--announce-maddr", action="append", default=[], help="public multiaddr to announce")
    join.add_argument(
        "--relay-service",
        action="store_true",
        help="serve circuit relay to peers behind NAT that join through this peer (a publicly reachable "
        "anchor; the coordinator serves it unless network.relay_service = false)",
    )
    join.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for --peer to answer (an http:// URL's status API, then the P2P port) and "
        "for the run's manifest, retrying while it starts (default %(default)g); then fail with the reason",
    )
    join.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=None,
        help="serve Prometheus /metrics and /healthz on this port (default off; 0 picks one)",
    )
    join.add_argument("--http-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0: all)")
    join.add_argument(
        "--fault", choices=FAULT_NAMES, default=None, help=argparse.SUPPRESS
    )  # tests only: a hostile or faulty anchor or stage (`hetnode.daemon.faults`)
    join.add_argument(
        "--fault-after", type=positive_number, default=0.0, metavar="SECONDS", help=argparse.SUPPRESS
    )  # tests only: a stage's frame fault begins this long after start (a worker that turns to lying)
    join.add_argument(
        "--tflops", type=positive_number, default=None, help=argparse.SUPPRESS
    )  # labs only: advertise this compute instead of measuring it (which peers lead chains, and pools)
    join.set_defaults(handler=run_join)

    status = commands.add_parser("status", help="show the swarm as the DHT sees it")
    status.add_argument(
        "--peer",
        required=True,
        help="the coordinator's status URL http://HOST:PORT (PORT: its --http-port, default "
        f"{DEFAULT_STATUS_PORT}), or the multiaddr of any swarm member from its READY line",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output (a stable interface)")
    status.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="give up after this long, saying why (default %(default)g); a --peer where nothing listens "
        "fails at once",
    )
    status.add_argument(
        "--coordinator-http-port",
        type=port_or_off,
        default=DEFAULT_STATUS_PORT,
        metavar="PORT",
        help="with a coordinator's multiaddr: its --http-port, where it serves the status it signs "
        f"(default {DEFAULT_STATUS_PORT}; off: always read the DHT, which takes seconds)",
    )
    status.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help=argparse.SUPPRESS)
    status.set_defaults(handler=run_status)


def run_bootstrap(args: argparse.Namespace) -> int:
    from bootstrap.coordinator import DEFAULT_LISTEN, BootstrapOptions, Coordinator
    from hetnode.cli.device import resolve_device
    from hetnode.net import loop
    from hetnode.wire.manifest import PROTOCOL_VERSION

    if args.action == "token":
        return print_token(args)
    if args.config is None:
        raise ConfigError("--config", "config", "the coordinator needs a run config, e.g. configs/tiny.toml")
    if args.resume and args.new_run:
        raise ConfigError("--resume", "resume", "goes on with the stored run, and --new-run begins another")
    stand_ins = tuple(peer_id_flag(peer, "--stand-in") for peer in args.stand_in)
    admission, allowlist = admission_mode(args.admit)
    device = resolve_device(args.device)
    options = BootstrapOptions(
        config_path=args.config,
        data_dir=args.data_dir.expanduser(),
        listen=args.listen or DEFAULT_LISTEN,
        identity=args.identity,
        announce=tuple(args.announce_maddr),
        protocol=args.protocol_version if args.protocol_version is not None else PROTOCOL_VERSION,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        http_host=args.http_host,
        stand_ins=stand_ins,
        admission=admission,
        allowlist=allowlist,
        new_run=args.new_run,
        resume=args.resume,
        device=device,
    )
    return loop.run(Coordinator(options).run())


def peer_id_flag(text: str, flag: str) -> str:
    """`text` if it is a peer id; else an argument error (exit 2) naming `flag`."""
    from hetnode.net.identity import check_peer_id  # hivemind: only when the flag is given

    try:
        return check_peer_id(text, flag)
    except HetnodeError as exc:
        raise ConfigError(flag, flag.lstrip("-"), str(exc).removeprefix(f"{flag}: ")) from None


def admission_mode(words: list[str]) -> tuple[str, Path | None]:
    """`--admit open | allowlist FILE | tokens` as (mode, allowlist file)."""
    mode, *rest = words
    if mode == "allowlist" and len(rest) == 1:
        return mode, Path(rest[0]).expanduser()
    if mode in ("open", "tokens") and not rest:
        return mode, None
    raise ConfigError("--admit", "admit", f"expected open, allowlist FILE or tokens, got {' '.join(words)!r}")


def print_token(args: argparse.Namespace) -> int:
    """`hetnode bootstrap token --name NAME [--data-dir DIR]`: a join token signed by the coordinator."""
    from bootstrap.admissions import issue_token
    from hetnode.net.identity import load_or_create_identity

    if not args.name:
        raise ConfigError("--name", "name", "a join token names its volunteer: pass --name")
    if not 0 < args.days <= 3650:
        raise ConfigError("--days", "days", f"must be in (0, 3650], got {args.days}")
    key = args.identity or args.data_dir.expanduser() / "identity.key"
    if not key.exists():
        raise ConfigError(
            "--data-dir", "identity", f"no coordinator key at {key}: start the coordinator once"
        )
    print(issue_token(load_or_create_identity(key), args.name, args.days), flush=True)
    return 0


def run_join(args: argparse.Namespace) -> int:
    from hetnode.cli.device import check_device
    from hetnode.daemon.peer import JoinOptions, PeerDaemon
    from hetnode.daemon.peer_address import check_peer
    from hetnode.net import loop

    check_peer(args.peer, "--connect-timeout")
    if not 0 < args.connect_timeout <= 86400:
        raise ConfigError(
            "--connect-timeout",
            "connect_timeout",
            f"must be in (0, 86400] seconds, got {args.connect_timeout:g}",
        )
    name = args.name or socket.gethostname()
    if not name or len(name) > 64:
        raise ConfigError("--name", "name", "must be 1..64 characters")
    bandwidth = None
    if args.bandwidth != "auto":
        try:
            bandwidth = float(args.bandwidth)
        except ValueError:
            raise ConfigError(
                "--bandwidth", "bandwidth", f"expected 'auto' or Mbit/s, got {args.bandwidth!r}"
            ) from None
        if not 0 < bandwidth < 1e6:
            raise ConfigError(
                "--bandwidth", "bandwidth", f"must be above 0 and below 1000000 Mbit/s, got {args.bandwidth}"
            )
    check_device(args.device)
    coordinator = None if args.coordinator is None else peer_id_flag(args.coordinator, "--coordinator")
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    options = JoinOptions(
        peer=args.peer,
        name=name,
        bandwidth_mbps=bandwidth,
        role=args.role,
        device=args.device,
        data_dir=(args.data_dir or DEFAULT_HOME / "peers" / safe_name).expanduser(),
        listen=args.listen,
        announce=tuple(args.announce_maddr),
        connect_timeout_s=args.connect_timeout,
        metrics_port=args.metrics_port,
        http_host=args.http_host,
        fault=args.fault,
        fault_after_s=args.fault_after,
        tflops=args.tflops,
        coordinator=coordinator,
        data_source=args.data_source,
        data_cache=args.data_cache,
        allow_repeats=args.allow_repeats,
        token=args.token,
        relay_service=args.relay_service,
    )
    return loop.run(PeerDaemon(options).run())


def run_status(args: argparse.Namespace) -> int:
    from hetnode.daemon.peer_address import check_peer
    from hetnode.daemon.status_table import render_table
    from hetnode.net import loop

    check_peer(args.peer, "--timeout")
    if not 0 < args.timeout <= 3600:
        raise ConfigError("--timeout", "timeout", f"must be in (0, 3600] seconds, got {args.timeout:g}")
    document = loop.run(read_status(args.peer, args.timeout, args.listen, args.coordinator_http_port))
    print(json.dumps(document, indent=1) if args.json else render_table(document), flush=True)
    return 0


async def read_status(
    peer: str, timeout_s: float, listen: str, coordinator_http_port: int | None = DEFAULT_STATUS_PORT
) -> dict:
    """The status document within about `timeout_s`; a Ctrl+C or SIGTERM ends the wait at once (`Stopped`).

    A coordinator URL is asked for the document it serves (one request, no P2P daemon: hivemind is not
    even imported); a coordinator's multiaddr for the document it signs, at `coordinator_http_port` on its
    host (taken only when the multiaddr's peer id signed it). Anything else (a member's multiaddr, an older
    coordinator) is read through the DHT, the requests and the DHT read sharing the timeout."""
    from hetnode.daemon.peer_address import is_url
    from hetnode.daemon.status_http import read_served_status, read_signed_status
    from hetnode.service.lifecycle import release_signals, stop_on_signals

    stop = stop_on_signals()
    try:
        started = time.monotonic()
        if is_url(peer) and (served := await read_served_status(peer, timeout_s, stop)) is not None:
            return served
        signed_s = min(SIGNED_STATUS_TIMEOUT_S, timeout_s / 2)
        if not is_url(peer) and (
            signed := await read_signed_status(peer, coordinator_http_port, signed_s, stop)
        ):
            return signed
        from hetnode.daemon.peer_address import resolve_peer
        from hetnode.daemon.status import query_status  # hivemind and torch: only for the DHT read

        # asked once: a status query does not wait for a coordinator to start, whichever form --peer takes
        maddr = await resolve_peer(peer, timeout_s, stop, retry=False, flag="--timeout")
        left = max(1.0, timeout_s - (time.monotonic() - started))
        return await query_status(maddr, left, listen, stop)
    finally:
        release_signals()
