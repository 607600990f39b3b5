"""`hetnode bench trust`: what verification buys against useless or harmful work (docs/security.md, "Send
useless or harmful work"), in process.

It lives in the lab wing, which may import both sides it measures: the coordinator's code
(`bootstrap/verifier.py`) and the replicas' (`hetnode/daemon/rounds.py`).

Per fault mode, R honest anchors and one attacker train the same model for the same rounds, with and
without the coordinator's verifier (`bootstrap/verifier.py`, the code the coordinator runs); a clean run
(honest anchors only, verified) is the yardstick. Each round goes as in the swarm: every replica trains H
steps from θ, the verifier screens the contributions in arrival order (the attacker last: a copier needs its
victim's payload first), the rest are aggregated and stepped all or nothing (`GlobalModel`), and the
verifier scores the round's contributions on θ before the step (a copy of it, kept for the purpose).

The coordinator scores beside the seal (`bootstrap/bookkeeping.py`): a round's score reaches the
averages that the screens read only once its worker is done with it. The bench models that lag as
`score_lag` sealed rounds (default 1: round t is scored after round t+1 was sealed, so the screen of round
t+2 is the first to know it; 0 is the order of before the worker). Reported per mode: eval loss per round,
rounds until the attacker had no weight (out of every later seal), until it had no credit either, the
rounds it had weight in, false exclusions of honest replicas, and the verifier's time as a share of the
round (a replica's training time: replicas train in parallel, the verifier while they do).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bootstrap.verifier import Replica, Verifier  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.daemon.faults.factory import faults_named  # noqa: E402
from hetnode.daemon.rounds import AnchorTraining  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.planning.rounds import data_slot  # noqa: E402
from hetnode.protocol.sealing import paced_weights, verified_steps  # noqa: E402
from hetnode.replica.global_model import ApplyError, GlobalModel, base_fixed_embedding  # noqa: E402
from hetnode.training.faults import WORK_FAULTS  # noqa: E402

log = logging.getLogger(__name__)

ATTACKER = "peer-xx"  # the same length as the honest ids: a copier re-labels bytes in place
SCORE_LAG = 1  # sealed rounds between a round's seal and its score reaching the averages


@dataclass(frozen=True)
class TrustPlan:
    honest: int
    rounds: int
    inner_steps: int | None  # None: the config's H
    modes: tuple[str, ...]
    batch_size: int | None = None  # None: the config's
    score_lag: int = SCORE_LAG
    # paced rounds at mixed speeds: each honest replica's steps per round as a share of H (cycled), the
    # attacker at H; the seal counts verified steps and weighs by them as the sealer does (empty: H each)
    speeds: tuple[float, ...] = ()


def plan_for(
    quick: bool,
    rounds: int | None = None,
    modes: tuple[str, ...] = (),
    inner_steps: int | None = None,
    score_lag: int = SCORE_LAG,
    speeds: tuple[float, ...] = (),
) -> TrustPlan:
    unknown = sorted(set(modes) - set(WORK_FAULTS))
    if unknown:
        raise ValueError(f"unknown fault modes {unknown}; choose from {list(WORK_FAULTS)}")
    if inner_steps is not None and inner_steps < 1:
        raise ValueError(f"--inner-steps must be >= 1, got {inner_steps}")
    if score_lag < 0:
        raise ValueError(f"--score-lag must be >= 0, got {score_lag}")
    if not all(0 < x <= 2 for x in speeds):
        raise ValueError(f"--speeds must each be in (0, 2] (a share of H, up to the cap 2H), got {speeds}")
    if quick:  # 13 runs of 5 replicas: small batches keep it to minutes on two cores
        return TrustPlan(4, rounds or 6, inner_steps or 5, modes or WORK_FAULTS, 4, score_lag, speeds)
    return TrustPlan(4, rounds or 10, inner_steps, modes or WORK_FAULTS, score_lag=score_lag, speeds=speeds)


def steps_of(config: Config, plan: TrustPlan, peers: list[str]) -> dict[str, int] | None:
    """Paced: each replica's inner steps per round (the attacker, last, at H); None: H each."""
    if not plan.speeds:
        return None
    o = config.outer
    honest = [p for p in peers if p != ATTACKER]
    shares = {p: plan.speeds[i % len(plan.speeds)] for i, p in enumerate(honest)} | {ATTACKER: 1.0}
    return {p: min(o.step_cap, max(o.step_floor, round(o.inner_steps * shares[p]))) for p in peers}


@dataclass
class RunResult:
    losses: list[float]
    rejected: list[dict[str, str]]  # per round: peer -> reason (weight refused: left out of the seal)
    verify_seconds: list[float]
    train_seconds: list[float]  # per round: the slowest replica's training
    uncredited: list[dict[str, str]] = field(default_factory=list)  # per round: sealed, credit refused
    counted: list[dict[str, int]] = field(default_factory=list)  # paced, per round: steps the seal counted
    steps: dict[str, int] = field(default_factory=dict)  # paced: the steps each replica trains and claims


@dataclass
class _Unscored:
    """A sealed round waiting for its score, with θ before its step (the worker's copy)."""

    round: int
    theta_before: dict[str, torch.Tensor]
    scorable: list
    sealed: list[str]
    rejected: dict[str, str]


def run_one(
    config: Config,
    dataset: TokenDataset,
    model: torch.nn.Module,
    plan: TrustPlan,
    fault: str | None,
    verify: bool,
) -> RunResult:
    honest = [f"peer-h{i}" for i in range(plan.honest)]
    peers = honest + ([ATTACKER] if fault else [])
    theta = GlobalModel(config)
    faults = {p: faults_named(fault if p == ATTACKER else None) for p in peers}
    trainers = {p: AnchorTraining(config, dataset, p, faults=faults[p]) for p in peers}
    verifier = Verifier(config, dataset, model) if verify else None
    replicas = {p: Replica(p, data_slot(p)) for p in peers}
    eval_batches = dataset.eval_batches(config.train.eval_batches)
    result = RunResult([], [], [], [], [])
    waiting: deque[_Unscored] = deque()

    def score_next() -> float:
        """Score the oldest round waiting, as the worker does: on θ before its step; its seconds."""
        work = waiting.popleft()
        started = time.perf_counter()
        scores = verifier.score(work.round, work.theta_before, work.scorable, replicas, steps)
        seconds = time.perf_counter() - started
        for v in verifier.verdicts(work.round, work.sealed, work.rejected, scores):
            if v.reason is not None and v.peer not in work.rejected:
                result.uncredited[work.round][v.peer] = v.reason
        return seconds

    steps = steps_of(config, plan, peers)
    result.steps = steps or {}
    for round_ in range(plan.rounds):
        payloads, slowest = {}, 0.0
        for peer in peers:
            started = time.perf_counter()
            source = faults[peer].train_from(theta)  # a stale attacker's: θ rounds old
            payloads[peer] = trainers[peer].run_round(round_, source, steps and steps[peer])
            slowest = max(slowest, time.perf_counter() - started)
        if fault == "copy":  # honest peer-h0's payload under the attacker's name
            payloads[ATTACKER] = {
                shard: data.replace(honest[0].encode(), ATTACKER.encode())
                for shard, data in payloads[honest[0]].items()
            }
        contributions = [(p, theta.decode_contribution(p, round_, payloads[p])) for p in peers]
        started = time.perf_counter()
        # arrival order: the attacker last (a copier needs its victim's payload first)
        seen = {p: float(i) for i, (p, _) in enumerate(contributions)}
        rejected = verifier.screen(round_, contributions, seen, steps) if verifier else {}
        verify_s = time.perf_counter() - started
        sealed = [(p, d) for p, d in contributions if p not in rejected]
        weights = verifier.weights([p for p, _ in sealed]) if verifier else None
        if steps is not None:  # as the sealer: steps only as far as the update shows them, weight by them
            earned = weights or dict.fromkeys((p for p, _ in sealed), 1)
            updates = {p: {n: v for m in d for n, v in m.sparse.items()} for p, d in sealed}
            counted = verified_steps(config, round_, updates, {p: steps[p] for p in updates}, earned)
            weights = paced_weights(config, earned, counted)
            result.counted.append(counted)
        try:
            prepared = theta.prepare(round_, sealed, weights)
        except ApplyError:  # as the sealer does: whoever alone makes the step non-finite is out
            culprits = set()
            for p, d in sealed:
                try:
                    theta.prepare(round_, [(p, d)])
                except ApplyError:
                    culprits.add(p)
            rejected |= dict.fromkeys(culprits, "finite")
            sealed = [(p, d) for p, d in sealed if p not in culprits]
            prepared = theta.prepare(round_, sealed, weights)
        result.uncredited.append({})
        if verifier:
            scorable = [(p, d) for p, d in contributions if rejected.get(p) not in ("stale", "copy")]
            before = {name: t.clone() for name, t in theta.params.items()}
            waiting.append(_Unscored(round_, before, scorable, [p for p, _ in sealed], dict(rejected)))
        theta.commit(prepared)
        for peer in peers:
            if peer not in {p for p, _ in sealed}:
                trainers[peer].restore_unsent()
        while verifier and waiting and waiting[0].round <= round_ - plan.score_lag:
            verify_s += score_next()  # the rounds whose score the next seal knows
        result.losses.append(eval_loss(model, theta, eval_batches))
        result.rejected.append(rejected)
        result.verify_seconds.append(verify_s if verifier else 0.0)
        result.train_seconds.append(slowest)
    while verifier and waiting:  # the last rounds' scores, for their credit
        result.verify_seconds[-1] += score_next()
    return result


@torch.no_grad()
def eval_loss(model: torch.nn.Module, theta: GlobalModel, batches: list) -> float:
    """Eval loss of θ as `theta` holds it, through `model` (its weights are overwritten)."""
    for name, param in model.named_parameters():
        param.copy_(theta.params[name])
    model.eval()
    return sum(float(model.loss(x, y)) for x, y in batches) / len(batches)


def rounds_to_exclusion(run: RunResult) -> int | None:
    """The round (1-based) from which the attacker had no weight in any seal; None if it kept weight."""
    for start in range(len(run.rejected)):
        if all(ATTACKER in r for r in run.rejected[start:]):
            return start + 1
    return None


def rounds_to_no_credit(run: RunResult) -> int | None:
    """The round (1-based) from which the attacker was credited for nothing; None if it kept credit."""
    refused = [
        {**r, **u} for r, u in zip(run.rejected, run.uncredited or [{}] * len(run.rejected), strict=True)
    ]
    for start in range(len(refused)):
        if all(ATTACKER in r for r in refused[start:]):
            return start + 1
    return None


def rounds_with_weight(run: RunResult) -> int:
    """Rounds whose seal held the attacker's work."""
    return sum(1 for r in run.rejected if ATTACKER not in r)


def steps_counted(run: RunResult) -> float | None:
    """Paced: the least share of its steps any honest sealed contribution was counted (1: all, always)."""
    shares = [n / run.steps[p] for r in run.counted for p, n in r.items() if p != ATTACKER]
    return min(shares, default=None)


def false_exclusions(run: RunResult) -> int:
    """Honest contributions left out of a seal or refused credit."""
    refused = [*run.rejected, *run.uncredited]
    return sum(1 for r in refused for peer in r if peer != ATTACKER)


def run_benchmark(config: Config, plan: TrustPlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.inner_steps is not None:
        config = replace(config, "outer", inner_steps=plan.inner_steps)
    if plan.batch_size is not None:
        config = replace(config, "data", batch_size=plan.batch_size)
    if plan.speeds:  # mixed speeds: paced rounds, each replica its own steps
        H = config.outer.inner_steps
        config = replace(config, "outer", schedule="paced", min_inner_steps=1, max_inner_steps=2 * H)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    runs = [(None, True)] + [(mode, verify) for mode in plan.modes for verify in (False, True)]
    results: dict[str, RunResult] = {}
    with tqdm(total=len(runs), desc="trust bench", unit="run", disable=not progress) as bar:
        for mode, verify in runs:
            key = "clean" if mode is None else f"{mode}-{'verified' if verify else 'unverified'}"
            bar.set_postfix(run=key)
            results[key] = run_one(config, dataset, model, plan, mode, verify)
            log.info("%s: eval loss %s", key, " ".join(f"{x:.3f}" for x in results[key].losses))
            bar.update(1)
    clean = results["clean"]
    report: dict = {
        "config": config.run.name,
        "honest": plan.honest,
        "rounds": plan.rounds,
        "inner_steps": config.outer.inner_steps,
        "score_lag": plan.score_lag,
        "speeds": list(plan.speeds),
        "steps": steps_of(config, plan, [f"peer-h{i}" for i in range(plan.honest)] + [ATTACKER]),
        "final_eval_loss_clean": clean.losses[-1],
        "false_exclusions_clean": false_exclusions(clean),
        "honest_steps_counted_clean": steps_counted(clean),
        "verify_share_clean": _share(clean),
        "modes": {},
        "curves": {key: run.losses for key, run in results.items()},
    }
    for mode in plan.modes:
        verified, unverified = results[f"{mode}-verified"], results[f"{mode}-unverified"]
        report["modes"][mode] = {
            "rounds_to_exclusion": rounds_to_exclusion(verified),
            "rounds_to_no_credit": rounds_to_no_credit(verified),
            "rounds_with_weight": rounds_with_weight(verified),
            "final_eval_loss": verified.losses[-1],
            "final_eval_loss_unverified": unverified.losses[-1],
            "final_eval_loss_clean": clean.losses[-1],
            "loss_vs_clean": verified.losses[-1] / clean.losses[-1] - 1,
            "loss_vs_clean_unverified": unverified.losses[-1] / clean.losses[-1] - 1,
            "false_exclusions": false_exclusions(verified),
            "honest_steps_counted": steps_counted(verified),
            "verify_share": _share(verified),
            "reasons": sorted(
                {r[ATTACKER] for r in [*verified.rejected, *verified.uncredited] if ATTACKER in r}
            ),
        }
    (out_dir / "trust.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "trust.png")
    return report


def _share(run: RunResult) -> float:
    return sum(run.verify_seconds) / max(sum(run.train_seconds), 1e-9)


def plot(report: dict, path: Path) -> None:
    modes = list(report["modes"])
    cols = min(3, len(modes)) or 1
    rows = (len(modes) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    curves = report["curves"]
    for ax, mode in zip(axes.flat, modes, strict=False):
        ax.plot(curves["clean"], "k-", label="clean")
        ax.plot(curves[f"{mode}-unverified"], "r--", label="attacked, unverified")
        ax.plot(curves[f"{mode}-verified"], "g-", label="attacked, verified")
        r = report["modes"][mode]
        out = f"out from round {r['rounds_to_exclusion']}" if r["rounds_to_exclusion"] else "never out"
        ax.set_title(f"{mode} (weight in {r['rounds_with_weight']} rounds, {out})", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(modes) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"{report['config']}: {report['honest']} honest + 1 attacker, H={report['inner_steps']}, "
        f"scores {report['score_lag']} round(s) behind the seal",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
