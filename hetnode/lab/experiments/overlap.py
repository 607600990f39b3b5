"""`hetnode bench overlap`: how much honest contributions overlap, to set the duplicate-grouping rule from
data (issue 34).

The verifier calls two contributions copies when `index_overlap(a, b)` (|A∩B| / min(|A|, |B|) over the
top-k positions both sent) reaches a threshold. An attacker can re-sign one training under several
identities and move a share f of its positions to pass (f = 0.12 gives overlap 0.88 < 0.9). This measures
what honest pairs actually show, on real payloads: for every R, R honest replicas train a few SparseLoCo
rounds in process (`influence.honest_rounds`, the same θ⁰, disjoint data slots) and each round's decoded
payloads are compared:
- honest pairs: `index_overlap` and the cosine of the two sparse vectors (dot over norms, all tensors both
  sent), min / median / max per R and round;
- own previous round: each replica against its own payload of the round before (what a replayed old
  payload would be compared with);
- perturbed copy: one honest payload with a share f of its positions moved, per tensor, to random
  unselected positions of the same tile (values kept, still exactly k per tile: a valid payload), against
  the original.
The suggested threshold is the smallest multiple of 0.05 at least `MARGIN` above the largest honest pair
overlap seen at any R and round; the report lists which perturbation shares it still catches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from hetnode.algo.aggregate import SparseUpdate  # noqa: E402
from hetnode.algo.scoring import index_overlap  # noqa: E402
from hetnode.algo.sparseloco import SparseLoCoCodec  # noqa: E402
from hetnode.config import Config, replace  # noqa: E402
from hetnode.errors import ConfigError  # noqa: E402
from hetnode.lab.experiments.influence import InfluencePlan, honest_rounds  # noqa: E402
from hetnode.lab.experiments.overlap_report import plot_overlap, suggest  # noqa: E402
from hetnode.model import count_parameters  # noqa: E402

log = logging.getLogger(__name__)

FRACTIONS = (0.05, 0.12, 0.25, 0.5, 0.75)
Payload = dict[str, SparseUpdate]


@dataclass(frozen=True)
class OverlapPlan:
    replica_counts: tuple[int, ...]  # R values, each a separate honest run
    rounds: int
    batch_size: int
    inner_steps: int = 30
    topk: int = 64
    tile: int = 64
    fractions: tuple[float, ...] = FRACTIONS


def plan_for(
    quick: bool,
    replica_counts: tuple[int, ...] = (),
    rounds: int | None = None,
    batch_size: int | None = None,
    inner_steps: int | None = None,
) -> OverlapPlan:
    """--quick: R in {2, 4, 8}, 3 rounds, batch 8; full: R in {2, 4, 8, 16}, 5 rounds, batch 4; H = 30."""
    if any(r < 2 for r in replica_counts):
        raise ConfigError("--replicas", "bench overlap", f"every R must be >= 2, got {replica_counts}")
    for flag, value in (("--rounds", rounds), ("--batch-size", batch_size), ("--inner-steps", inner_steps)):
        if value is not None and value < 1:
            raise ConfigError(flag, "bench overlap", f"must be >= 1, got {value}")
    if quick:
        plan = OverlapPlan(replica_counts or (2, 4, 8), rounds or 3, batch_size=batch_size or 8)
    else:
        plan = OverlapPlan(replica_counts or (2, 4, 8, 16), rounds or 5, batch_size=batch_size or 4)
    return dataclasses.replace(plan, inner_steps=inner_steps or plan.inner_steps)


def _norm_sq(payload: Payload) -> float:
    return sum(float(vals.double().square().sum()) for _, vals in payload.values())


def cosine(a: Payload, b: Payload, shapes: dict[str, tuple[int, ...]]) -> float:
    """Dense-equivalent cosine of two sparse updates over the tensors both sent (0 when either is zero)."""
    dot = norm_a = norm_b = 0.0
    for name in sorted(set(a) & set(b)):
        (ia, va), (ib, vb) = a[name], b[name]
        dense = torch.zeros(math.prod(shapes[name]), dtype=torch.float64)
        dense[ia.reshape(-1).long()] = va.reshape(-1).double()
        dot += float((dense[ib.reshape(-1).long()] * vb.reshape(-1).double()).sum())
        norm_a += float(va.double().square().sum())
        norm_b += float(vb.double().square().sum())
    return dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else 0.0


def perturb(
    payload: Payload,
    shapes: dict[str, tuple[int, ...]],
    codec: SparseLoCoCodec,
    fraction: float,
    gen: torch.Generator,
) -> Payload:
    """A copy with round(fraction · k·tiles) of each tensor's positions moved to random unselected ones of
    the same tile, values kept: still exactly k per tile (a payload the wire format accepts)."""
    out: Payload = {}
    for name, (idx, vals) in payload.items():
        grid = codec.grid(shapes[name])
        k, elems, tiles = grid.k, grid.tile_elems, grid.num_tiles
        flat = idx.reshape(-1).long()
        if elems - k < k or flat.numel() != grid.total_selected:
            out[name] = (idx, vals)  # nowhere to move to (a tile that keeps most of itself): left as is
            continue
        mask = torch.zeros(grid.numel, dtype=torch.int8)
        mask[flat] = 1
        dense = torch.zeros(grid.numel, dtype=torch.float32)
        dense[flat] = vals.reshape(-1).float()
        order = torch.sort(grid.to_tiles(mask.reshape(grid.shape)), dim=1, descending=True, stable=True)[1]
        selected, unselected = order[:, :k], order[:, k:]  # within-tile positions
        kept = grid.to_tiles(dense.reshape(grid.shape)).gather(1, selected)
        moved = torch.zeros(tiles * k, dtype=torch.bool)
        moved[torch.randperm(tiles * k, generator=gen)[: round(fraction * tiles * k)]] = True
        moved = moved.reshape(tiles, k)
        nth = (torch.cumsum(moved.long(), dim=1) - 1).clamp(min=0)  # the j-th moved entry of its tile
        shuffled = torch.argsort(torch.rand(tiles, elems - k, generator=gen), dim=1)
        target = unselected.gather(1, shuffled.gather(1, nth))  # distinct unselected slots per tile
        positions = torch.where(moved, target, selected)
        out[name] = (grid.flat_indices(positions), kept.reshape(-1))
    return out


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def measure_round(
    payloads: list[tuple[str, Payload]],
    previous: dict[str, Payload] | None,
    shapes: dict[str, tuple[int, ...]],
    plan: OverlapPlan,
    seed: int,
) -> dict:
    """One round's honest pairs, each replica against its own previous payload, and perturbed copies of the
    first replica's payload."""
    overlaps, cosines = [], []
    for i in range(len(payloads)):
        for j in range(i + 1, len(payloads)):
            a, b = payloads[i][1], payloads[j][1]
            overlaps.append(index_overlap(a, b))
            cosines.append(cosine(a, b, shapes))
    own_overlap, own_cosine = [], []
    for who, payload in payloads:
        if previous and who in previous:
            own_overlap.append(index_overlap(payload, previous[who]))
            own_cosine.append(cosine(payload, previous[who], shapes))
    codec = SparseLoCoCodec(plan.topk, plan.tile)
    gen = torch.Generator().manual_seed(seed)
    original = payloads[0][1]
    perturbed = {}
    for f in plan.fractions:
        copy = perturb(original, shapes, codec, f, gen)
        perturbed[str(f)] = {
            "overlap": index_overlap(copy, original),
            "cosine": cosine(copy, original, shapes),
            "norm_ratio": math.sqrt(_norm_sq(copy) / _norm_sq(original)),
        }
    return {
        "pairs": {"overlap": _stats(overlaps), "cosine": _stats(cosines)},
        "own_previous": {"overlap": _stats(own_overlap), "cosine": _stats(own_cosine)},
        "perturbed": perturbed,
        # what two payloads with independent random positions would share (k of tile_elems per tile)
        "random_overlap": plan.topk / (plan.tile * plan.tile),
    }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(load_before: tuple[float, float, float], started: float) -> dict:
    """The machine and commit a result came from (as benchmarks/machine_info.py records them)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }


def run_overlap(config: Config, plan: OverlapPlan, out_dir: Path, progress: bool = True) -> dict:
    """Measure every R and round of `plan`; write overlap.json and overlap.png to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started, load_before, start = time.time(), os.getloadavg(), time.perf_counter()
    config = replace(config, "data", batch_size=plan.batch_size)
    by_replicas: dict[str, dict] = {}
    for replicas in plan.replica_counts:
        run_start = time.perf_counter()
        honest = InfluencePlan(
            replicas=replicas,
            rounds=plan.rounds,
            batch_size=plan.batch_size,
            inner_steps=plan.inner_steps,
            topk=plan.topk,
        )
        rounds, previous = [], None
        for round_, shapes, payloads in honest_rounds(config, honest, progress):
            measured = measure_round(payloads, previous, shapes, plan, seed=config.run.seed + round_)
            rounds.append({"round": round_, **measured})
            previous = dict(payloads)
            log.info("R=%d round %d: pair overlap %s", replicas, round_, measured["pairs"]["overlap"])
        by_replicas[str(replicas)] = {"rounds": rounds, "seconds": time.perf_counter() - run_start}
    report = {
        "config": config.run.name,
        "parameters": count_parameters(config.model),
        "replica_counts": list(plan.replica_counts),
        "rounds": plan.rounds,
        "inner_steps": plan.inner_steps,
        "batch_size": plan.batch_size,
        "topk": plan.topk,
        "tile": plan.tile,
        "fractions": list(plan.fractions),
        "by_replicas": by_replicas,
        "suggestion": suggest(by_replicas, plan.fractions),
        "wall_seconds": time.perf_counter() - start,
        "machine": machine(load_before, started),
    }
    (out_dir / "overlap.json").write_text(json.dumps(report, indent=2))
    plot_overlap(report, out_dir / "overlap.png")
    return report
