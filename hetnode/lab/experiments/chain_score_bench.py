"""`hetnode bench chain-score`: how much a chain's round helps θ against an anchor's, as the verifier scores
it (issue 35: the chain is left out by the score in the utilisation lab), in process.

It lives in the lab wing, which may import both sides it measures: the verifier (`bootstrap/verifier.py`)
and the replicas' code (`daemon/rounds.py` for anchors, `daemon/stage_training.py` for a two-stage chain in
1F1B).

Per compression mode and warm-up length: θ is an anchor's weights after `warm` steps from the seed. Three
anchors and one chain per chain optimiser first train a round of `warm` steps from the seed (their
optimisers warm, their error feedback then cleared), stand on θ, train one round of H, and the verifier
scores each chain beside the three anchors (its own swarm of four: the yardstick is their median). Reported:
each replica's score (an anchor at the median scores 1 − margin) and each chain's improvement as a share of
the anchors' median. A chain scoring below 0 is left out of the seal.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bootstrap.verifier import Replica, Verifier  # noqa: E402
from hetnode.algo.scoring import SCORE_MARGIN  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.daemon.rounds import AnchorTraining  # noqa: E402
from hetnode.daemon.stage_training import StageTraining, stage_part  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.planning.rounds import data_slot  # noqa: E402
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding  # noqa: E402

log = logging.getLogger(__name__)

ANCHORS = ("anchor-a", "anchor-b", "anchor-c")
MODES = ("selective", "everything", "none")
OPTIMIZERS = ("rotated_adamw", "adamw")


@dataclass(frozen=True)
class ChainScorePlan:
    inner_steps: int = 5
    warm_steps: tuple[int, ...] = (30, 60, 120)
    modes: tuple[str, ...] = MODES
    optimizers: tuple[str, ...] = OPTIMIZERS
    batch_size: int = 8
    seq_len: int = 128


def plan_for(quick: bool) -> ChainScorePlan:
    return ChainScorePlan(warm_steps=(60,)) if quick else ChainScorePlan()


def run_benchmark(config: Config, plan: ChainScorePlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "data", batch_size=plan.batch_size, seq_len=plan.seq_len)
    # every replica of the little swarm is scored every round
    config = replace(config, "outer", inner_steps=plan.inner_steps, verify_sample=8, verify_min_chance=1.0)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    cases = [(mode, warm) for mode in plan.modes for warm in plan.warm_steps]
    rows = []
    with tqdm(total=len(cases), desc="chain score", unit="case", disable=not progress) as bar:
        for mode, warm in cases:
            bar.set_postfix(mode=mode, warm=warm)
            rows.extend(score_case(replace(config, "pipeline", compression=mode), dataset, plan, warm))
            bar.update(1)
    report = {
        "config": config.run.name,
        "inner_steps": plan.inner_steps,
        "margin": SCORE_MARGIN,
        "rows": rows,
        "summary": summary(rows),
    }
    (out_dir / "chain_score.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out_dir / "chain_score.png")
    return report


def score_case(config: Config, dataset: TokenDataset, plan: ChainScorePlan, warm: int) -> list[dict]:
    """One compression mode, one warm-up: each chain optimiser's chain scored beside the three anchors."""
    theta = warm_theta(config, dataset, warm)
    anchors = {}
    for name in ANCHORS:
        anchors[name] = warm_anchor(config, dataset, name, warm)
        anchors[name].rebase(anchors[name].rebase_from(theta))
    round_ = 1
    anchor_payloads = {name: t.train_round(round_).payloads for name, t in anchors.items()}
    rows = []
    for optimizer in plan.optimizers:
        chain = f"chain-{optimizer}"
        stages = warm_chain(
            replace(config, "pipeline", chain_optimizer=optimizer), dataset, chain, warm, theta
        )
        stage_payloads = train_chain_round(stages, round_, plan.inner_steps)
        contributions = [(n, theta.decode_contribution(n, round_, p)) for n, p in anchor_payloads.items()]
        replicas = {n: Replica(n, data_slot(n)) for n in ANCHORS}
        for index, payloads in enumerate(stage_payloads):
            peer = f"{chain}/stage-{index}"
            contributions.append((peer, theta.decode_contribution(peer, round_, payloads)))
            replicas[peer] = Replica(chain, data_slot(chain))
        model = build_model(config.model, seed=config.run.seed)
        model.fixed_embedding = base_fixed_embedding(config)
        verifier = Verifier(config, dataset, model, secret=b"chain-score-" + str(warm).encode())
        scores = verifier.score(round_, theta.params, contributions, replicas)
        typical = sorted(scores[n] for n in ANCHORS)[1] + SCORE_MARGIN
        for peer, score in sorted(scores.items()):
            rows.append(
                {
                    "mode": config.pipeline.compression,
                    "warm_steps": warm,
                    "chain_optimizer": optimizer,
                    "peer": peer,
                    "role": "anchor" if peer in ANCHORS else "stage",
                    "score": score,
                    "share_of_anchors": (score + SCORE_MARGIN) / typical if typical > 0 else None,
                }
            )
    return rows


def warm_theta(config: Config, dataset: TokenDataset, warm: int) -> GlobalModel:
    """θ after `warm` inner steps of one anchor from the seed (its working weights, not compressed)."""
    theta = GlobalModel(config)
    trainer = AnchorTraining(config, dataset, "theta")
    trainer.rebase(trainer.rebase_from(theta, next_round=0))
    for step in range(warm):
        trainer.trainer.train_step(batch_index=step)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            theta.params[name].copy_(param.detach())
    theta.params_round = 0
    return theta


def warm_anchor(config: Config, dataset: TokenDataset, name: str, warm: int) -> AnchorTraining:
    """An anchor whose optimiser took `warm` steps from the seed (round 0), its error feedback cleared."""
    training = AnchorTraining(replace(config, "outer", inner_steps=warm, max_inner_steps=0), dataset, name)
    training.rebase(training.rebase_from(GlobalModel(config), next_round=0))
    training.train_round(0)
    training.config = config  # round 1 trains H
    _clear(training.feedback)
    return training


def warm_chain(
    config: Config, dataset: TokenDataset, chain: str, warm: int, theta: GlobalModel
) -> list[StageTraining]:
    """A two-stage chain whose optimisers took `warm` micro-batches from the seed, standing on θ."""
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    stages = [StageTraining(config, splits, i, chain, dataset if i == 0 else None) for i in range(2)]
    parts = [GlobalModel(config, part=stage_part(splits, i, s.compressed)) for i, s in enumerate(stages)]
    for stage, part in zip(stages, parts, strict=True):
        stage.rebase(stage.rebase_from(part))
    train_chain_round(stages, 0, warm)
    for stage, part in zip(stages, parts, strict=True):
        _clear(stage.feedback)
        with torch.no_grad():
            for name, tensor in part.params.items():
                tensor.copy_(theta.params[name])
        part.params_round = theta.params_round
        stage.rebase(stage.rebase_from(part))
    return stages


def train_chain_round(stages: list[StageTraining], round_: int, micro_batches: int) -> list[dict[str, bytes]]:
    """One round of a two-stage chain in 1F1B (the first stage runs the next forward before the last
    backward: weight delay 1, as on the wire), then each stage's payloads."""
    first, last = stages
    first.begin_round(round_)
    last.begin_round(round_, first.drift_base)
    waiting: list[tuple[int, torch.Tensor]] = []
    for _ in range(micro_batches):
        mb, batch = first.next_batch()
        frame = first.forward(mb, batch)
        if waiting:
            first.backward(*waiting.pop())
        last.forward(mb, frame)
        waiting.append((mb, last.backward(mb)))
    for mb, grad in waiting:
        first.backward(mb, grad)
    return [stage.end_round(round_, f"{stage.chain}/stage-{stage.index}") for stage in stages]


def _clear(feedback) -> None:  # noqa: ANN001
    for buffer in feedback.buffers.values():
        buffer.zero_()


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode and chain optimiser: the chain's least score over its stages and warm-ups, and its share."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["role"] != "stage":
            continue
        key = f"{row['mode']}/{row['chain_optimizer']}"
        entry = out.setdefault(key, {"least_score": row["score"], "shares": []})
        entry["least_score"] = min(entry["least_score"], row["score"])
        entry["shares"].append(row["share_of_anchors"])
    for entry in out.values():
        shares = sorted(s for s in entry.pop("shares") if s is not None)
        entry["median_share"] = shares[len(shares) // 2] if shares else None
    return out


def plot(report: dict, path: Path) -> None:
    keys = list(report["summary"])
    shares = [report["summary"][k]["median_share"] or 0.0 for k in keys]
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 1.2), 4))
    ax.bar(
        range(len(keys)), shares, color=["tab:red" if s < report["margin"] else "tab:blue" for s in shares]
    )
    ax.axhline(1.0, color="grey", linestyle=":", label="an anchor at the median")
    ax.axhline(report["margin"], color="tab:red", linestyle="--", label="score 0: left out below")
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
    ax.set_ylabel("chain's improvement / anchors' median")
    ax.set_title(f"hetnode bench chain-score: {report['config']}, H={report['inner_steps']}, 2 stages, 1F1B")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
