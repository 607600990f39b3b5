"""What the basis-rotated optimiser costs per step: the FLOP model per config, and a timed CPU step.

Part 1 prints, for each config, the FLOPs `RotatedAdamW` adds to a step (hetnode/algo/rotation_cost.py) as a
share of the step's 6 · params · batch · seq: two-sided, one-sided, and with the `inner.rotation_budget` rule;
for the whole model and for the worst stage of an even `pipeline.stages` split (stages without the embedding
or the head have the largest share). Part 2 times, on this machine, a full training step of one config (random
tokens of the config's batch shape) for AdamW, rotated two-sided and the rule, interleaved step by step.

    PYTHONPATH=. .venv/bin/python benchmarks/rotation_cost.py --config configs/small.toml --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hetnode.algo.optim import build_optimizer, is_rotated
from hetnode.algo.rotation_cost import Bases, Overhead, full_bases, overhead, plan_bases
from hetnode.config import Config, load_config, replace
from hetnode.model import build_model
from hetnode.model.decoder import parameter_shapes
from hetnode.planning.layer_split import split_layers

CONFIGS = ("tiny", "small", "178m", "1b")


def _rotated(name: str, shape: tuple[int, ...]) -> bool:
    return is_rotated(name, torch.empty(shape, device="meta"))


def stage_shapes(config: Config) -> list[dict[str, tuple[int, ...]]]:
    """Each stage's parameters under an even split: its blocks, the embedding first, norm and head last."""
    shapes = parameter_shapes(config.model)
    splits = split_layers(config.model.n_layers, [1.0] * config.pipeline.stages)
    stages = []
    for i, layers in enumerate(splits):
        prefixes = tuple(f"blocks.{layer}." for layer in layers)
        extra = (("embed.",) if i == 0 else ()) + (("norm.", "head.") if i == len(splits) - 1 else ())
        stages.append({n: s for n, s in shapes.items() if n.startswith(prefixes + extra)})
    return stages


def flop_row(config: Config) -> dict:
    inner, tokens = config.inner, config.data.batch_size * config.data.seq_len
    k = inner.rotation_refresh
    choices = {
        "two_sided": lambda m, n: full_bases(m, n, one_sided=False),
        "one_sided": lambda m, n: full_bases(m, n, one_sided=True),
        "rule": lambda m, n: plan_bases(m, n, tokens, inner.rotation_budget, k),
    }
    shapes = parameter_shapes(config.model)
    row: dict = {"params": sum(_numel(s) for s in shapes.values()), "tokens": tokens}
    row["step_tflop"] = 6 * row["params"] * tokens / 1e12
    for label, choose in choices.items():
        whole = overhead(shapes, _rotated, tokens, k, choose)
        stages = [overhead(s, _rotated, tokens, k, choose) for s in stage_shapes(config)]
        row[label] = _parts(whole) | {"worst_stage": max(s.per_step for s in stages)}
    rotated = {tuple(s) for n, s in shapes.items() if len(s) == 2 and _rotated(n, s)}
    row["rule_bases"] = sorted({f"{m}x{n}: {_describe(choices['rule'](m, n), m, n)}" for m, n in rotated})
    return row


def _parts(cost: Overhead) -> dict:
    f = cost.flops
    return {
        "share": cost.per_step,
        "statistics": f.statistics / cost.step,
        "rotations": f.rotations / cost.step,
        "refresh": f.refresh / cost.step,
        "eigh_once_steps": cost.eigh_once,
    }


def _describe(bases: Bases, m: int, n: int) -> str:
    if not bases.rotated:
        return "none"
    if bases.left and bases.right:
        return "two-sided"
    block, size, side = (bases.left, m, "left") if bases.left else (bases.right, n, "right")
    return f"one-sided {side}" + ("" if block == size else f", {size // block} blocks of {block}")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def time_steps(config: Config, steps: int) -> dict:
    """Mean forward+backward and optimiser seconds per step after step 1 (timed apart: the eigh)."""
    batch, seq = config.data.batch_size, config.data.seq_len
    inner = replace(config, "inner", optimizer="rotated_adamw").inner
    base = build_model(config.model, seed=config.run.seed)
    variants = {}
    for label, name, tokens in (
        ("adamw", "adamw", None),
        ("rotated two-sided", "rotated_adamw", None),
        ("rotated, rule", "rotated_adamw", batch * seq),
    ):
        model = build_model(config.model, seed=config.run.seed)
        model.load_state_dict(base.state_dict())
        variants[label] = (model, build_optimizer(model, inner, name, tokens_per_step=tokens))
    generator = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, list[float]]] = {v: {"model": [], "optimizer": []} for v in variants}
    for _ in range(steps + 1):
        tokens = torch.randint(0, config.model.vocab_size, (batch, seq + 1), generator=generator)
        for label, (model, opt) in variants.items():
            opt.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            middle = time.perf_counter()
            opt.step()
            times[label]["model"].append(middle - start)
            times[label]["optimizer"].append(time.perf_counter() - middle)
        print(f"step {len(times['adamw']['model'])}/{steps + 1}", file=sys.stderr, flush=True)
    out = {}
    for label, t in times.items():
        model_s, opt_s = statistics.mean(t["model"][1:]), statistics.mean(t["optimizer"][1:])
        out[label] = {
            "model_s": model_s,
            "optimizer_s": opt_s,
            "step_s": model_s + opt_s,
            "optimizer_share": opt_s / (model_s + opt_s),
            "first_optimizer_s": t["optimizer"][0],
        }
    adamw = out["adamw"]["step_s"]
    for row in out.values():
        row["step_vs_adamw"] = row["step_s"] / adamw
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/small.toml"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps after step 1 (refresh every 10)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rotation-cost"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the timed steps")
    parser.add_argument("--flops-only", action="store_true", help="print the FLOP table, time nothing")
    parser.add_argument(
        "--profile", action="store_true", help="also write profile.txt: where the rule's optimiser step goes"
    )
    args = parser.parse_args()
    flops = {name: flop_row(load_config(Path("configs") / f"{name}.toml")) for name in CONFIGS}
    print("| config | params | tokens/step | step TFLOP | two-sided | one-sided | rule | rule, worst stage |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in flops.items():
        cells = [f"{100 * r[k]['share']:.1f} %" for k in ("two_sided", "one_sided", "rule")]
        worst = f"{100 * r['rule']['worst_stage']:.1f} %"
        size = f"{r['params'] / 1e6:.1f} M | {r['tokens']} | {r['step_tflop']:.3f}"
        print(f"| {name} | {size} | {' | '.join(cells)} | {worst} |")
    print("\n| config | variant | statistics | rotations | refresh (amortised) | eigh at step 1 (steps) |")
    print("|---|---|---|---|---|---|")
    for name, r in flops.items():
        for variant in ("two_sided", "one_sided", "rule"):
            p = r[variant]
            parts = " | ".join(f"{100 * p[k]:.1f} %" for k in ("statistics", "rotations", "refresh"))
            print(f"| {name} | {variant} | {parts} | {p['eigh_once_steps']:.2f} |")
    for name, r in flops.items():
        print(f"{name} rule: " + "; ".join(r["rule_bases"]))
    if args.flops_only:
        return
    config = load_config(args.config)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    timed = time_steps(config, args.steps)
    load_after = os.getloadavg()
    print(
        f"\n{args.config}: {args.steps} steps of {config.data.batch_size} x {config.data.seq_len} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "| optimiser | forward+backward | optimiser | step | optimiser share | vs AdamW | step 1 optimiser |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, r in timed.items():
        print(
            f"| {label} | {r['model_s']:.3f} s | {r['optimizer_s']:.3f} s | {r['step_s']:.3f} s | "
            f"{100 * r['optimizer_share']:.1f} % | {r['step_vs_adamw']:.2f}x | "
            f"{r['first_optimizer_s']:.3f} s |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "flops": flops,
        "timed": {
            "config": str(args.config),
            "steps": args.steps,
            "threads": torch.get_num_threads(),
            "load_average_1_5_15_min": {"before": load_before, "after": load_after},
            "torch": torch.__version__,
            "variants": timed,
        },
    }
    (args.out / "rotation_cost.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'rotation_cost.json'}")
    if args.profile:
        (args.out / "profile.txt").write_text(profile_rule(config))
        print(f"wrote {args.out / 'profile.txt'}")


def profile_rule(config: Config, steps: int = 3) -> str:
    """torch.profiler's table of the rule's optimiser steps 2 to 1 + `steps` (step 1 holds the eigh)."""
    from torch.profiler import profile

    batch, seq = config.data.batch_size, config.data.seq_len
    inner = replace(config, "inner", optimizer="rotated_adamw").inner
    model = build_model(config.model, seed=config.run.seed)
    opt = build_optimizer(model, inner, tokens_per_step=batch * seq)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (batch, seq + 1), generator=generator)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    with profile() as prof:
        for _ in range(steps):
            opt.step()  # the same gradient again: the optimiser's work does not depend on its values
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return (
        f"{config.run.name}, the rule, {steps} optimiser steps, {torch.get_num_threads()} threads\n{table}\n"
    )


if __name__ == "__main__":
    main()
