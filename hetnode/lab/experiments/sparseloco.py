"""`hetnode bench sparseloco`: DDP vs DiLoCo vs SparseLoCo, same model, tokens and seed, one run.

Every method trains R replicas for the same number of inner steps per replica on the same disjoint
data slots; only the synchronisation differs. Bytes are counted from encoded messages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.algo.aggregate import AGGREGATION_RULES  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import ConfigError
from hetnode.lab.sim.simulation import ReplicaSimulation, RoundStats, Swarm, SyncMethod  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchPlan:
    replicas: int
    steps: int  # inner steps per replica, divisible by every H in the plan
    batch_size: int
    methods: tuple[SyncMethod, ...]


def default_methods(h: int = 30) -> tuple[SyncMethod, ...]:
    """(a) DDP, (b) DiLoCo, (c) SparseLoCo k ∈ {32, 64, 128} at H, (d) SparseLoCo H ∈ {15, 50} at k=64."""
    return (
        SyncMethod("ddp", "ddp", inner_steps=h),
        SyncMethod(f"diloco-H{h}", "diloco", inner_steps=h),
        SyncMethod(f"sparseloco-k32-H{h}", "sparseloco", inner_steps=h, topk=32),
        SyncMethod(f"sparseloco-k64-H{h}", "sparseloco", inner_steps=h, topk=64),
        SyncMethod(f"sparseloco-k128-H{h}", "sparseloco", inner_steps=h, topk=128),
        SyncMethod("sparseloco-k64-H15", "sparseloco", inner_steps=15, topk=64),
        SyncMethod("sparseloco-k64-H50", "sparseloco", inner_steps=50, topk=64),
    )


def aggregation_methods(h: int = 30) -> tuple[SyncMethod, ...]:
    """SparseLoCo k=64 at H under every aggregation rule (docs/security.md, "Steer the update"), named
    sparseloco-k64-H<h>-<rule>."""
    return tuple(
        SyncMethod(f"sparseloco-k64-H{h}-{rule}", "sparseloco", inner_steps=h, topk=64, aggregation=rule)
        for rule in AGGREGATION_RULES
    )


def plan_for(
    quick: bool,
    steps: int | None = None,
    only: tuple[str, ...] = (),
    aggregations: tuple[str, ...] = (),
    replicas: int | None = None,
    outer_lr: float | None = None,
) -> BenchPlan:
    """--quick: tiny, R=2; full: small, R=4. `steps` (a multiple of 150 so every H divides it) overrides;
    `only` keeps the named methods (a long run of two methods costs what a short run of all seven does).
    The seven default methods aggregate with the config's rule; `aggregations` adds sparseloco-k64-H30-<rule>
    per named rule, so rules compare side by side in one run (also nameable in `only`); `outer_lr` sets
    SparseLoCo's α for every SparseLoCo method of the run."""
    methods = default_methods()
    variants = aggregation_methods()
    unknown = sorted(set(aggregations) - set(AGGREGATION_RULES))
    if unknown:
        raise ConfigError(
            "--aggregations", "aggregations", f"unknown {unknown}; choose from {AGGREGATION_RULES}"
        )
    if only:
        known = [m.name for m in methods + variants]
        unknown = sorted(set(only) - set(known))
        if unknown:
            raise ConfigError("--methods", "methods", f"unknown {unknown}; choose from {known}")
        methods = tuple(m for m in methods + variants if m.name in only)
    elif aggregations:
        methods = ()
    methods += tuple(m for m in variants if m.aggregation in aggregations and m not in methods)
    if replicas is not None and replicas < 1:
        raise ConfigError("--replicas", "replicas", f"must be >= 1, got {replicas}")
    if outer_lr is not None:
        if not outer_lr > 0:
            raise ConfigError("--outer-lr", "outer_lr", f"must be > 0, got {outer_lr}")
        methods = tuple(
            dataclasses.replace(m, outer_lr=outer_lr) if m.kind == "sparseloco" else m for m in methods
        )
    if quick:
        return BenchPlan(replicas=replicas or 2, steps=steps or 150, batch_size=8, methods=methods)
    return BenchPlan(replicas=replicas or 4, steps=steps or 150, batch_size=4, methods=methods)


def run_benchmark(config: Config, plan: BenchPlan, out_dir: Path, progress: bool = True) -> dict:
    """Run every method of `plan` on `config`; write sparseloco.json and sparseloco.png to `out_dir`."""
    for method in plan.methods:
        if plan.steps % method.inner_steps:
            raise ValueError(
                f"steps {plan.steps} is not a multiple of H={method.inner_steps} ({method.name})"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "data", batch_size=plan.batch_size)
    config = replace(config, "train", max_steps=plan.steps)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    total_rounds = sum(plan.steps // m.inner_steps for m in plan.methods)
    results: dict[str, dict] = {}
    with tqdm(total=total_rounds, desc="sparseloco bench", unit="round", disable=not progress) as bar:
        for method in plan.methods:
            sim = ReplicaSimulation(config, dataset, method, Swarm(anchors=plan.replicas))
            start = time.perf_counter()
            rounds: list[RoundStats] = []
            for _ in range(plan.steps // method.inner_steps):
                rounds.append(sim.run_round())
                bar.set_postfix(method=method.name, loss=f"{rounds[-1].eval_loss:.3f}")
                bar.update(1)
            results[method.name] = _summarise(method, rounds, time.perf_counter() - start)
            if method.kind == "sparseloco":
                results[method.name]["method"]["aggregation"] = sim.aggregation
    report = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "replicas": plan.replicas,
        "steps_per_replica": plan.steps,
        "tokens_per_method": plan.replicas * plan.steps * plan.batch_size * config.data.seq_len,
        "methods": results,
    }
    (out_dir / "sparseloco.json").write_text(json.dumps(report, indent=2))
    plot_loss_vs_bytes(report, out_dir / "sparseloco.png")
    return report


def _summarise(method: SyncMethod, rounds: list[RoundStats], seconds: float) -> dict:
    sent = [r.bytes_per_replica for r in rounds]
    dense = [r.dense_fp32_bytes for r in rounds]
    cumulative, curve = 0, []
    for r in rounds:
        cumulative += r.bytes_per_replica
        curve.append([cumulative, r.eval_loss])
    codec = sum(r.codec_seconds for r in rounds) / len(rounds)
    inner = sum(r.inner_seconds for r in rounds) / len(rounds)
    return {
        "method": asdict(method),
        "final_eval_loss": rounds[-1].eval_loss,
        "rounds": len(rounds),
        "syncs_per_round": rounds[0].syncs,
        "bytes_per_replica_per_sync": sum(sent) / sum(r.syncs for r in rounds),
        "bytes_per_replica_per_round": sum(sent) / len(sent),
        "bytes_per_replica_total": sum(sent),
        "compression_vs_dense_fp32": sum(dense) / sum(sent),
        "codec_seconds_per_round": codec,
        "inner_seconds_per_round": inner,
        "codec_over_inner": codec / inner if inner > 0 else None,
        "wall_seconds": seconds,
        "curve": curve,
    }


def plot_loss_vs_bytes(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, result in report["methods"].items():
        xs, ys = zip(*result["curve"], strict=True)
        style = "--" if result["method"]["kind"] != "sparseloco" else "-"
        ax.plot(xs, ys, style, marker="o", markersize=3, label=f"{name} ({result['final_eval_loss']:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per replica (cumulative, encoded messages)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(
        f"{report['config']} ({report['parameters'] / 1e6:.1f}M params), R={report['replicas']}, "
        f"{report['steps_per_replica']} steps/replica"
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
