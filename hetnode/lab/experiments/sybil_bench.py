"""`hetnode bench trust --sybil`: attacks by many free identities against the coordinator's own code, in
process (docs/security.md, "Send useless or harmful work", issue 34; `trust_bench.py` beside it measures the
single-attacker fault modes).

Each scenario: R honest anchors train alone for `history` rounds (they earn their weight), then the
attackers join and every round goes as the coordinator runs it: the verifier screens the contributions
(arrival order: honest first, attackers last), weighs the sealed ones (`Verifier.weights`), rescues a
round it would leave empty (`Verifier.helps`), θ steps by the weighted aggregate (`GlobalModel.prepare`),
the ledger's credit rule credits by weight (`credit_round`), and the verifier scores each round
`score_lag` sealed rounds later, as the bookkeeping worker does. A clean run (honest only) is the
yardstick. Scenarios:
- duplicates: K identities that trained honestly through the history then send one training re-signed
  K times, each copy with ~12 % of its top-k positions moved (one credit per training?);
- majority: five fresh Sybils each send a small honest-direction update (one training / 64, positions
  perturbed): they would be the median of every statistic counted by headcount;
- rotation / fixed: sign-flipped work from a new identity every 2 rounds, against one fixed identity;
Scenarios can also run together (`run_scenario` with a set: the tests do, to keep CI short).
- predictable: an established replica that sends sign-flipped work in the round after it learns it was
  scored (verdicts are published), honest work otherwise, with a scoring sample smaller than the swarm;
- framing: a chain of two stages beside the anchors whose downstream stage negates its payload from the
  end of the history on: does its honest upstream neighbour keep its weight and credit?
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bootstrap.ledger import credit_round
from bootstrap.verifier import Replica, Verifier
from hetnode.config import Config, replace
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.lab.experiments.sybil_payloads import negated, perturbed, relabelled, scaled
from hetnode.lab.experiments.trust_bench import eval_loss
from hetnode.model.decoder import build_model
from hetnode.planning.rounds import data_slot, replica_tokens, shard_order
from hetnode.protocol.seal_screening import RESCUABLE
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.wire.sync_payload import DecodedPayload

log = logging.getLogger(__name__)

SCENARIOS = ("duplicates", "majority", "rotation", "fixed", "predictable", "framing")
COPIES = 4  # identities behind one training in "duplicates"
SYBILS = 5  # identities in "majority"
MOVED = 0.12  # share of top-k positions a Sybil moves to pass a copy screen
SMALL = 1 / 64  # "majority": the Sybils' update against one honest training
ROTATE_EVERY = 2  # rounds an identity lives in "rotation"
CHAIN = "chain-c0"


@dataclass(frozen=True)
class SybilPlan:
    honest: int = 4
    history: int = 10  # rounds the honest train alone before the attackers join
    attack_rounds: int = 8
    inner_steps: int = 5
    batch_size: int = 4
    probation_rounds: int | None = None  # None: the config's
    score_lag: int = 1
    scenarios: tuple[str, ...] = SCENARIOS
    eval_every_round: bool = True  # False: only after the last round (tests)
    seq_len: int | None = None  # None: the config's
    eval_batches: int | None = None  # None: the config's
    draws: int = 4  # "predictable": sets of verifier draws it runs under (it is caught by chance)

    @property
    def rounds(self) -> int:
        return self.history + self.attack_rounds


@dataclass
class RoundLog:
    sealed: dict[str, int]  # peer -> weight
    rejected: dict[str, str]
    credit: dict[str, int] = field(default_factory=dict)  # peer -> tokens credited (after its score)
    harmful: set[str] = field(default_factory=set)  # attacker identities that sent harmful work
    scored: set[str] = field(default_factory=set)
    eval_loss: float = math.nan


@dataclass
class _Pending:
    round: int
    theta: dict[str, torch.Tensor]
    scorable: list[tuple[str, list[DecodedPayload]]]
    replicas: dict[str, Replica]
    log: RoundLog
    credits: dict[str, int]


ATTACKERS = {  # each scenario's identities, by prefix (so that scenarios can also run together)
    "duplicates": "dup-",
    "majority": "sybil-",
    "rotation": "rot-",
    "fixed": "fix-",
    "predictable": "sly",
    "framing": "stage-down",
}


def run_scenario(
    config: Config,
    dataset: TokenDataset,
    model: torch.nn.Module,
    plan: SybilPlan,
    scenario: str | None | frozenset[str],
    strike: bool = True,
    draw: int = 0,
) -> list[RoundLog]:
    """The rounds of one scenario (None: the clean run; a set: those scenarios at once). Round logs carry
    what was sealed, with which weight, what was left out and why, the credit each peer got and the eval
    loss after the round. `strike=False`: the "predictable" replica stays honest (its clean run);
    `draw`: which of the bench's fixed verifier secrets (the same draws in the runs compared)."""
    attacks = (
        frozenset() if scenario is None else frozenset({scenario} if isinstance(scenario, str) else scenario)
    )
    honest = [f"honest-{i}" for i in range(plan.honest)]
    anchors = list(honest)
    if "duplicates" in attacks:
        anchors += [f"dup-{i}" for i in range(COPIES)]
    if "predictable" in attacks:
        anchors.append("sly")
    stages = ["stage-up", "stage-down"]  # a chain beside the anchors in every run; it lies in "framing"
    trainers = {peer: AnchorTraining(config, dataset, peer) for peer in anchors}
    trainers[CHAIN] = AnchorTraining(config, dataset, CHAIN)  # the chain's update, split by stage
    theta = GlobalModel(config)
    # the same draws in the runs compared: a scenario and its clean run differ by the attack alone
    verifier = Verifier(config, dataset, model, secret=f"sybil-bench-{config.run.seed}-{draw}".encode())
    schedule = replica_tokens(config)
    sizes = [(s, theta.dense_bytes([s]) // 4) for s in shard_order(config.model.n_layers)]
    half = len(sizes) // 2
    up_shards = {s for s, _ in sizes[:half]}
    eval_batches = dataset.eval_batches(plan.eval_batches or config.train.eval_batches)
    gen = torch.Generator().manual_seed(config.run.seed)
    numels = {name: t.numel() for name, t in theta.params.items()}
    logs: list[RoundLog] = []
    waiting: deque[_Pending] = deque()
    last_scored: dict[str, int] = {}
    identity = 0

    def score(pending: _Pending) -> None:
        scores = verifier.score(pending.round, pending.theta, pending.scorable, pending.replicas)
        pending.log.scored = set(scores)
        for peer in scores:
            last_scored[peer] = pending.round
        for v in verifier.verdicts(pending.round, list(pending.log.sealed), pending.log.rejected, scores):
            if v.reason is None and v.peer in pending.credits:
                pending.log.credit[v.peer] = pending.credits[v.peer]

    for round_ in range(plan.rounds):
        attacking = round_ >= plan.history
        contributions: list[tuple[str, list[DecodedPayload]]] = []
        replicas: dict[str, Replica] = {}
        harmful: set[str] = set()
        trained = {CHAIN}
        for peer in anchors:
            if peer.startswith("dup-") and attacking and peer != "dup-0":
                continue  # one training only from now on: dup-0's, re-signed below
            decoded = theta.decode_contribution(peer, round_, trainers[peer].run_round(round_, theta))
            trained.add(peer)
            if (
                strike
                and peer == "sly"
                and attacking
                and last_scored.get("sly") == round_ - 1 - plan.score_lag
            ):
                decoded = negated(decoded)  # it was scored last time it could see: now it strikes
                harmful.add(peer)
            contributions.append((peer, decoded))
            replicas[peer] = Replica(peer, data_slot(peer))
        if "duplicates" in attacks and attacking:
            original = dict(contributions)["dup-0"]
            for i in range(1, COPIES):
                contributions.append((f"dup-{i}", perturbed(original, f"dup-{i}", MOVED, gen, numels)))
                replicas[f"dup-{i}"] = Replica(f"dup-{i}", data_slot(f"dup-{i}"))
        whole = theta.decode_contribution(CHAIN, round_, trainers[CHAIN].run_round(round_, theta))
        up = relabelled([m for m in whole if m.shard in up_shards], "stage-up")
        down = relabelled([m for m in whole if m.shard not in up_shards], "stage-down")
        if "framing" in attacks and attacking:
            down = negated(down)
            harmful.add("stage-down")
        contributions += [("stage-up", up), ("stage-down", down)]
        replicas |= {peer: Replica(CHAIN, data_slot(CHAIN)) for peer in stages}
        if "majority" in attacks and attacking:
            source = dict(contributions)[honest[0]]  # the worst case: it saw an honest payload
            for i in range(SYBILS):
                peer = f"sybil-{i}"
                small = [dataclasses.replace(m, sparse=scaled(m.sparse, SMALL)) for m in source]
                contributions.append((peer, perturbed(small, peer, MOVED, gen, numels)))
                replicas[peer] = Replica(peer, data_slot(peer))
        for flipper in ("rotation", "fixed"):
            if flipper not in attacks or not attacking:
                continue
            if flipper == "rotation" and (round_ - plan.history) % ROTATE_EVERY == 0:
                identity += 1
            peer = f"rot-{identity}" if flipper == "rotation" else "fix-0"
            if peer not in trainers:
                trainers[peer] = AnchorTraining(config, dataset, peer, faults=faults_named("signflip"))
            payloads = trainers[peer].run_round(round_, theta)
            contributions.append((peer, theta.decode_contribution(peer, round_, payloads)))
            replicas[peer] = Replica(peer, data_slot(peer))
            trained.add(peer)
            harmful.add(peer)
        seen = {peer: float(i) for i, (peer, _) in enumerate(contributions)}  # one read each: an order
        rejected = verifier.screen(round_, contributions, seen)
        if len(rejected) == len(contributions):
            candidates = [(p, d) for p, d in contributions if rejected[p] in RESCUABLE]
            for peer in verifier.helps(round_, theta.params, candidates, replicas):
                del rejected[peer]
        sealed = [(p, d) for p, d in contributions if p not in rejected]
        weights = verifier.weights([p for p, _ in sealed])
        prepared = theta.prepare(round_, sealed, weights)
        shards = [(p, {m.shard: b"" for m in d}) for p, d in sealed]
        credits = credit_round(schedule, sizes, 1, shards, {}, weights, config.outer.probation_rounds)
        log_ = RoundLog(dict(weights), dict(rejected), harmful=harmful)
        scorable = [(p, d) for p, d in contributions if rejected.get(p) not in ("stale", "copy")]
        waiting.append(
            _Pending(
                round_,
                {n: t.clone() for n, t in theta.params.items()},
                scorable,
                replicas,
                log_,
                {c.peer: c.tokens for c in credits},
            )
        )
        theta.commit(prepared)
        for peer in trained:
            left_out = peer not in weights if peer != CHAIN else not {"stage-up", "stage-down"} & set(weights)
            if left_out:
                trainers[peer].restore_unsent()  # left out: the work goes back into error feedback
        while waiting and waiting[0].round <= round_ - plan.score_lag:
            score(waiting.popleft())
        if round_ == plan.rounds - 1 or plan.eval_every_round:
            log_.eval_loss = eval_loss(model, theta, eval_batches)
        logs.append(log_)
    while waiting:
        score(waiting.popleft())
    return logs


def summarise(
    clean: list[RoundLog],
    attacked: list[RoundLog],
    plan: SybilPlan,
    scenario: str,
    together: frozenset[str] = frozenset(),
) -> dict:
    """The issue's targets for `scenario`, measured over the attack rounds (`together`: the scenarios
    that ran in the same run, when several did)."""
    after = slice(plan.history, plan.rounds)
    honest = [f"honest-{i}" for i in range(plan.honest)] + ["stage-up"]
    if "framing" not in together | {scenario}:
        honest.append("stage-down")
    credit_clean = sum(r.credit.get(p, 0) for r in clean[after] for p in honest)
    credit_attacked = sum(r.credit.get(p, 0) for r in attacked[after] for p in honest)
    attackers = {
        p for r in attacked[after] for p in [*r.sealed, *r.rejected] if p.startswith(ATTACKERS[scenario])
    }
    left_out = [
        (i, p, r.rejected[p])
        for i, r in enumerate(attacked)
        if i >= plan.history
        for p in honest
        if p in r.rejected
    ]
    harmful_rounds = [r for r in attacked[after] if r.harmful & attackers]
    out = {
        "honest_credit_share_of_clean": credit_attacked / credit_clean if credit_clean else None,
        "honest_left_out": left_out,
        "final_eval_loss": attacked[-1].eval_loss,
        "final_eval_loss_clean": clean[-1].eval_loss,
        "loss_vs_clean": attacked[-1].eval_loss / clean[-1].eval_loss - 1,
        "attacker_credit": sum(r.credit.get(p, 0) for r in attacked[after] for p in attackers),
        "one_replica_credit": replica_tokens_of(clean, plan),
        "rounds_attacker_sealed_with_weight": sum(1 for r in attacked[after] if attackers & set(r.sealed)),
        "attacker_weight_share": [
            sum(w for p, w in r.sealed.items() if p in attackers) / max(sum(r.sealed.values()), 1)
            for r in attacked[after]
        ],
        "harmful_rounds": len(harmful_rounds),
        "harmful_rounds_scored": sum(1 for r in harmful_rounds if r.harmful & attackers & r.scored),
        "harmful_rounds_sealed": sum(1 for r in harmful_rounds if r.harmful & attackers & set(r.sealed)),
    }
    if scenario == "framing":
        out["upstream_credited_rounds"] = sum(1 for r in attacked[after] if r.credit.get("stage-up"))
        out["downstream_credited_rounds"] = sum(1 for r in attacked[after] if r.credit.get("stage-down"))
    return out


def replica_tokens_of(clean: list[RoundLog], plan: SybilPlan) -> float:
    """One honest replica's mean credit per attack round in the clean run."""
    rounds = clean[plan.history :]
    total = sum(r.credit.get(f"honest-{i}", 0) for r in rounds for i in range(plan.honest))
    return total / max(len(rounds) * plan.honest, 1)


def plan_for(quick: bool, rounds: int | None = None) -> SybilPlan:
    """--quick: tiny, sequences of 32, 4 + 8 rounds (minutes); full: 10 rounds of history (full weight
    at F = 8) and `rounds` (default 10) attacked."""
    if rounds is not None and rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if quick:
        return SybilPlan(
            history=4, attack_rounds=rounds or 8, inner_steps=2, batch_size=2, probation_rounds=4, seq_len=32
        )
    return SybilPlan(history=10, attack_rounds=rounds or 10)


def run_benchmark(config: Config, plan: SybilPlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "outer", inner_steps=plan.inner_steps)
    config = replace(config, "data", batch_size=plan.batch_size)
    if plan.probation_rounds is not None:
        config = replace(config, "outer", probation_rounds=plan.probation_rounds)
    if plan.seq_len is not None:
        config = replace(config, "data", seq_len=plan.seq_len)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    report: dict = {
        "config": config.run.name,
        "plan": dataclasses.asdict(plan),
        "full_weight": config.outer.probation_rounds,
        "scenarios": {},
    }
    with tqdm(total=len(plan.scenarios) + 1, desc="sybil bench", unit="run", disable=not progress) as bar:
        clean = run_scenario(config, dataset, model, plan, None)
        bar.update(1)
        for scenario in plan.scenarios:
            bar.set_postfix(run=scenario)
            # "predictable": a sample smaller than the swarm, so that who is scored is drawn; its clean run
            # is the same swarm and sample with that replica honest (weight grows per scored round, and
            # one more replica makes each less likely to be scored: that is not the attack's doing)
            # (it is caught by chance: the result of one set of draws says little, so several are run)
            if scenario == "predictable":
                sampled = replace(config, "outer", verify_sample=2)
                outcomes = []
                for draw in range(plan.draws):
                    attacked = run_scenario(sampled, dataset, model, plan, scenario, draw=draw)
                    yardstick = run_scenario(sampled, dataset, model, plan, scenario, strike=False, draw=draw)
                    outcomes.append(summarise(yardstick, attacked, plan, scenario))
                summary = _pooled(outcomes)
            else:
                attacked = run_scenario(config, dataset, model, plan, scenario)
                summary = summarise(clean, attacked, plan, scenario)
            report["scenarios"][scenario] = summary | {"losses": [r.eval_loss for r in attacked]}
            bar.update(1)
    report["clean_losses"] = [r.eval_loss for r in clean]
    (out_dir / "sybil.json").write_text(json.dumps(report, indent=2, default=list))
    return report


def _pooled(outcomes: list[dict]) -> dict:
    """One summary of several draws: per run the means (shares, losses, the attacker's rounds and credit),
    the harmful rounds summed over the draws, the worst honest credit, and each draw's own (`"draws"`)."""
    pooled = dict(outcomes[0])
    means = ("honest_credit_share_of_clean", "loss_vs_clean", "final_eval_loss", "final_eval_loss_clean")
    for key in (*means, "attacker_credit", "rounds_attacker_sealed_with_weight"):
        pooled[key] = sum(o[key] for o in outcomes) / len(outcomes)
    for key in ("harmful_rounds", "harmful_rounds_scored", "harmful_rounds_sealed"):
        pooled[key] = sum(o[key] for o in outcomes)
    pooled["honest_left_out"] = [item for o in outcomes for item in o["honest_left_out"]]
    pooled["worst_honest_credit_share"] = min(o["honest_credit_share_of_clean"] for o in outcomes)
    pooled["draws"] = outcomes
    return pooled
