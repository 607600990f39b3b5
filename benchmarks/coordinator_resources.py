"""What the coordinator and a catching-up replica cost per config: memory, evaluation time, checkpoint size,
θ download size (what docs/operations.md and docs/swarm.md quote).

Measured for the configs in --measure, each in a fresh process (so its peak RSS is its own), in the
coordinator's order: the global θ (`GlobalModel`), the bookkeeping worker as `Bookkeeper.build` builds it
(the corpus, the eval batches, a second copy of the model: the worker's copy of θ), two sealed rounds of 2
contributors (decode, verification with `bootstrap/verifier.py`, aggregate and outer step; the second is
timed), the evaluation of θ, and the checkpoint as `checkpoint_store.store` writes it. For every config
the sizes come from the shapes alone (`hetnode/lab/scale/sizes.py`); for --estimate configs memory and
times are extrapolated from the measured ones (`estimate` says how; the arithmetic is in the JSON and in
docs/operations.md), not measured.

    nice -n 19 .venv/bin/python benchmarks/coordinator_resources.py            # tiny, small; 178m, 1b
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "resources" / "resources.json"
MB = 1e6
CONTRIBUTORS = 2
ROUNDS = 2
EVAL_REPEATS = 5


def rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process, MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024 / MB, int(fields["VmHWM"].split()[0]) * 1024 / MB


def sizes(name: str) -> dict:
    """Parameters, θ and a stage slice as dense fp32, and one replica's signed payload, from the shapes."""
    from hetnode.config import load_config
    from hetnode.lab.scale.sizes import payload_sizes

    config = load_config(ROOT / "configs" / f"{name}.toml")
    s = payload_sizes(config)
    n = s.parameters
    non_embedding = n - sum(s.shard_params[k] for k in ("embed", "head") if k in s.shard_params)
    eval_tokens = config.train.eval_batches * config.data.batch_size * config.data.seq_len
    return {
        "parameters": n,
        "non_embedding_parameters": non_embedding,
        "theta_fp32_bytes": 4 * n,
        "stages": config.pipeline.stages,
        "stage_theta_fp32_bytes": [4 * s.stage_params(i) for i in range(len(s.stage_shards))],
        "payload_bytes": s.payload_bytes,
        "payload_ratio_vs_fp32": round(4 * n / s.payload_bytes, 1),
        "eval_tokens": eval_tokens,
        "eval_flop": 2 * n * eval_tokens,  # a forward pass: ≈ 2 FLOP per parameter per token
        "seq_len": config.data.seq_len,
        "eval_batch_logits_bytes": 4 * config.data.batch_size * config.data.seq_len * config.model.vocab_size,
        "inner_steps": config.outer.inner_steps,
        "tokens_per_round_per_replica": config.outer.inner_steps
        * config.data.batch_size
        * config.data.seq_len,
        "checkpoint_every_rounds": config.outer.checkpoint_every_rounds,
    }


def measure(name: str) -> dict:
    """One config, in this process (run it in a fresh one)."""
    import torch

    from bootstrap.bookkeeping import Bookkeeper
    from bootstrap.checkpoint_store import checkpoints_root, store
    from bootstrap.verifier import Verifier, replica_of
    from hetnode.algo.sparseloco import SparseLoCoCodec
    from hetnode.config import load_config
    from hetnode.replica.global_model import GlobalModel
    from hetnode.wire.sync_payload import SyncPayload, encode_payload

    result: dict = {"torch_threads": torch.get_num_threads()}
    result["rss_after_imports_mb"] = rss_mb()[0]
    config = load_config(ROOT / "configs" / f"{name}.toml")
    started = time.perf_counter()
    theta = GlobalModel(config)
    result["theta_build_s"] = time.perf_counter() - started
    result["rss_with_theta_mb"] = rss_mb()[0]

    books = Bookkeeper(config, None, Path(tempfile.gettempdir()), "bench", lambda line: None)  # no ledger use
    started = time.perf_counter()
    books.build(theta.params, theta.params_round)
    result["evaluator_build_s"] = time.perf_counter() - started  # corpus, eval batches, model copy
    result["rss_with_evaluator_mb"] = rss_mb()[0]

    def evaluate(global_model: GlobalModel) -> float:
        books._load(global_model.params, global_model.params_round)  # the worker steps its copy instead
        return books.evaluate()

    # sealed rounds of CONTRIBUTORS replicas, as bare payload messages (signatures are not checked here),
    # in the coordinator's order: decode (the sealer's validation), score (verification), step θ
    verifier = Verifier(config, books.dataset, books.model)
    replicas = {f"replica-{i}": replica_of(f"replica-{i}", None) for i in range(CONTRIBUTORS)}
    codec = SparseLoCoCodec(config.outer.topk, config.outer.tile)
    generator = torch.Generator().manual_seed(0)
    for round_ in range(ROUNDS):
        contributions = []
        for replica in replicas:
            payloads = {}
            for shard, names in theta.shards.items():
                tensors = {
                    n: codec.compress(1e-3 * torch.randn(theta.params[n].shape, generator=generator))
                    for n in names
                }
                message = SyncPayload(replica, round_, shard, "sparseloco", tensors)
                payloads[shard] = encode_payload(message)
            contributions.append((replica, payloads))
        started = time.perf_counter()
        decoded = [(r, theta.decode_contribution(r, round_, p)) for r, p in contributions]
        result["decode_s"] = time.perf_counter() - started
        started = time.perf_counter()
        verifier.score(round_, theta.params, decoded, replicas)
        result["verify_s"] = time.perf_counter() - started
        started = time.perf_counter()
        theta.apply_decoded(round_, decoded)
        result["apply_s"] = time.perf_counter() - started  # aggregate, check, outer step
        del contributions, decoded
    result["contributors"] = CONTRIBUTORS
    result["timed_round"] = ROUNDS - 1  # the last one: the first pays one-off warm-up costs

    evaluate(theta)  # warm-up
    times = []
    for _ in range(EVAL_REPEATS):
        started = time.perf_counter()
        loss = evaluate(theta)
        times.append(time.perf_counter() - started)
    result["eval_s"] = statistics.median(times)
    result["eval_s_min"] = min(times)
    result["eval_s_all"] = times
    result["eval_loss"] = loss

    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        store(checkpoints_root(Path(folder)), theta, config, "bench")
        result["checkpoint_s"] = time.perf_counter() - started
        result["checkpoint_bytes"] = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    current, peak = rss_mb()
    result["rss_end_mb"] = current
    result["peak_rss_mb"] = peak
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
    return result


def estimate(size: dict, measured: dict[str, dict]) -> dict:
    """Memory and times of a config too large to measure here, from the measured ones (not a measurement).

    Peak RSS: a line through the measured configs' (θ bytes, peak RSS), base + c·θ (c: the θ-sized copies
    the coordinator holds at its peak: θ, the evaluator's model, the round's dense aggregate, the verifier's
    dense update and trial parameters), plus the logits of one eval batch and their log-softmax, which the
    measured configs (vocabulary 320) do not show. Times: FLOP ÷ the FLOP/s the largest measured config's
    evaluation achieved here in its fastest repeat (2 FLOP per parameter per token for a forward pass);
    apply: in proportion to the parameters."""
    points = sorted((m["sizes"]["theta_fp32_bytes"], m["measured"]["peak_rss_mb"]) for m in measured.values())
    (x1, y1), (x2, y2) = points[0], points[-1]
    copies = (y2 - y1) * MB / (x2 - x1)
    base_mb = y1 - copies * x1 / MB
    basis_name = max(measured, key=lambda n: measured[n]["sizes"]["parameters"])
    basis = measured[basis_name]
    # the fastest repeat: on a shared machine the others measure the neighbours as much as the code
    flops = basis["sizes"]["eval_flop"] / basis["measured"]["eval_s_min"]
    forward_4 = 2 * size["parameters"] * 4 * size["seq_len"]  # one scoring pass: 4 sequences
    verify_flop = lambda replicas: (3 * replicas + 1) * forward_4  # noqa: E731 - own before/after, held-out
    theta_mb = size["theta_fp32_bytes"] / MB
    return {
        "basis": sorted(measured),
        "theta_copies_at_peak": round(copies, 2),
        "base_rss_mb": round(base_mb),
        "peak_rss_mb": round(base_mb + copies * theta_mb + 2 * size["eval_batch_logits_bytes"] / MB),
        "peak_rss_mb_formula": "base + copies × θ + 2 × one eval batch's logits (B·T·V·4 bytes)",
        "plus_kept_payloads_mb_per_replica": round(2 * size["payload_bytes"] / MB, 1),
        "achieved_gflops": round(flops / 1e9, 1),
        "eval_s": round(size["eval_flop"] / flops),
        "verify_s_per_scored_replica": round(3 * forward_4 / flops, 1),
        "verify_s_16_replicas": round(verify_flop(16) / flops),
        "apply_s": round(basis["measured"]["apply_s"] * size["parameters"] / basis["sizes"]["parameters"], 1),
        "checkpoint_bytes": size["theta_fp32_bytes"],  # fp32 θ; torch.save adds names and headers
        "note": "estimate from the measured configs on this machine, not a measurement",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", nargs="*", default=["tiny", "small"])
    parser.add_argument("--estimate", nargs="*", default=["178m", "1b"])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return 0
    report: dict = {
        "command": "nice -n 19 .venv/bin/python benchmarks/coordinator_resources.py",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "configs": {},
    }
    for name in args.measure:
        child = subprocess.run(
            [sys.executable, __file__, "--one", name], capture_output=True, text=True, check=True, cwd=ROOT
        )
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        report["configs"][name] = {"sizes": sizes(name), "measured": measured}
        m = measured
        print(
            f"{name}: peak RSS {m['peak_rss_mb']:.0f} MB, eval {m['eval_s']:.2f} s, "
            f"verify {m['verify_s']:.2f} s, apply {m['apply_s']:.2f} s, "
            f"checkpoint {m['checkpoint_bytes'] / MB:.1f} MB in {m['checkpoint_s']:.2f} s",
            flush=True,
        )
    measured = {n: report["configs"][n] for n in args.measure if n in report["configs"]}
    if len(measured) >= 2:
        for name in args.estimate:
            size = sizes(name)
            report["configs"][name] = {"sizes": size, "estimated": estimate(size, measured)}
            e = report["configs"][name]["estimated"]
            print(
                f"{name} (estimate): peak RSS ≈ {e['peak_rss_mb']} MB, eval ≈ {e['eval_s']} s, "
                f"verify ≈ {e['verify_s_per_scored_replica']} s per replica",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
