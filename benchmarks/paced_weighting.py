"""How paced rounds should weigh replicas that trained different numbers of steps (docs/sync.md, "Paced
rounds"), measured in process with the daemon's own round code (`AnchorTraining`, `GlobalModel`).

R anchors of different speeds (`--speeds`, relative to the median replica) train the same rounds:
- `lockstep`: every replica trains H steps a round, so a round lasts as long as the slowest replica takes
  for H (H / min speed step-times);
- `paced-equal`: each trains round(H · speed) steps (within the floor and the cap) in a round of the median
  replica's H steps; weights 1 each: 1/N after the median-norm clip (the aggregate's rule before);
- `paced-steps`: the same rounds, each contribution weighed by its steps (capped at the cap);
- `paced-steps@q<Q>` (`--budget-quantiles`): rounds sized for H steps of the replica at quantile Q of the
  step-times counted from the fastest (`outer.budget_quantile`; 0.5 is `paced-steps`), run for as many
  rounds as reach `paced-steps`'s modelled wall time;
- `paced-steps@floor` (`--floor`): rounds as long as the slowest replica's floor of steps takes when that is
  longer than the median replica's H steps, as the sealer's budget rises to the slowest live member's floor
  (the utilisation lab's slow anchor and chain): the fast replicas train to their cap (`--cap`, in H).
Eval loss of θ after each round, against rounds, tokens trained and modelled wall time (step-times of the
median replica; the sync is left out, as overlap hides it).

Second, for the verifier and for credit: how much a replica's update improves the loss against the steps it
took (1 … 4H from the same θ, after the aggregate's clip to the median norm and without it), fitted as
improvement ∝ steps^k.

    .venv/bin/python benchmarks/paced_weighting.py --quick     # tiny, speeds 0.25,1,1,2, H = 10, 12 rounds
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.algo.quantiles import weighted_quantile  # noqa: E402
from hetnode.algo.scoring import dense_update, loss_improvement, update_norm  # noqa: E402
from hetnode.config import load_config, replace  # noqa: E402
from hetnode.daemon.rounds import AnchorTraining  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def round_steps(speeds: list[float], quantile: float) -> float:
    """A paced round's length in the median replica's step-times: H steps of the replica at `quantile`
    of the step-times, counted from the fastest (as `RoundBudget` sizes it), over H."""
    return weighted_quantile([(1.0 / s, 1) for s in speeds], quantile)


def quantile_of(rule: str) -> float:
    return float(rule.split("@q")[1]) if "@q" in rule else 0.5


def round_length(config, speeds: list[float], rule: str) -> float:
    """A paced round's length over H median step-times; `@floor`: raised to the slowest one's floor."""
    length = round_steps(speeds, quantile_of(rule))
    if rule.endswith("@floor"):
        length = max(length, config.outer.step_floor / (config.outer.inner_steps * min(speeds)))
    return length


def steps_for(config, speeds: list[float], rule: str) -> list[int]:
    o = config.outer
    if rule == "lockstep":
        return [o.inner_steps] * len(speeds)
    length = round_length(config, speeds, rule)
    return [min(max(round(o.inner_steps * s * length), o.step_floor), o.step_cap) for s in speeds]


def run_rule(config, dataset, speeds, rounds, rule, evaluate, progress) -> dict:
    peers = [f"peer-{i}" for i in range(len(speeds))]
    theta = GlobalModel(config)
    trainers = {p: AnchorTraining(config, dataset, p) for p in peers}
    steps = dict(zip(peers, steps_for(config, speeds, rule), strict=True))
    weights = steps if rule.startswith("paced-steps") else dict.fromkeys(peers, 1)
    per_step = config.data.batch_size * config.data.seq_len
    H = config.outer.inner_steps
    round_wall = H / min(speeds) if rule == "lockstep" else H * round_length(config, speeds, rule)
    losses, tokens, wall = [], [], []
    for round_ in range(rounds):
        for training in trainers.values():
            training.rebase(training.rebase_from(theta, next_round=round_, contributors=len(peers)))
        payloads = {p: trainers[p].train_round(round_, steps=steps[p]).payloads for p in peers}
        theta.apply(round_, sorted(payloads.items()), weights)
        losses.append(evaluate(theta))
        tokens.append((tokens[-1] if tokens else 0) + sum(steps.values()) * per_step)
        wall.append((wall[-1] if wall else 0.0) + round_wall)
        progress.update(1)
    return {"steps": steps, "weights": weights, "eval_loss": losses, "tokens": tokens, "wall_steps": wall}


def at(xs: list[float], ys: list[float], x: float) -> float | None:
    """y at x by linear interpolation along a rising xs (None outside it)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def improvement_vs_steps(config, dataset, model, warm_rounds: int, progress) -> dict:
    """From θ after `warm_rounds` lockstep rounds of 4 replicas: improvement of one replica's update on
    the eval batches against its steps, clipped to the H-step updates' median norm and not."""
    theta = GlobalModel(config)
    peers = [f"warm-{i}" for i in range(4)]
    trainers = {p: AnchorTraining(config, dataset, p) for p in peers}
    for round_ in range(warm_rounds):
        for training in trainers.values():
            training.rebase(training.rebase_from(theta, next_round=round_, contributors=len(peers)))
        payloads = {p: trainers[p].train_round(round_).payloads for p in peers}
        theta.apply(round_, sorted(payloads.items()))
        progress.update(1)
    H, round_ = config.outer.inner_steps, warm_rounds
    batches = [(x[:4], y[:4]) for x, y in dataset.eval_batches(config.train.eval_batches)]
    shapes = {n: tuple(t.shape) for n, t in theta.params.items()}
    counts = sorted({1, 2, H // 2, H, 2 * H, config.outer.step_cap} - {0})
    rows = []
    for peer in ("probe-a", "probe-b", "probe-c"):
        for steps in counts:
            training = AnchorTraining(config, dataset, peer)
            training.rebase(training.rebase_from(theta, next_round=round_, contributors=4))
            trained = training.train_round(round_, steps=steps)
            decoded = theta.decode_contribution(peer, round_, trained.payloads)
            update = {n: v for m in decoded for n, v in m.sparse.items()}
            rows.append((peer, steps, update_norm(update), dense_update(update, shapes)))
            progress.update(1)
    median = sorted(norm for _, steps, norm, _ in rows if steps == H)[1]
    out = []
    for peer, steps, norm, delta in rows:
        clipped = {n: t * min(1.0, median / norm) for n, t in delta.items()}
        raw = loss_improvement(model, theta.params, delta, 0.5, batches)
        cut = loss_improvement(model, theta.params, clipped, 0.5, batches)
        out.append({"peer": peer, "steps": steps, "norm": norm, "improvement": raw, "clipped": cut})
    fits = {}
    for key in ("norm", "improvement", "clipped"):
        ref = {r["peer"]: r[key] for r in out if r["steps"] == H}
        pts = [
            (math.log(r["steps"] / H), math.log(r[key] / ref[r["peer"]]))
            for r in out
            if r["steps"] != H and r[key] > 0 and ref[r["peer"]] > 0
        ]
        slope = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts) if pts else None
        fits[key] = None if slope is None else round(slope, 3)
    return {"from_round": warm_rounds, "rows": out, "exponent": fits}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    parser.add_argument("--speeds", default="0.25,1,1,2", help="each replica's speed against the median's")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument(
        "--budget-quantiles",
        default="0.25",
        help="paced-steps again with rounds sized for these quantiles of the swarm (0.5: paced-steps)",
    )
    parser.add_argument("--cap", type=int, default=2, help="the paced cap, in H (outer.max_inner_steps)")
    parser.add_argument("--floor", action="store_true", help="also paced-steps@floor (the lab's budget)")
    parser.add_argument("--rules", default=None, help="only these rules (comma-separated; default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "paced_weighting"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (12 if args.quick else 30)
    H = args.inner_steps
    config = replace(
        load_config(Path(args.config)),
        "outer",
        inner_steps=H,
        schedule="paced",
        min_inner_steps=1,
        max_inner_steps=args.cap * H,
    )
    if args.quick:
        config = replace(config, "data", batch_size=4)
    speeds = [float(s) for s in args.speeds.split(",")]
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

    quantiles = [float(q) for q in args.budget_quantiles.split(",") if q and float(q) != 0.5]
    rules = ["lockstep", "paced-equal", "paced-steps", *(f"paced-steps@q{q:g}" for q in quantiles)]
    rules += ["paced-steps@floor"] if args.floor else []
    if args.rules:
        rules = [r for r in rules if r in args.rules.split(",")]
    # a shorter round runs more rounds, to the same modelled wall time as `paced-steps`
    rounds_of = {
        rule: max(1, round(rounds * round_steps(speeds, 0.5) / round_steps(speeds, quantile_of(rule))))
        if "@q" in rule
        else rounds
        for rule in rules
    }
    started = time.monotonic()
    warm = max(2, rounds // 3)
    probes = 3 * len({1, 2, H // 2, H, 2 * H} - {0})
    results: dict[str, dict] = {}
    with tqdm(total=sum(rounds_of.values()) + warm + probes, desc="rounds", unit="round") as progress:
        for rule in rules:
            progress.set_postfix_str(rule)
            results[rule] = run_rule(config, dataset, speeds, rounds_of[rule], rule, evaluate, progress)
        progress.set_postfix_str("improvement vs steps")
        probe = improvement_vs_steps(config, dataset, model, warm, progress)
    base = results["lockstep"]
    for result in results.values():
        equal_tokens = min(r["tokens"][-1] for r in results.values())
        equal_wall = min(r["wall_steps"][-1] for r in results.values())
        result["loss_at_equal_tokens"] = at(result["tokens"], result["eval_loss"], equal_tokens)
        result["loss_at_equal_wall"] = at(result["wall_steps"], result["eval_loss"], equal_wall)
    for result in results.values():
        result["vs_lockstep_equal_tokens"] = round(
            result["loss_at_equal_tokens"] / base["loss_at_equal_tokens"], 4
        )
        result["vs_lockstep_equal_wall"] = round(result["loss_at_equal_wall"] / base["loss_at_equal_wall"], 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "benchmarks/paced_weighting.py"
        + (" --quick" if args.quick else "")
        + f" --budget-quantiles {args.budget_quantiles}"
        + (f" --speeds {args.speeds} --inner-steps {H} --cap {args.cap}" + (" --floor" if args.floor else ""))
        + (f" --rules {args.rules}" if args.rules else ""),
        "budget_quantile_rounds": rounds_of,
        "config": Path(args.config).name,
        "speeds": speeds,
        "inner_steps": H,
        "step_floor": config.outer.step_floor,
        "step_cap": config.outer.step_cap,
        "batch_size": config.data.batch_size,
        "rounds": rounds,
        "aggregation": config.outer.aggregation,
        "seconds": round(time.monotonic() - started, 1),
        "rules": results,
        "improvement_vs_steps": probe,
    }
    (out / "paced_weighting.json").write_text(json.dumps(report, indent=2))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        axes[0].plot(result["tokens"], result["eval_loss"], label=name)
        axes[1].plot(result["wall_steps"], result["eval_loss"], label=name)
    axes[0].set_xlabel("tokens trained")
    axes[1].set_xlabel("wall time (step-times of the median replica)")
    for ax in axes:
        ax.set_ylabel("eval loss of θ")
        ax.legend()
    fig.suptitle(f"paced weighting: speeds {args.speeds}, H={H}, SparseLoCo ({config.outer.aggregation})")
    fig.tight_layout()
    fig.savefig(out / "paced_weighting.png", dpi=120)
    for name, result in results.items():
        print(
            f"{name:18s} final {result['eval_loss'][-1]:.4f}"
            f"  equal tokens {result['vs_lockstep_equal_tokens']:.4f}"
            f"  equal wall {result['vs_lockstep_equal_wall']:.4f} (× lockstep)"
        )
    print("improvement ∝ steps^k, k:", probe["exponent"])


if __name__ == "__main__":
    main()
