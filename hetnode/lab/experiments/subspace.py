"""`hetnode bench subspace`: full replicas vs anchors + compressed chains, over compression ratios.

All runs sync with SparseLoCo and see the same tokens. The mixed swarms have 2 anchors and 2 chains
of 2 stages, each stage the round a chain member runs (`StageRound`); chain boundaries carry k subspace
coefficients per token (bf16) instead of d values (fp32, as a daemon's uncompressed chain sends them), at
d/(k+1) ∈ {4, 8, 16, 32, 64}. `selective` constrains only the chains; `everything` constrains the
anchors too (arXiv 2601.02360 finds selective better at ≥ 16×).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hetnode.config import Config, replace  # noqa: E402
from hetnode.data import TokenDataset  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.lab.sim.replicas import ChainReplica  # noqa: E402
from hetnode.lab.sim.simulation import ReplicaSimulation, Swarm, SyncMethod  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402

RATIOS = (4, 8, 16, 32, 64)
MODES = ("selective", "everything")


@dataclass(frozen=True)
class SubspacePlan:
    steps: int
    inner_steps: int
    batch_size: int
    anchors: int = 2
    chains: int = 2
    chain_stages: int = 2
    runs: tuple[str, ...] = ()  # empty: every run


def run_names() -> tuple[str, ...]:
    """Every run of the bench, in the order it runs them."""
    return ("replicas", "mixed-dense", *(f"{mode}-{ratio}x" for mode in MODES for ratio in RATIOS))


def plan_for(quick: bool, steps: int | None = None, only: tuple[str, ...] = ()) -> SubspacePlan:
    """--quick: tiny, batch 8; full: small, batch 4. `only` picks a subset of `run_names()`."""
    unknown = sorted(set(only) - set(run_names()))
    if unknown:
        raise ConfigError("--runs", "runs", f"unknown {unknown}; choose from {list(run_names())}")
    runs = only or run_names()
    if quick:
        return SubspacePlan(steps=steps or 60, inner_steps=15, batch_size=8, runs=runs)
    return SubspacePlan(steps=steps or 60, inner_steps=15, batch_size=4, runs=runs)


def rank_for(d_model: int, ratio: int) -> int:
    """k with d/(k+1) = ratio (k ≥ 1)."""
    return max(1, round(d_model / ratio) - 1)


def run_case(name: str, plan: SubspacePlan, d_model: int) -> tuple[Swarm, int | None]:
    """The swarm and subspace rank a run of `run_names()` stands for (rank None: no projection)."""
    if name == "replicas":
        return Swarm(anchors=plan.anchors + plan.chains), None
    if name == "mixed-dense":
        return Swarm(plan.anchors, plan.chains, plan.chain_stages, "none"), None
    mode, _, ratio = name.rpartition("-")  # "selective-16x"
    return Swarm(plan.anchors, plan.chains, plan.chain_stages, mode), rank_for(d_model, int(ratio[:-1]))


def run_subspace(config: Config, plan: SubspacePlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "data", batch_size=plan.batch_size)
    config = replace(config, "train", max_steps=plan.steps, eval_batches=4)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    method = SyncMethod("sparseloco", "sparseloco", inner_steps=plan.inner_steps, topk=config.outer.topk)
    d = config.model.d_model
    names = [name for name in run_names() if not plan.runs or name in plan.runs]
    cases = [(name, *run_case(name, plan, d)) for name in names]
    results: dict[str, dict] = {}
    rounds = plan.steps // plan.inner_steps
    with tqdm(total=len(cases) * rounds, desc="subspace bench", unit="round", disable=not progress) as bar:
        for name, swarm, rank in cases:
            run_config = config if rank is None else replace(config, "pipeline", subspace_rank=rank)
            sim = ReplicaSimulation(run_config, dataset, method, swarm)
            for _ in range(rounds):
                stats = sim.run_round()
                bar.set_postfix(run=name, loss=f"{stats.eval_loss:.3f}")
                bar.update(1)
            results[name] = _summarise(sim, swarm, rank, d, stats.eval_loss)
    report = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "d_model": d,
        "steps": plan.steps,
        "inner_steps": plan.inner_steps,
        "tokens_per_run": (plan.anchors + plan.chains) * plan.steps * plan.batch_size * config.data.seq_len,
        "runs": results,
    }
    (out_dir / "subspace.json").write_text(json.dumps(report, indent=2))
    plot_subspace(report, out_dir / "subspace.png")
    return report


def _summarise(sim: ReplicaSimulation, swarm: Swarm, rank: int | None, d: int, final: float) -> dict:
    chains = [r for r in sim.replicas if isinstance(r, ChainReplica)]
    result: dict = {"final_eval_loss": final, "mode": swarm.mode, "rank": rank, "chains": len(chains)}
    if not chains:
        return result
    boundaries = swarm.chain_stages - 1
    tokens = sum(c.tokens for c in chains)
    workers = [stage.worker for c in chains for stage in c.chain.stages]
    timing = {k: sum(w.timings[k] for w in workers) for k in ("compute", "optimizer", "projection")}
    result.update(
        compression_ratio=d / (rank + 1) if rank else 1.0,
        activation_bytes_per_token_per_boundary=sum(c.activation_bytes for c in chains) / tokens / boundaries,
        gradient_bytes_per_token_per_boundary=sum(c.gradient_bytes for c in chains) / tokens / boundaries,
        projection_overhead=timing["projection"] / sum(timing.values()),
    )
    return result


def plot_subspace(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    runs = report["runs"]
    for mode in MODES:  # a subset run (--runs) plots what it has
        names = [f"{mode}-{r}x" for r in RATIOS if f"{mode}-{r}x" in runs]
        if names:
            xs = [runs[n]["compression_ratio"] for n in names]
            ax.plot(xs, [runs[n]["final_eval_loss"] for n in names], "o-", label=mode)
    for name, style, label in (
        ("replicas", ("gray", "--"), "4 full replicas (no chains)"),
        ("mixed-dense", ("black", ":"), "mixed, dense fp32 boundaries"),
    ):
        if name in runs:
            ax.axhline(runs[name]["final_eval_loss"], color=style[0], ls=style[1], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("activation compression d/(k+1)")
    ax.set_ylabel("final eval loss")
    ax.set_title(
        f"{report['config']}: 2 anchors + 2 chains of 2 stages, SparseLoCo H={report['inner_steps']}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
