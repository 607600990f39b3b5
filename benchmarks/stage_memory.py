"""Stage 0's peak memory with P micro-batches in flight, before (every graph kept) and after recomputation
in backward (issue 36): measured on CPU at a small size, where the analytic model must agree with it, and
modelled at 178m and 1b (fp32 as the worker runs today, and bf16 autocast on a GPU).

    .venv/bin/python benchmarks/stage_memory.py --config small --stages 3 4

Writes stage_memory.json and stage_memory.md under benchmarks/results/stage-memory/ (see
`hetnode.lab.experiments.stage_memory` for what is counted and how).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hetnode.config import load_config, replace
from hetnode.lab.experiments.stage_memory import BF16_AUTOCAST, FP32, GiB, measure_stage0, model_stage

ROOT = Path(__file__).resolve().parents[1]
MODELLED = ("178m", "1b")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/stage-memory")
    args = parser.parse_args()
    config = load_config(ROOT / "configs" / f"{args.config}.toml")
    report: dict = {"measured": [], "modelled": []}
    lines = [
        f"Measured: stage 0 of `{args.config}` on CPU (fp32), MiB; model = the analytic model, fp32.",
        "",
        "| P | in flight | recompute | peak | model peak | activations | model act. | snapshots | model snap."
        " | optimizer | model opt. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stages in args.stages:
        cfg = replace(config, "pipeline", stages=stages)
        for recompute in (False, True):
            got = measure_stage0(cfg, stages, recompute)
            want = model_stage(cfg, stages, 0, recompute, FP32)
            report["measured"].append(
                {"stages": stages, "recompute": recompute, "measured": got, "model": want}
            )
            m, p = got["part_max"], want["parts"]
            lines.append(
                f"| {stages} | {got['in_flight']} | {'yes' if recompute else 'no'} | {_mib(got['peak'])} "
                f"| {_mib(want['peak'])} | {_mib(m['activations'])} | {_mib(p['activations'])} "
                f"| {_mib(m['snapshots'])} | {_mib(p['snapshots'])} | {_mib(m['optimizer'])} "
                f"| {_mib(p['optimizer'])} |"
            )
    lines += [
        "",
        "Modelled: stage 0, GiB (weights, gradients, optimiser state fp32; `chain_optimizer` of the config).",
        "",
        "| config | P | precision | recompute | peak | weights+grads | snapshots | optimizer | activations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in MODELLED:
        cfg = load_config(ROOT / "configs" / f"{name}.toml")
        stages = cfg.pipeline.stages
        for precision in (BF16_AUTOCAST, FP32):
            for recompute in (False, True):
                want = model_stage(cfg, stages, 0, recompute, precision)
                report["modelled"].append(
                    {"config": name, "precision": precision.name, "recompute": recompute, **want}
                )
                p = want["parts"]
                lines.append(
                    f"| {name} | {stages} | {precision.name} | {'yes' if recompute else 'no'} "
                    f"| {want['peak'] / GiB:.2f} | {(p['weights'] + p['grads']) / GiB:.2f} "
                    f"| {p['snapshots'] / GiB:.2f} | {p['optimizer'] / GiB:.2f} "
                    f"| {p['activations'] / GiB:.2f} |"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stage_memory.json").write_text(json.dumps(report, indent=2))
    (args.out / "stage_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
