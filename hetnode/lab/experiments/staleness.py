"""`hetnode bench staleness`: asynchronous pipelines of P ∈ {1, 2, 4, 8} stages, three optimisers.

Every run trains the same model on the same batches; only the pipeline depth (hence the staleness
τ_s = P−1−s) and the optimiser differ. The target is the final eval loss of P=1 AdamW (no staleness);
we report how many updates each run needs to reach it (arXiv 2602.03515 reports 76.8 % fewer iterations
for basis rotation than the best async baseline at 1B).
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
from hetnode.lab.sim.pipeline import PipelineChain, build_chain_workers  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402
from hetnode.planning.layer_split import split_layers  # noqa: E402

OPTIMIZERS = ("adamw", "nadam", "rotated_adamw")
DEPTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class StalenessPlan:
    steps: int
    batch_size: int
    eval_every: int
    n_layers: int = 8  # P=8 needs a layer per stage
    depths: tuple[int, ...] = DEPTHS
    optimizers: tuple[str, ...] = OPTIMIZERS


def plan_for(
    quick: bool,
    steps: int | None = None,
    depths: tuple[int, ...] = DEPTHS,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    eval_every: int | None = None,
) -> StalenessPlan:
    if "adamw" not in optimizers or not set(optimizers) <= set(OPTIMIZERS) or not set(depths) <= set(DEPTHS):
        raise ValueError(
            f"optimizers must include adamw (the baseline) and come from {OPTIMIZERS}; depths from {DEPTHS}"
        )
    if eval_every is not None and eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    steps = steps if steps is not None else (150 if quick else 300)
    every = eval_every or (15 if quick else 20)
    return StalenessPlan(steps, 8 if quick else 4, every, depths=depths, optimizers=optimizers)


def run_staleness(config: Config, plan: StalenessPlan, out_dir: Path, progress: bool = True) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, "model", n_layers=plan.n_layers)
    config = replace(config, "data", batch_size=plan.batch_size)
    config = replace(config, "train", max_steps=plan.steps, eval_batches=4)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)
    runs: dict[str, dict] = {}
    with tqdm(
        total=len(plan.depths) * len(plan.optimizers) * plan.steps,
        desc="staleness bench",
        unit="upd",
        disable=not progress,
    ) as bar:
        for depth in plan.depths:
            for optimizer in plan.optimizers:
                splits = split_layers(config.model.n_layers, [1.0] * depth)
                workers = build_chain_workers(
                    config, splits, optimizer, compress=False, constrained=False, seed=config.run.seed
                )
                chain = PipelineChain(workers, dataset)
                curve: list[list[float]] = [[0, chain.evaluate(config.train.eval_batches)]]

                def record(done: int, chain=chain, curve=curve, name=f"P{depth}-{optimizer}") -> None:
                    curve.append([done, chain.evaluate(config.train.eval_batches)])
                    bar.set_postfix(run=name, loss=f"{curve[-1][1]:.3f}")
                    bar.update(plan.eval_every)

                chain.run(plan.steps, eval_every=plan.eval_every, on_eval=record)
                kinds = ("compute", "optimizer", "projection")
                timing = {k: sum(w.timings[k] for w in workers) for k in kinds}  # evaluation excluded
                seconds = sum(timing.values())
                max_delay = max(d for w in workers for _, d in w.staleness)
                runs[f"P{depth}-{optimizer}"] = {
                    "depth": depth,
                    "optimizer": optimizer,
                    "final_eval_loss": curve[-1][1],
                    "curve": curve,
                    "max_delay": max_delay,
                    "optimizer_share": timing["optimizer"] / sum(timing.values()),
                    "seconds": seconds,
                }
    target = summarise_targets(runs, plan.depths, plan.optimizers)
    report = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "n_layers": config.model.n_layers,
        "steps": plan.steps,
        "batch_size": plan.batch_size,
        "target_eval_loss": target,
        "depths": list(plan.depths),
        "optimizers": list(plan.optimizers),
        "runs": runs,
    }
    (out_dir / "staleness.json").write_text(json.dumps(report, indent=2))
    plot_staleness(report, out_dir / "staleness.png")
    return report


def _first_reaching(curve: list[list[float]], loss: float) -> int | None:
    return next((int(step) for step, value in curve if value <= loss), None)


def summarise_targets(
    runs: dict[str, dict], depths: tuple[int, ...] = DEPTHS, optimizers: tuple[str, ...] = OPTIMIZERS
) -> float | None:
    """Add iteration counts to each run; return the target (final eval loss of P=1 AdamW).

    `iterations_to_target`: updates until eval loss ≤ the P=1 AdamW final loss (None: not reached).
    `iterations_to_async_adamw`: updates until eval loss ≤ the final loss of AdamW at the same P (the
    paper's "fewer iterations to the same loss than the async baseline"); `fewer_iterations_vs_adamw`
    is 1 − that count / AdamW's own count at that P."""
    target = runs["P1-adamw"]["final_eval_loss"] if "P1-adamw" in runs else None
    for depth in depths:
        base = runs[f"P{depth}-adamw"]
        for optimizer in optimizers:
            run = runs[f"P{depth}-{optimizer}"]
            run["iterations_to_target"] = None if target is None else _first_reaching(run["curve"], target)
            run["iterations_to_async_adamw"] = _first_reaching(run["curve"], base["final_eval_loss"])
            run["time_overhead_vs_adamw"] = run["seconds"] / base["seconds"] - 1.0
        own = _first_reaching(base["curve"], base["final_eval_loss"])
        for optimizer in optimizers:
            run = runs[f"P{depth}-{optimizer}"]
            reached = run["iterations_to_async_adamw"]
            run["fewer_iterations_vs_adamw"] = 1.0 - reached / own if reached and own else None
    return target


def plot_staleness(report: dict, path: Path) -> None:
    """Updates to the async baseline's loss and final loss against P, and the eval curves at the deepest P."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.5))
    depths = report.get("depths", DEPTHS)
    deepest = max(depths)
    for optimizer in report.get("optimizers", OPTIMIZERS):
        its = [report["runs"][f"P{p}-{optimizer}"]["iterations_to_async_adamw"] for p in depths]
        xs = [p for p, i in zip(depths, its, strict=True) if i is not None]
        left.plot(xs, [i for i in its if i is not None], "o-", label=optimizer)
        finals = [report["runs"][f"P{p}-{optimizer}"]["final_eval_loss"] for p in depths]
        middle.plot(depths, finals, "o-", label=optimizer)
        curve = report["runs"][f"P{deepest}-{optimizer}"]["curve"]
        right.plot([step for step, _ in curve], [loss for _, loss in curve], ".-", label=optimizer)
    left.set_xscale("log", base=2)
    left.set_xlabel("pipeline stages P (max delay P−1)")
    left.set_ylabel("updates to reach async AdamW's final loss")
    left.set_title("iterations to the same loss (missing = not reached)")
    middle.set_xscale("log", base=2)
    middle.set_xlabel("pipeline stages P")
    middle.set_ylabel("final eval loss")
    middle.set_title(f"{report['config']}, {report['n_layers']} layers, {report['steps']} updates")
    right.set_xlabel("updates")
    right.set_ylabel("eval loss")
    right.set_title(f"eval loss at P = {deepest}")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
