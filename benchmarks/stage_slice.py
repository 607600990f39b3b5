"""What a chain stage holds and downloads against an anchor: θ bytes, process memory, and the sealed
download per contributor per round, for each stage of a P-stage chain (issue 15: a stage's memory and
its sealed download scale with its slice).

Memory is measured in a fresh process per part: the resident memory that building the part's θ and its
stage module added (θ plus the module's own copy of the weights). Download bytes are the real encoded
SparseLoCo payloads of the shards the part holds (random pseudo-gradients: the sizes are fixed by the
shapes and the codec, not by the values).

    .venv/bin/python benchmarks/stage_slice.py --configs small 178m --stages 2 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held_memory(config_name: str, stages: int, index: int) -> None:
    """Child process: build the part's θ and stage module, print the RSS they added in MiB (index −1:
    an anchor), measured against the same process with everything imported."""
    import torch

    from hetnode.config import load_config
    from hetnode.model.decoder import DecoderStage
    from hetnode.model.shards import ModelPart
    from hetnode.planning.layer_split import split_layers
    from hetnode.replica.global_model import GlobalModel

    torch.zeros(1) + 1  # let torch finish its lazy start-up before the baseline
    baseline = resident_mib()
    config = load_config(ROOT / "configs" / f"{config_name}.toml")
    n = config.model.n_layers
    splits = split_layers(n, [1.0] * stages)
    part = ModelPart.whole(n) if index < 0 else ModelPart.of_stage(splits, index)
    model = GlobalModel(config, part=part)
    module = DecoderStage(config.model, part.layers, part.first, part.last, seed=config.run.seed)
    theta_bytes = sum(4 * t.numel() for t in model.params.values())
    held = resident_mib() - baseline
    del module, torch
    print(json.dumps({"theta_mib": theta_bytes / 2**20, "rss_mib": held}))


def payload_bytes(config_name: str, stages: int) -> dict[str, int]:
    """Encoded sparse payload bytes per shard of one contributor (the whole model's shards)."""
    import torch

    from hetnode.algo.sparseloco import SparseLoCoCodec
    from hetnode.config import load_config
    from hetnode.replica.global_model import GlobalModel
    from hetnode.wire.sync_payload import SyncPayload, encode_payload

    config = load_config(ROOT / "configs" / f"{config_name}.toml")
    model = GlobalModel(config)
    codec = SparseLoCoCodec(config.outer.topk, config.outer.tile)
    generator = torch.Generator().manual_seed(0)
    sizes = {}
    for shard, names in model.shards.items():
        tensors = {n: codec.compress(torch.randn(model.params[n].shape, generator=generator)) for n in names}
        sizes[shard] = len(encode_payload(SyncPayload("peer", 0, shard, "sparseloco", tensors)))
    return sizes


def measure(config_name: str, stages: int, sizes: dict[str, int]) -> list[dict]:
    from hetnode.config import load_config
    from hetnode.model.shards import ModelPart
    from hetnode.planning.layer_split import split_layers

    config = load_config(ROOT / "configs" / f"{config_name}.toml")
    n = config.model.n_layers
    splits = split_layers(n, [1.0] * stages)
    rows = []
    for index in [-1, *range(stages)]:
        part = ModelPart.whole(n) if index < 0 else ModelPart.of_stage(splits, index)
        shards = [str(i) for i in part.layers] + ["embed"] * part.first + ["head"] * part.last
        out = subprocess.run(
            [sys.executable, __file__, "--child", config_name, str(stages), str(index)],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        memory = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "config": config_name,
                "stages": stages,
                "part": "anchor" if index < 0 else f"stage {index}",
                "layers": f"{part.layers.start}..{part.layers.stop - 1}",
                **{k: round(v, 1) for k, v in memory.items()},
                "download_per_contributor_kib": round(sum(sizes[s] for s in shards) / 1024, 1),
            }
        )
    whole = rows[0]
    for row in rows:
        row["theta_share"] = round(row["theta_mib"] / whole["theta_mib"], 3)
        row["rss_share"] = round(row["rss_mib"] / whole["rss_mib"], 3)
        row["download_share"] = round(
            row["download_per_contributor_kib"] / whole["download_per_contributor_kib"], 3
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["small", "178m"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stage_slice.json")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        config_name, stages, index = args.child
        held_memory(config_name, int(stages), int(index))
        return
    rows = []
    for config_name in args.configs:
        sizes = payload_bytes(config_name, 1)
        for stages in args.stages:
            for row in measure(config_name, stages, sizes):
                rows.append(row)
                print(
                    f"{row['config']:>5} P={row['stages']} {row['part']:<8} layers {row['layers']:<6} "
                    f"θ {row['theta_mib']:8.1f} MiB ({row['theta_share']:.2f})  "
                    f"RSS +{row['rss_mib']:8.1f} MiB ({row['rss_share']:.2f})  "
                    f"download {row['download_per_contributor_kib']:9.1f} KiB/contributor "
                    f"({row['download_share']:.2f})",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
