"""`hetnode bench chain-score --rounds N`: a chain in a swarm over many rounds, with the coordinator's score
deciding who is sealed, in process (issue 35: the chain is left out by the score in the utilisation lab).

`bench chain-score` asks what one chain round is worth to θ. This asks what the swarm does with it round
after round: three anchors and one two-stage chain (1F1B, weight delay 1) train from θ every round; the
verifier (`bootstrap/verifier.py`) scores every contribution on θ; θ steps by the `mean` of those sealed;
each replica stands on the new θ, and a payload left out goes back into its error feedback, as in the
daemon. Per compression mode, three rules for who is sealed:

- `screened`: the verifier's (a stage scoring below 0 is left out; the anchors are always sealed and no one
  is on probation: the question is the chain),
- `always`: the chain is sealed whatever its score,
- `anchors`: no chain at all (the three anchors alone: what the chain adds or costs).

Reported per round: θ's eval loss, each stage's score and the anchors' median, whether the chain was sealed,
and each stage's error feedback norm as a share of its slice of θ's (the loop suspected in issue 38: a stage
left out grows a staler residual, which scores worse).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bootstrap.verifier import Replica, Verifier  # noqa: E402
from hetnode.algo.sparseloco import tensors_norm  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.daemon.rounds import AnchorTraining  # noqa: E402
from hetnode.daemon.stage_training import StageTraining, stage_part  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.lab.experiments.chain_score_bench import ANCHORS, train_chain_round  # noqa: E402
from hetnode.lab.experiments.trust_bench import eval_loss  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.planning.rounds import data_slot  # noqa: E402
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding  # noqa: E402

CHAIN = "chain"
RULES = ("screened", "always", "anchors")


@dataclass(frozen=True)
class ChainRoundsPlan:
    rounds: int = 30
    inner_steps: int = 5
    modes: tuple[str, ...] = ("selective", "everything")
    rules: tuple[str, ...] = RULES
    batch_size: int = 8
    seq_len: int = 128


def run_benchmark(config: Config, plan: ChainRoundsPlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    config = replace(config, "outer", inner_steps=plan.inner_steps, verify_sample=8, verify_min_chance=1.0)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    runs = {}
    cases = [(mode, rule) for mode in plan.modes for rule in plan.rules]
    with tqdm(total=len(cases) * plan.rounds, desc="chain rounds", unit="round", disable=not progress) as bar:
        for mode, rule in cases:
            bar.set_postfix(mode=mode, rule=rule)
            runs[f"{mode}/{rule}"] = run_case(
                replace(config, "pipeline", compression=mode), dataset, plan, rule, bar
            )
    report = {
        "config": config.run.name,
        "inner_steps": plan.inner_steps,
        "rounds": plan.rounds,
        "runs": runs,
        "summary": {key: summarise(run) for key, run in runs.items()},
    }
    (out_dir / "chain_rounds.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out_dir / "chain_rounds.png")
    return report


def run_case(config: Config, dataset: TokenDataset, plan: ChainRoundsPlan, rule: str, bar: tqdm) -> dict:
    theta = GlobalModel(config)
    anchors = {name: AnchorTraining(config, dataset, name) for name in ANCHORS}
    for training in anchors.values():
        training.rebase(training.rebase_from(theta))
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    stages, parts = [], []
    if rule != "anchors":
        stages = [StageTraining(config, splits, i, CHAIN, dataset if i == 0 else None) for i in range(2)]
        parts = [GlobalModel(config, part=stage_part(splits, i, s.compressed)) for i, s in enumerate(stages)]
        for stage, part in zip(stages, parts, strict=True):
            stage.rebase(stage.rebase_from(part))
    peers = [f"{CHAIN}/stage-{i}" for i in range(len(stages))]
    replicas = {name: Replica(name, data_slot(name)) for name in ANCHORS} | {
        peer: Replica(CHAIN, data_slot(CHAIN)) for peer in peers
    }
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    verifier = Verifier(config, dataset, model, secret=b"chain-rounds")
    eval_model = build_model(config.model, seed=config.run.seed)
    eval_model.fixed_embedding = base_fixed_embedding(config)
    eval_batches = dataset.eval_batches(config.train.eval_batches)
    run: dict[str, list] = {
        "eval_loss": [],
        "anchor_median": [],
        "stage_scores": [],
        "sealed": [],
        "feedback": [],
    }
    for round_ in range(plan.rounds):  # θ of the seed is round -1's
        payloads = {name: t.train_round(round_).payloads for name, t in anchors.items()}
        if stages:
            payloads |= dict(zip(peers, train_chain_round(stages, round_, plan.inner_steps), strict=True))
        contributions = [(peer, theta.decode_contribution(peer, round_, p)) for peer, p in payloads.items()]
        scores = verifier.score(round_, theta.params, contributions, replicas)
        sealed = [
            (peer, decoded)
            for peer, decoded in contributions
            if rule != "screened" or peer in ANCHORS or scores.get(peer, 0.0) >= 0.0
        ]
        theta.apply_decoded(round_, sealed)
        kept = {peer for peer, _ in sealed}
        for name, training in anchors.items():
            training.rebase(training.rebase_from(theta, left_out=() if name in kept else (round_,)))
        for peer, stage, part in zip(peers, stages, parts, strict=True):
            for name, tensor in part.params.items():
                tensor.copy_(theta.params[name])
            part.params_round = theta.params_round
            stage.rebase(stage.rebase_from(part, left_out=() if peer in kept else (round_,)))
        run["eval_loss"].append(eval_loss(eval_model, theta, eval_batches))
        run["anchor_median"].append(statistics.median(scores[name] for name in ANCHORS))
        run["stage_scores"].append([scores.get(peer) for peer in peers])
        run["sealed"].append([peer in kept for peer in peers])
        run["feedback"].append(
            [feedback_share(stage, part) for stage, part in zip(stages, parts, strict=True)]
        )
        bar.update(1)
    return run


def feedback_share(stage: StageTraining, part: GlobalModel) -> float:
    """A stage's error feedback norm over its slice of θ's (what a handoff bounds at 2)."""
    buffers = stage.feedback.buffers
    return tensors_norm(buffers) / max(tensors_norm({n: part.params[n] for n in buffers}), 1e-12)


def summarise(run: dict) -> dict:
    late = len(run["eval_loss"]) // 2  # the second half: past the first rounds' fast fall
    stage_scores = [s for row in run["stage_scores"][late:] for s in row if s is not None]
    sealed = [s for row in run["sealed"] for s in row]
    return {
        "final_eval_loss": run["eval_loss"][-1],
        "mean_eval_loss_second_half": statistics.fmean(run["eval_loss"][late:]),
        "chain_sealed_share": sum(sealed) / len(sealed) if sealed else None,
        "stage_score_median_second_half": statistics.median(stage_scores) if stage_scores else None,
        "anchor_median_score_second_half": statistics.median(run["anchor_median"][late:]),
        "feedback_share_last": run["feedback"][-1] or None,
    }


def plot(report: dict, path: Path) -> None:
    fig, (loss_ax, score_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, run in report["runs"].items():
        rounds = range(1, len(run["eval_loss"]) + 1)
        style = {"screened": "-", "always": "--", "anchors": ":"}[key.split("/")[1]]
        color = "tab:blue" if key.startswith("selective") else "tab:orange"
        loss_ax.plot(rounds, run["eval_loss"], style, color=color, label=key)
        if key.endswith("/anchors"):
            continue
        least = [min((s for s in row if s is not None), default=float("nan")) for row in run["stage_scores"]]
        score_ax.plot(rounds, least, style, color=color, label=f"{key}: least stage score")
    score_ax.axhline(0.0, color="tab:red", linewidth=0.8, label="left out below (screened)")
    loss_ax.set(
        xlabel="round", ylabel="eval loss of θ", title="θ with the chain screened, always in, or absent"
    )
    score_ax.set(
        xlabel="round", ylabel="verifier score", title="the chain's least stage score (anchors ≈ 0.9)"
    )
    loss_ax.legend(fontsize=7)
    score_ax.legend(fontsize=7)
    fig.suptitle(
        f"hetnode bench chain-score --rounds: {report['config']}, H={report['inner_steps']}, "
        "3 anchors + a 2-stage chain"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
