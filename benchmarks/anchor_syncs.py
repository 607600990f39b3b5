"""Host syncs and step timing of an anchor's round, on the device it would train on.

Counts, per inner step of a real `AnchorTraining` round, the host's reads of tensor values (`HostSyncs`,
AdamW's host-side step counters apart) and, on a GPU, torch's own sync warnings
(`torch.cuda.set_sync_debug_mode`, which also sees syncs that no scalar read shows, such as `eigh`'s).
Then compares the paced clock's step time (`StepClock`: a wait every few steps) with steps timed one by
one behind a full synchronise.

    .venv/bin/python benchmarks/anchor_syncs.py --config configs/tiny.toml --device cuda --steps 32
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from hetnode.config import load_config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data import TokenDataset
from hetnode.replica.global_model import GlobalModel
from hetnode.training.host_syncs import HostSyncs, optimizer_step_counters


def counted_round(training: AnchorTraining, round_: int, cuda: bool) -> dict:
    """One round, its steps counted one by one."""
    reads, warned, step = [], [], training.trainer.train_step
    counters = optimizer_step_counters(training.trainer.optimizer)

    def counting_step(*args: object, **kwargs: object):  # noqa: ANN202
        with warnings.catch_warnings(record=True) as caught, HostSyncs(counters) as syncs:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                result = step(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        reads.append(syncs.count)
        warned.append(sum("synchroniz" in str(w.message) for w in caught))
        return result

    training.trainer.train_step = counting_step  # type: ignore[method-assign]
    with HostSyncs(counters) as whole:
        trained = training.train_round(round_)
    training.trainer.train_step = step  # type: ignore[method-assign]
    return {
        "steps": trained.steps,
        "host_reads_per_step": reads,
        "cuda_sync_warnings_per_step": warned if cuda else None,
        "host_reads_in_round": whole.count,
        "train_s": round(trained.timing.train_s, 4),
        "loss": trained.loss,
    }


def synced_step_s(training: AnchorTraining, steps: int, device: torch.device) -> float:
    """The mean step time with a full synchronise after every step (the reference)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    began = time.monotonic()
    for i in range(steps):
        training.trainer.train_step(batch_index=10_000 + i)
        sync()
    return (time.monotonic() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.toml"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=16, help="H")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/anchor_syncs"))
    args = parser.parse_args()
    config = replace(load_config(args.config), "outer", inner_steps=args.steps)
    device = torch.device(args.device)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    theta = GlobalModel(config)
    training = AnchorTraining(config, dataset, "bench-anchor", str(device))
    training.rebase(training.rebase_from(theta, next_round=0))
    training.train_round(0)  # warm-up: allocations, kernels, pinned buffers
    training.rebase(training.rebase_from(theta, next_round=1))
    result = counted_round(training, 1, device.type == "cuda")
    training.rebase(training.rebase_from(theta, next_round=2))
    training.step_s = None  # the clock's pace over one uncounted round alone
    training.train_round(2)
    result |= {
        "config": str(args.config),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "clock_step_s": training.step_s,
        "synced_step_s": synced_step_s(training, args.steps, device),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{config.run.name}-{device.type}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
