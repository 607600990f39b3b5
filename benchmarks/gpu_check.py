"""GPU check: bf16 training throughput at `178m`, a GPU chain stage against a CPU one, and a GPU anchor and a
CPU anchor agreeing on θ.

Part `smoke` (first, seconds): Python, torch, CUDA, protobuf, grpc, hivemind and pydantic versions, and a
`p2pd` started and stopped on loopback: a machine that cannot run the rest says so before it spends minutes.
Part `train`: `InnerTrainer` on CUDA (bf16 autocast, fp32 master weights) trains `configs/178m.toml` for a
few hundred steps; reports tokens/s, an MFU estimate and peak GPU memory.
Part `digests`: a coordinator, an anchor with `--device cuda` and an anchor on CPU, real daemons on
127.0.0.1, train `configs/small.toml` for a few sealed rounds; every anchor's published layer digests must
equal the coordinator's record of its round (θ, error feedback, codec and outer step run on CPU in fp32,
so the device an anchor trains on must not show in θ).
Part `stage`: a two-stage chain of `small` (`StageTraining`, as a chain member runs it) on the GPU and on the
CPU, micro-batches a second each; and stage 0 of `178m`'s four on the GPU with its window of micro-batches
in flight (recomputed in backward): its peak memory.

    bash benchmarks/gpu_check.sh                                   # on a CUDA machine, < 4 minutes
    .venv/bin/python benchmarks/gpu_check.py --cpu-only --smoke    # the same orchestration on CPU

Everything goes to the folder `--out` (default benchmarks/results/gpu-check): `gpu_check.json`, rewritten
after each part (a run cut short by its time limit still leaves what it measured), and under `work/` every
daemon's log and the data cache. Exit status 0 only when every part ran and passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetnode.config import Config, dump_config, load_config, replace
from hetnode.daemon.stage_training import StageTraining, stage_part
from hetnode.data import TokenDataset
from hetnode.lab.demo.digests import compare_digests, hold_round
from hetnode.lab.demo.swarm import read_jsonl
from hetnode.lab.procs import HETNODE, LabProcess
from hetnode.lab.swarm import Launcher, Member
from hetnode.model import build_model, count_parameters
from hetnode.replica.global_model import GlobalModel
from hetnode.training.precision import autocast_dtype
from hetnode.training.trainer import InnerTrainer
from hetnode.wire.round_history import merge_history

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of torch.cuda.get_device_name().
# Checked in order: the first match wins.
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)
# The one-machine timings of configs/tiny.toml: `small`'s defaults are for real links and would make
# each round wait tens of seconds on a loopback where the DHT answers in milliseconds.
FAST_NETWORK = {"heartbeat_s": 1.0, "record_ttl_s": 4.0, "boundary_s": 3.0, "confirm_s": 1.5, "probe_s": 3.0}


def thread_cap(processes: int) -> list[str]:
    """An `env` prefix giving each of `processes` daemons its share of the cores: torch's default, one thread
    per core each, oversubscribes the machine and every one of them slows down."""
    threads = max(1, (os.cpu_count() or 1) // processes)
    return ["env", f"OMP_NUM_THREADS={threads}", f"MKL_NUM_THREADS={threads}"]


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# -- part 0: smoke: versions and p2pd ---------------------------------------------------------------------


def check_smoke() -> dict[str, Any]:
    """What this machine runs, and a `p2pd` started and stopped on loopback (hivemind's daemon, from its
    wheel): the first seconds of a device loan say whether the rest can run."""
    import importlib.metadata as metadata

    started = time.perf_counter()
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("protobuf", "grpcio", "hivemind", "pydantic", "cryptography", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    result: dict[str, Any] = {"versions": versions, "cuda": torch.version.cuda}
    result["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        import asyncio

        from hivemind.p2p import P2P

        async def up_and_down() -> str:
            p2p = await P2P.create(host_maddrs=[LOOPBACK])
            try:
                return str(p2p.peer_id)
            finally:
                await p2p.shutdown()

        result["p2pd_peer"] = asyncio.run(asyncio.wait_for(up_and_down(), timeout=25))
        result["ok"] = True
    except Exception as exc:  # the reason goes into the JSON: the rest would fail the same way
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["ok"] = False
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


# -- part 1: training throughput -------------------------------------------------------------------------


def peak_flops(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    for key, flops in PEAK_BF16:
        if key in device_name:
            return flops, f"dense bf16 peak of {key}"
    return None, f"unknown device {device_name!r}: pass --peak-tflops"


def flops_per_token(config: Config) -> int:
    """6·N for the matrices (forward + backward; the embedding lookup is no matmul) plus the attention
    scores, 12·L·d·T (PaLM, arXiv 2204.02311, appendix B)."""
    m = config.model
    matrix_params = count_parameters(m) - m.vocab_size * m.d_model
    return 6 * matrix_params + 12 * m.n_layers * m.d_model * config.data.seq_len


def check_training(
    config_path: Path, steps: int, device: str, data_dir: Path, deadline: Deadline, peak_tflops: float | None
) -> dict[str, Any]:
    config = load_config(config_path)
    config = replace(config, "train", max_steps=max(steps, config.train.max_steps))
    # the bundled corpus, not the run's prepared source (throughput does not depend on the text); its
    # few epochs' guard would refuse it, rightly, for a real run
    config = replace(config, "data", source="wiki", tokenizer_sha256="")
    config = replace(config, "train", max_epochs=0.0)
    start = time.perf_counter()
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed, data_dir=data_dir)
    data_seconds = time.perf_counter() - start
    trainer = InnerTrainer(config, build_model(config.model, seed=config.run.seed), dataset, device=device)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warmup = min(10, max(1, steps // 10))  # first steps pay for kernel selection and allocator growth
    losses: list[float] = []
    timed_start, timed_tokens = 0.0, 0
    for step in range(steps):
        if step == warmup:
            sync()
            timed_start, timed_tokens = time.perf_counter(), trainer.tokens
        losses.append(trainer.train_step().loss)
        if deadline.left() < 0:
            break
    sync()
    seconds = time.perf_counter() - timed_start
    timed_steps = max(0, len(losses) - warmup)
    tokens_per_s = (trainer.tokens - timed_tokens) / seconds if timed_steps else None
    per_token = flops_per_token(config)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    peak, peak_source = peak_flops(name, peak_tflops) if cuda else (None, "no MFU on CPU")
    result: dict[str, Any] = {
        "config": str(config_path),
        "device": device,
        "device_name": name,
        "autocast": str(autocast_dtype(device)),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "parameters": count_parameters(config.model),
        "tokens_per_step": config.data.batch_size * config.data.seq_len,
        "steps": len(losses),
        "warmup_steps_untimed": warmup,
        "timed_seconds": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s, 1) if tokens_per_s else None,
        "flops_per_token": per_token,
        "flops_formula": "6*(params - embedding) + 12*n_layers*d_model*seq_len",
        "peak_flops_assumed": peak,
        "peak_flops_source": peak_source,
        "mfu": round(per_token * tokens_per_s / peak, 4) if peak and tokens_per_s else None,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "data_build_seconds": round(data_seconds, 2),
        "train_windows": dataset.num_train_windows,
        "cut_short_by_deadline": len(losses) < steps,
    }
    if cuda:
        result["peak_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        result["peak_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    result["ok"] = timed_steps > 0 and all(math.isfinite(loss) for loss in losses)
    return result


# -- part 3: a chain stage on the GPU ------------------------------------------------------------------------


def _two_stages(config: Config, device: str, data_dir: Path) -> list[StageTraining]:
    n = config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed, data_dir=data_dir)
    compressed = config.pipeline.compression != "none"
    stages = [
        StageTraining(config, splits, i, "gpu-check", dataset if i == 0 else None, device=device)
        for i in range(2)
    ]
    for i, stage in enumerate(stages):
        stage.rebase(stage.rebase_from(GlobalModel(config, part=stage_part(splits, i, compressed))))
    stages[0].begin_round(0)
    stages[1].begin_round(0, stages[0].drift_base)
    return stages


def stage_tokens_per_s(
    config: Config, device: str, micro_batches: int, data_dir: Path, deadline: Deadline
) -> float:
    """Micro-batches through a two-stage chain on `device`, one after another (forward down, backward up),
    as tokens a second of the chain; the first two are not timed (kernel selection, allocator growth)."""
    first, last = _two_stages(config, device, data_dir)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    tokens, started = 0, 0.0
    for i in range(micro_batches + 2):
        if i == 2:
            sync()
            tokens, started = 0, time.perf_counter()
        mb, batch = first.next_batch()
        last.forward(mb, first.forward(mb, batch))
        first.backward(mb, last.backward(mb))
        tokens += batch[0].numel()
        if deadline.left() < 0:
            break
    sync()
    return tokens / (time.perf_counter() - started) if tokens else 0.0


def stage_peak_memory_gib(config: Config, stages: int) -> dict[str, Any]:
    """Stage 0 of `stages` on the GPU with its 1F1B window (`stages` micro-batches) in flight, then their
    backwards with random gradients: the allocator's peak."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    n = config.model.n_layers
    per = n // stages
    splits = [range(i * per, n if i == stages - 1 else (i + 1) * per) for i in range(stages)]
    worker = StageTraining(config, splits, 0, "gpu-check", _Synthetic(config), device="cuda").worker
    data = _Synthetic(config)
    sent = [worker.forward(mb, data.train_batch(0, 1, mb)) for mb in range(stages)]
    for mb, frame in enumerate(sent):
        worker.backward(mb, torch.randn_like(frame.tensor, dtype=torch.float32) * 1e-4)
    torch.cuda.synchronize()
    return {
        "config": config.run.name,
        "stages": stages,
        "in_flight": stages,
        "peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
    }


class _Synthetic:
    """Random token batches of the config's shape: stage memory does not depend on the text."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def train_batch(self, slot: int, slots: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, m = self.config.data, self.config.model
        window = torch.randint(
            0, m.vocab_size, (d.batch_size, d.seq_len + 1), generator=torch.Generator().manual_seed(index)
        )
        return window[:, :-1], window[:, 1:]


def check_stage(
    config_path: Path, memory_config: Path, micro_batches: int, gpu: str, data_dir: Path, deadline: Deadline
) -> dict[str, Any]:
    config = load_config(config_path)
    result: dict[str, Any] = {"config": str(config_path), "micro_batches": micro_batches}
    rates = {}
    for device in dict.fromkeys((gpu, "cpu")):
        rates[device] = stage_tokens_per_s(config, device, micro_batches, data_dir, deadline)
    result["tokens_per_s"] = {d: round(r, 1) for d, r in rates.items()}
    if gpu == "cuda" and rates.get("cpu"):
        result["gpu_over_cpu"] = round(rates["cuda"] / rates["cpu"], 2)
    if gpu == "cuda":
        memory = load_config(memory_config)
        result["stage0_memory"] = stage_peak_memory_gib(memory, memory.pipeline.stages)
    result["ok"] = all(r > 0 for r in rates.values())
    return result


# -- part 2: a GPU anchor and a CPU anchor, digests --------------------------------------------------------


class Swarm:
    """A coordinator and anchors as real daemons on loopback (the lab's launcher, `hetnode/lab/swarm.py`);
    `close` stops them in order, p2pd included."""

    def __init__(self, work: Path, daemons: int = 3) -> None:
        self.launcher = Launcher(work, outside=lambda name: thread_cap(daemons))

    @property
    def processes(self) -> list[LabProcess]:
        return self.launcher.processes

    def wait_ready(self, process: LabProcess, deadline: Deadline) -> dict[str, str]:
        return self.launcher.wait_ready(process, max(1.0, deadline.left()))

    def status(self, maddr: str) -> dict[str, Any] | None:
        argv = [*HETNODE, "status", "--peer", maddr, "--json", "--timeout", "20", "--listen", LOOPBACK]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
            return json.loads(done.stdout) if done.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError):
            return None

    def close(self) -> list[int]:
        """Peers first, then the coordinator (each group SIGTERMed together); returns killed leftovers."""
        self.launcher.stop(grace_s=30.0)
        return self.launcher.kill_leftovers(only="p2pd")


def check_digests(
    config_path: Path,
    devices: dict[str, str],
    rounds: int,
    inner_steps: int | None,
    data_dir: Path,
    work: Path,
    deadline: Deadline,
) -> dict[str, Any]:
    config = replace(load_config(config_path), "data", data_dir=str(data_dir))
    config = replace(config, "network", **FAST_NETWORK)
    if inner_steps is not None:
        config = replace(config, "outer", inner_steps=inner_steps)
    # tokenise once here, so the daemons find the cache instead of all building it at once
    TokenDataset.build(config.data, config.model.vocab_size, config.run.seed, data_dir=data_dir)
    path = work / "swarm.toml"
    path.write_text(dump_config(config))
    swarm = Swarm(work)
    result: dict[str, Any] = {"config": str(config_path), "inner_steps": config.outer.inner_steps}
    result["anchors"] = dict(devices)
    try:
        boot = swarm.launcher.start_coordinator(path, work / "bootstrap", ["--http-port", "0"])
        swarm.wait_ready(boot, deadline)
        anchors = {}
        for name, device in devices.items():
            extra = ("--device", device, "--data-cache", str(data_dir))
            anchors[name] = swarm.launcher.start_peer(Member(name, "anchor", 1000.0, extra), boot.maddr)
        ids = {name: swarm.wait_ready(process, deadline)["peer_id"] for name, process in anchors.items()}
        result.update(_watch_rounds(swarm, boot, ids, rounds, work, deadline))
    except Exception as exc:  # report what happened, with the logs, rather than lose the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["ok"] = False
    finally:
        result["p2pd_left_behind"] = swarm.close()
        if not result.get("ok"):
            result["log_tails"] = {p.name: p.log_path.read_text().splitlines()[-15:] for p in swarm.processes}
    return result


def _watch_rounds(
    swarm: Swarm, boot: LabProcess, ids: dict[str, str], rounds: int, work: Path, deadline: Deadline
) -> dict[str, Any]:
    """Wait for `rounds` seals with every anchor contributing, then for the anchors to apply the last."""
    names = {peer: name for name, peer in ids.items()}
    history: list[dict[str, Any]] = []
    while deadline.left() > 0:
        history = merge_history(read_jsonl(work / "bootstrap" / "rounds.jsonl"))
        if sum(set(ids.values()) <= set(h.get("contributors", [])) for h in history) >= rounds:
            break
        if boot.proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {boot.proc.returncode}")
        time.sleep(1.0)
    sealed = [
        {
            "round": h.get("round"),
            "contributors": sorted(names.get(p, p[:12]) for p in h.get("contributors", [])),
            "eval_loss": h.get("eval_loss"),
        }
        for h in history
    ]
    joint = [h["round"] for h in sealed if len(h["contributors"]) == len(ids)]
    if len(joint) < rounds:
        return {"ok": False, "sealed": sealed, "error": f"{len(joint)} of {rounds} rounds with every anchor"}
    document: dict[str, Any] | None = None
    while deadline.left() > 0:  # the anchors publish a round's digests a moment after it is sealed
        document = swarm.status(boot.maddr)
        if document and hold_round(document.get("peers", []), ids, joint[-1]):
            break
        time.sleep(1.0)
    history = merge_history(read_jsonl(work / "bootstrap" / "rounds.jsonl"))  # may have grown while we waited
    verdict = compare_digests((document or {}).get("peers", []), history, ids)
    held = {row["name"]: row["params_round"] for row in verdict["peers"]}
    same_round = len(set(held.values())) == 1
    digests = {
        p.get("name"): p.get("layer_digests")
        for p in (document or {}).get("peers", [])
        if p.get("name") in ids
    }
    anchors_equal = same_round and len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1
    return {
        "ok": verdict["agree"] and (anchors_equal or not same_round),
        "sealed": sealed,
        "rounds_with_every_anchor": joint,
        "verdict": verdict,
        "anchors_hold_same_round": same_round,
        "anchor_digests_equal": anchors_equal if same_round else None,
    }


# -- main -------------------------------------------------------------------------------------------------


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/gpu-check", help="folder for the JSON and logs"
    )
    parser.add_argument(
        "--parts", default="smoke,train,stage,digests", help="comma-separated: smoke, train, stage, digests"
    )
    parser.add_argument("--cpu-only", action="store_true", help="no GPU: every device is cpu (a dry run)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: configs/tiny.toml, 5 steps, H=5")
    parser.add_argument("--train-config", type=Path, default=ROOT / "configs/178m.toml")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--swarm-config", type=Path, default=ROOT / "configs/small.toml")
    parser.add_argument("--rounds", type=int, default=3, help="sealed rounds that every anchor is in")
    parser.add_argument("--inner-steps", type=int, default=None, help="H for the swarm (default: config's)")
    parser.add_argument("--stage-config", type=Path, default=ROOT / "configs/small.toml")
    parser.add_argument("--stage-micro-batches", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=220.0, help="all parts together (under 4 minutes)")
    parser.add_argument("--train-budget-s", type=float, default=60.0, help="the training loop")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: unwind, stop the daemons
    if args.smoke:
        args.train_config, args.train_steps = ROOT / "configs/tiny.toml", 5
        args.stage_config, args.stage_micro_batches = ROOT / "configs/tiny.toml", 3
        args.inner_steps = args.inner_steps or 5
        args.rounds = min(args.rounds, 2)
    out = args.out / "gpu_check.json"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    gpu = "cpu" if args.cpu_only else "cuda"
    total = Deadline(args.budget_s)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_only": args.cpu_only,
        "smoke": args.smoke,
    }
    if gpu == "cuda" and not torch.cuda.is_available():
        results["error"] = "no CUDA device: run on a GPU machine, or pass --cpu-only for a dry run"
        _write(out, results)
        print(json.dumps(results, indent=1))
        return 2
    work = args.out / "work"  # kept: every daemon's log is what a failed loan leaves to read
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    if "smoke" in parts:
        results["smoke"] = check_smoke()
        _write(out, results)
        print(json.dumps(results["smoke"]), flush=True)
        if not results["smoke"]["ok"]:
            return 3
    if "train" in parts:
        budget = Deadline(min(args.train_budget_s, total.left()))
        try:
            results["train"] = check_training(
                args.train_config, args.train_steps, gpu, data_dir, budget, args.peak_tflops
            )
        except Exception as exc:  # the digest part still runs
            results["train"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if gpu == "cuda":
            torch.cuda.empty_cache()  # hand part 1's cached blocks back before the GPU anchor starts
        _write(out, results)
    if "stage" in parts:
        budget = Deadline(min(60.0, total.left()))
        try:
            results["stage"] = check_stage(
                args.stage_config, args.train_config, args.stage_micro_batches, gpu, data_dir, budget
            )
        except Exception as exc:  # the digest part still runs
            results["stage"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if gpu == "cuda":
            torch.cuda.empty_cache()
        _write(out, results)
    if "digests" in parts:
        (work / "swarm").mkdir(parents=True, exist_ok=True)
        devices = {"anchor-gpu": gpu, "anchor-cpu": "cpu"}
        results["digests"] = check_digests(
            args.swarm_config, devices, args.rounds, args.inner_steps, data_dir, work / "swarm", total
        )
    results["seconds"] = round(args.budget_s - total.left(), 1)
    results["ok"] = all(results.get(p, {}).get("ok") for p in parts)
    _write(out, results)
    print(json.dumps(results, indent=1))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
