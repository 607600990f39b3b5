"""Which rebase rule an overlapped round should use (docs/sync.md, "Overlap"), measured in process.

R anchors (the daemon's own round code, `hetnode.daemon.rounds.AnchorTraining`, and θ as every replica
holds it, `GlobalModel`) train the same rounds under three rules, side by side:
- `lockstep`: train round t from θ^{t−1}, wait for the seal, apply, train t+1 (no overlap);
- `eager` (the daemon's rule): after announcing t a replica trains t+1 at once from its best guess of θ^t,
  θ^{t−1} moved by its own sent update at its weight in the aggregate (1/R); when θ^t lands (after a share f
  of round t+1's inner steps) it rebases, w ← θ^t + (w − s), keeping what it learned since;
- `local`: the same, from its own fresh weights (all of its Δ_t, not the small step top-k lets through);
- `naive`: the one-round delay: from θ^{t−1} itself until θ^t lands, then the same rebase.
The seal landing after f·H steps stands for a sync that takes f of a round (f = 1: the whole round; the
replica then waits, as the daemon does, before compressing). Every rule trains the same tokens per round, so
eval loss after round t compares the rules at equal tokens. SparseLoCo (top-k + 2-bit + error feedback) as
configured; `outer.aggregation` as configured.

    .venv/bin/python benchmarks/overlap_rule.py --quick      # tiny, R = 4, H = 30, batch 4, 10 rounds
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.config import load_config, replace  # noqa: E402
from hetnode.daemon.rounds import AnchorTraining  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding  # noqa: E402
from hetnode.training.local_rounds import Rebase  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class SealLandsAt:
    """An inbox that hands over θ^t before inner step `at` of the next round (at = H: after its last step,
    while the replica waits to compress): a sync that takes that share of a round."""

    def __init__(self, rebase: Rebase, at: int) -> None:
        self.rebase, self.at, self.calls = rebase, at, 0

    def take(self, timeout: float | None = 0.0) -> list[Rebase]:
        due = timeout != 0.0 or self.calls >= self.at
        self.calls += 1
        if due and self.rebase is not None:
            rebase, self.rebase = self.rebase, None
            return [rebase]
        return []


def run_rule(
    config, dataset, peers, rounds: int, rule: str, fraction: float, evaluate, progress
) -> list[float]:
    theta = GlobalModel(config)
    ahead_from = {"naive": "theta", "local": "local"}.get(rule, "eager")
    trainers = {p: AnchorTraining(config, dataset, p, ahead_from=ahead_from) for p in peers}
    for training in trainers.values():
        training.rebase(training.rebase_from(theta))
    at = round(fraction * config.outer.inner_steps)
    losses, inboxes = [], {p: None for p in peers}
    for round_ in range(rounds):
        payloads = {p: trainers[p].train_round(round_, inboxes[p]).payloads for p in peers}
        theta.apply(round_, sorted(payloads.items()))
        losses.append(evaluate(theta))
        for peer, training in trainers.items():
            rebase = training.rebase_from(theta, contributors=len(peers))
            if rule == "lockstep":
                training.rebase(rebase)  # before the next round's first step
                inboxes[peer] = None
            else:
                inboxes[peer] = SealLandsAt(rebase, at)
        progress.update(1)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--fractions", default="0.5,1.0", help="shares of a round the sync takes")
    parser.add_argument("--rules", default="eager,local,naive", help="overlap rules beside lockstep")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overlap_rule"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # beside other work on a 2-core machine, one thread does not spin against it
    config = load_config(Path(args.config))
    rounds = args.rounds or (10 if args.quick else 20)
    config = replace(config, "outer", inner_steps=args.inner_steps)
    if args.quick:
        config = replace(config, "data", batch_size=4)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    batches = dataset.eval_batches(config.train.eval_batches)

    @torch.no_grad()
    def evaluate(theta: GlobalModel) -> float:
        for name, param in model.named_parameters():
            param.copy_(theta.params[name])
        model.eval()
        return sum(model.loss(x, y).item() for x, y in batches) / len(batches)

    peers = [f"peer-{i}" for i in range(args.replicas)]
    fractions = [float(f) for f in args.fractions.split(",")]
    runs = [("lockstep", 0.0)] + [(rule, f) for f in fractions for rule in args.rules.split(",")]
    started = time.monotonic()
    results: dict[str, dict] = {}
    with tqdm(total=rounds * len(runs), desc="rounds", unit="round") as progress:
        for rule, fraction in runs:
            name = rule if rule == "lockstep" else f"{rule}@{fraction:g}"
            progress.set_postfix_str(name)
            results[name] = {"rule": rule, "sync_fraction": fraction}
            results[name]["eval_loss"] = run_rule(
                config, dataset, peers, rounds, rule, fraction, evaluate, progress
            )
    base = results["lockstep"]["eval_loss"]
    for result in results.values():
        losses = result["eval_loss"]
        result["final_vs_lockstep"] = round(losses[-1] / base[-1] - 1, 4)
        tail = min(3, rounds)
        result["last3_vs_lockstep"] = round(sum(losses[-tail:]) / sum(base[-tail:]) - 1, 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens_per_round = args.replicas * config.outer.inner_steps * config.data.batch_size * config.data.seq_len
    report = {
        "command": "benchmarks/overlap_rule.py" + (" --quick" if args.quick else ""),
        "config": Path(args.config).name,
        "replicas": args.replicas,
        "inner_steps": config.outer.inner_steps,
        "batch_size": config.data.batch_size,
        "rounds": rounds,
        "aggregation": config.outer.aggregation,
        "tokens_per_round": tokens_per_round,
        "seconds": round(time.monotonic() - started, 1),
        "rules": results,
    }
    (out / "overlap_rule.json").write_text(json.dumps(report, indent=2))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in results.items():
        ax.plot(range(rounds), result["eval_loss"], label=f"{name} ({result['final_vs_lockstep']:+.1%})")
    ax.set_xlabel(f"round (equal tokens: {tokens_per_round} per round)")
    ax.set_ylabel("eval loss of θ")
    ax.set_title(f"rebase rules, R={args.replicas}, H={config.outer.inner_steps}, SparseLoCo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "overlap_rule.png", dpi=120)
    for name, result in results.items():
        print(
            f"{name:12s} final {result['eval_loss'][-1]:.4f}  vs lockstep {result['final_vs_lockstep']:+.2%}"
            f"  last 3 {result['last3_vs_lockstep']:+.2%}"
        )


if __name__ == "__main__":
    main()
