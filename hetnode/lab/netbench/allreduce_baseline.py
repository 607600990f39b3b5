"""Baseline for the network benchmark: hivemind's own dense all-reduce of a model-sized set of tensors.

Our sparse sync is judged against what a plain hivemind swarm would do with the same link: a
`DecentralizedAverager` butterfly all-reduce of every fp32 element, sent as fp16 (`Float16Compression`).
Each copy of this module is one peer (its own host or its own network namespace); all copies form one
group every round. Per round it records the wall time of the averaging step (matchmaking included, and
matchmaking on its own), the bytes the named interface sent and received during the step, and whether
the tensors came back as the mean over the group (every peer's values are a known function of
(seed, index, round), so each peer can recompute the exact mean on its own). hivemind's all-reduce now and
then stalls or returns a partial mean on a loaded machine; the peers then agree (through the DHT) to run
the round again, up to `--attempts` times, and every failed attempt is kept in the report.

    python -m hetnode.lab.netbench.allreduce_baseline --index 0 --group-size 3 --numel 1000000 --out a.json
    python -m hetnode.lab.netbench.allreduce_baseline --index 1 --group-size 3 ... --initial-peer /ip4/...
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression
from hivemind.utils import get_dht_time

PREFIX = "hetnode_allreduce_baseline"
# An embedding, six block matrices (in sixteenths of numel) and two norm vectors: the shape of a small
# decoder, so the all-reduce sees several parts of different sizes, as it would with a real model.
MATRIX_SHARES = (4, 2, 2, 2, 2, 2, 2)
MIN_NUMEL = 1024
# fp16 rounds each value on the way to its reducer and the delta on the way back: for N(0, 1) values
# (|x| < ~6, fp16 half-ulp < 0.002 there) the result is within ~0.006 of the exact mean. A wrong mean
# (a missing or doubled peer) is off by O(1), so this tolerance separates the two with a wide margin.
ATOL = 0.02
BARRIER_POLL_S = 0.05
STAGE_POLL_S = 0.002


@dataclass
class RoundResult:
    round: int
    seconds: float | None = None
    matchmaking_seconds: float | None = None
    allreduce_seconds: float | None = None
    tx_bytes: int | None = None
    rx_bytes: int | None = None
    group_size_seen: int | None = None
    max_abs_error: float | None = None
    ok: bool = False
    error: str | None = None
    peer_indexes: list[int] = field(default_factory=list)
    attempt: int = 0
    failed_attempts: list[str] = field(default_factory=list)


def tensor_sizes(numel: int) -> list[int]:
    """Split `numel` into model-like tensor sizes that add up to exactly `numel` (same on every peer)."""
    if numel < MIN_NUMEL:
        raise ValueError(f"numel must be at least {MIN_NUMEL}, got {numel}")
    norm = min(4096, numel // 512)
    matrices = numel - 2 * norm
    sizes = [matrices * share // sum(MATRIX_SHARES) for share in MATRIX_SHARES]
    sizes[-1] += matrices - sum(sizes)  # the last matrix takes the rounding remainder
    return [*sizes, norm, norm]


def theory_bytes_per_peer(numel: int, group_size: int) -> float:
    """fp16 butterfly all-reduce: each peer sends (n-1)/n of its vector out and (n-1)/n of results back."""
    return 2 * (group_size - 1) / group_size * numel * 2


def peer_values(sizes: Sequence[int], seed: int, index: int, round_no: int) -> list[torch.Tensor]:
    """The values peer `index` averages in round `round_no`: N(0, 1), reproducible from anywhere."""
    mixed = int(np.random.SeedSequence([seed, index, round_no]).generate_state(1, dtype=np.uint64)[0])
    generator = torch.Generator().manual_seed(mixed & (2**63 - 1))
    return [torch.randn(size, generator=generator) for size in sizes]


def expected_mean(
    sizes: Sequence[int], seed: int, indexes: Sequence[int], round_no: int
) -> list[torch.Tensor]:
    """The exact mean over the given peers, rebuilt one peer at a time so memory stays at two copies."""
    totals = [torch.zeros(size) for size in sizes]
    for index in indexes:
        for total, values in zip(totals, peer_values(sizes, seed, index, round_no), strict=True):
            total += values
    return [total / len(indexes) for total in totals]


def read_interface_bytes(interface: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `interface` from /proc/net/dev (which shows this network namespace only)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            fields = counters.split()
            return int(fields[8]), int(fields[0])
    raise ValueError(f"interface {interface!r} is not in /proc/net/dev")


def barrier(
    dht: DHT, name: str, index: int, count: int, timeout: float, value: bool = True
) -> dict[int, bool]:
    """Wait until all `count` peers have reached the barrier called `name`; returns each peer's `value`.

    Before each round: without it, a peer's round would be timed from when it arrived, including the
    time it waited for a slower peer to start up or to finish the previous round. After each attempt:
    the values say whether every peer got the right mean, so all of them retry or go on together.
    After the last round: a peer's step returns once its own results are in, possibly before its
    reducer has streamed the last results to slower peers; shutting down then would cut those streams
    (the slower peer keeps its own values for the missing parts, and hivemind only logs a warning).
    """
    key = f"{PREFIX}_barrier_{name}"
    deadline = time.monotonic() + timeout
    arrived: dict[int, bool] = {}
    while True:
        if index not in arrived:
            # (re)announce until we see ourselves: a store that reached no replica must not hang everyone.
            # The entry outlives the slowest peer's wait; a fresh DHT per benchmark run has no stale keys.
            dht.store(key, value, get_dht_time() + timeout + 60, subkey=index)
        found = dht.get(key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        arrived = {int(peer): bool(entry.value) for peer, entry in entries.items()}
        if len(arrived) >= count:
            return arrived
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(arrived)} of {count} peers reached the barrier in {timeout:.0f}s")
        time.sleep(BARRIER_POLL_S)


def run_round(
    averager: DecentralizedAverager,
    args: argparse.Namespace,
    sizes: Sequence[int],
    round_no: int,
    attempt: int = 0,
) -> RoundResult:
    """One timed averaging step on fresh values, then the check against the exact mean."""
    result = RoundResult(round=round_no, attempt=attempt)
    with averager.get_tensors() as tensors:
        # in place: the averager process sees these tensors through shared memory
        for tensor, values in zip(tensors, peer_values(sizes, args.seed, args.index, round_no), strict=True):
            tensor.copy_(values)
    try:
        barrier(averager.dht, f"round{round_no}.{attempt}", args.index, args.count, args.barrier_timeout)
    except TimeoutError as e:
        result.error = str(e)
        return result

    before = read_interface_bytes(args.interface) if args.interface else None
    started = time.perf_counter()
    control = averager.step(gather={"index": args.index}, timeout=args.timeout, wait=False)
    # the stage flag lives in shared memory: polling it splits matchmaking from the all-reduce for free
    hard_deadline = started + 2 * args.timeout + 10
    while not control.began_allreduce and not control.done() and time.perf_counter() < hard_deadline:
        time.sleep(STAGE_POLL_S)
    grouped_at = time.perf_counter()
    try:
        gathered = control.result(timeout=max(0.0, hard_deadline - time.perf_counter()))
    except Exception as e:  # hivemind raises assorted types (timeout, matchmaking, p2p); each fails the round
        control.cancel()
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if not control.began_allreduce:
            result.error = f"no group of {args.group_size} formed within {args.timeout:g}s ({result.error})"
        return result
    finished = time.perf_counter()
    after = read_interface_bytes(args.interface) if args.interface else None

    result.seconds = finished - started
    if control.began_allreduce:
        result.matchmaking_seconds = grouped_at - started
        result.allreduce_seconds = finished - grouped_at
    if before is not None and after is not None:
        result.tx_bytes, result.rx_bytes = after[0] - before[0], after[1] - before[1]
    if gathered is None:
        result.error = "step returned no group"
        return result
    result.group_size_seen = len(gathered)
    result.peer_indexes = sorted(int(data["index"]) for data in gathered.values())
    result.ok = result.group_size_seen == args.group_size
    if args.verify:
        expected = expected_mean(sizes, args.seed, result.peer_indexes, round_no)
        with averager.get_tensors() as tensors:
            errors = [(t - e).abs().max().item() for t, e in zip(tensors, expected, strict=True)]
        result.max_abs_error = max(errors)
        result.ok = result.ok and result.max_abs_error <= ATOL
        if result.max_abs_error > ATOL:
            result.error = f"averaged tensors are off the mean by up to {result.max_abs_error:.4f}"
    return result


def run_agreed_round(
    averager: DecentralizedAverager, args: argparse.Namespace, sizes: Sequence[int], round_no: int
) -> RoundResult:
    """Run round `round_no` until every peer got the right mean, at most `args.attempts` times.

    All peers must retry together (a peer that retries alone finds no group), so after each attempt
    they post whether theirs was right and read everyone's answer. The result of the last attempt is
    returned, with the errors of the failed ones before it.
    """
    failed: list[str] = []
    for attempt in range(args.attempts):
        result = run_round(averager, args, sizes, round_no, attempt)
        result.failed_attempts = list(failed)
        try:
            outcomes = barrier(
                averager.dht,
                f"round{round_no}.{attempt}.outcome",
                args.index,
                args.count,
                args.barrier_timeout,
                value=result.ok,
            )
        except TimeoutError as e:  # a peer is gone: no retry can form the group again
            result.ok = False
            result.error = result.error or f"after the step: {e}"
            return result
        if all(outcomes.values()):
            return result  # a peer with a wrong mean makes everyone retry, so this one's ok is final
        wrong = sorted(peer for peer, ok in outcomes.items() if not ok)
        result.ok = False
        result.error = result.error or f"peers {wrong} got a wrong or no result"
        failed.append(f"attempt {attempt}: {result.error}")
        print(f"round {round_no} attempt {attempt} failed: {result.error}", file=sys.stderr, flush=True)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hetnode.lab.netbench.allreduce_baseline",
        description="Time hivemind's fp16 butterfly all-reduce of a model-sized vector, one peer a process.",
    )
    parser.add_argument("--listen", default="127.0.0.1", help="IP to bind (/ip4/IP/tcp/0)")
    parser.add_argument("--initial-peer", help="multiaddr of the first instance (omit on the first one)")
    parser.add_argument("--group-size", type=int, required=True, help="peers per all-reduce group")
    parser.add_argument("--index", type=int, default=0, help="this instance's index, 0..count-1")
    parser.add_argument(
        "--count", type=int, help="number of instances (default and only value: --group-size)"
    )
    parser.add_argument("--numel", type=int, required=True, help="fp32 elements to average")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--attempts", type=int, default=2, help="tries per round when a peer's step fails or comes back wrong"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interface", help="interface whose /proc/net/dev byte counters to report per round")
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a step may spend finding its group, and again running the all-reduce",
    )
    parser.add_argument(
        "--matchmaking-time",
        type=float,
        default=5.0,
        help="hivemind min_matchmaking_time: how long a leader waits for a full group before trying again",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=3.0, help="hivemind matchmaking request_timeout"
    )
    parser.add_argument(
        "--barrier-timeout", type=float, default=120.0, help="seconds to wait for all peers before a round"
    )
    parser.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=True, help="check the result is the mean"
    )
    args = parser.parse_args(argv)
    if args.count is None:
        args.count = args.group_size
    if args.group_size < 2:
        parser.error("--group-size must be at least 2")
    if args.count != args.group_size:
        parser.error("--count must equal --group-size: the baseline measures one group of all instances")
    if not 0 <= args.index < args.count:
        parser.error(f"--index must be in 0..{args.count - 1}")
    if args.numel < MIN_NUMEL:
        parser.error(f"--numel must be at least {MIN_NUMEL}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.attempts < 1:
        parser.error("--attempts must be at least 1")
    if not args.request_timeout < args.matchmaking_time < args.timeout:
        # hivemind asserts that the scheduled time fits in the step timeout, and warns of deadlocks when
        # request_timeout >= min_matchmaking_time
        parser.error("need --request-timeout < --matchmaking-time < --timeout")
    if args.interface:
        try:
            read_interface_bytes(args.interface)
        except ValueError as e:
            parser.error(str(e))
    return args


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON result before any round: what was measured and the butterfly volume to compare against."""
    return {
        "numel": args.numel,
        "group_size": args.group_size,
        "index": args.index,
        "tensor_sizes": tensor_sizes(args.numel),
        "compression": "float16",
        "interface": args.interface,
        "theory_bytes_per_peer": theory_bytes_per_peer(args.numel, args.group_size),
        "rounds": [],
    }


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Start a DHT peer and an averager, run the rounds into `report`, shut both down."""
    sizes = report["tensor_sizes"]
    dht = averager = None
    try:
        initial_peers = [args.initial_peer] if args.initial_peer else []
        dht = DHT(initial_peers=initial_peers, host_maddrs=[f"/ip4/{args.listen}/tcp/0"], start=True)
        averager = DecentralizedAverager(
            [torch.zeros(size) for size in sizes],
            dht,
            start=True,
            prefix=PREFIX,
            # target == min: the leader begins as soon as all N have joined, and never with fewer
            # (a smaller group would disband and retry until the step timeout instead)
            target_group_size=args.group_size,
            min_group_size=args.group_size,
            min_matchmaking_time=args.matchmaking_time,
            request_timeout=args.request_timeout,
            allreduce_timeout=args.timeout,
            compression=Float16Compression(),
            # no state-sharing declarations: they would add DHT traffic to the measured bytes
            allow_state_sharing=False,
        )
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        maddrs.sort(key=lambda m: f"/ip4/{args.listen}/" not in m)  # the address we bound comes first
        report["peer_id"] = str(dht.peer_id)
        print("READY " + " ".join(maddrs), flush=True)

        for round_no in range(args.rounds):
            result = run_agreed_round(averager, args, sizes, round_no)
            report["rounds"].append(asdict(result))
            print(f"round {round_no}: {json.dumps(asdict(result))}", file=sys.stderr, flush=True)
            if not result.ok:
                break  # every attempt failed: the peers may be out of step, later rounds cannot pair up
        else:
            try:
                barrier(dht, "done", args.index, args.count, args.barrier_timeout)
            except TimeoutError as e:  # every round is recorded already; a peer gone now only costs a wait
                print(f"allreduce_baseline: final barrier: {e}", file=sys.stderr, flush=True)
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through `finally`, so the averager, the DHT and their p2pd still get shut down
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report = new_report(args)
    try:
        run(args, report)
    except Exception as e:  # a failure to start (bad initial peer, p2pd) or to reach the DHT: one clear line
        print(f"allreduce_baseline: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        # written on failure too, so an orchestrator sees how far each peer got
        args.out.write_text(json.dumps(report, indent=2))
    rounds = report["rounds"]
    failed = [r for r in rounds if not r["ok"]]
    if len(rounds) < args.rounds or failed:
        first = failed[0] if failed else rounds[-1]
        print(
            f"allreduce_baseline: failed: {len(rounds) - len(failed)} of {args.rounds} rounds ok;"
            f" round {first['round']}: {first['error'] or 'group of ' + str(first['group_size_seen'])}",
            file=sys.stderr,
        )
        return 1
    mean_s = math.fsum(r["seconds"] for r in rounds) / len(rounds)
    print(f"allreduce_baseline: {len(rounds)} rounds ok, mean {mean_s:.3f}s per step", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
