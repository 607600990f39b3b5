"""`hetnode bench NAME`: side-by-side benchmarks that write JSON + PNG results.

Parsers are built from light modules only (`hetnode --help` must not load torch or matplotlib); each
handler imports its benchmark when it runs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hetnode.algo.aggregation_rules import AGGREGATION_RULES
from hetnode.cli import bench_chains, bench_soak, bench_utilization, bench_wan
from hetnode.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="run a benchmark (results as JSON + PNG)")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    bench_soak.register(benches)
    bench_wan.register(benches)
    bench_utilization.register(benches)
    bench_chains.register(benches)
    sparse = benches.add_parser("sparseloco", help="DDP vs DiLoCo vs SparseLoCo: loss against bytes")
    sparse.add_argument("--quick", action="store_true", help="tiny config, 2 replicas (a few minutes)")
    sparse.add_argument(
        "--config", type=Path, default=None, help="run config (default: tiny if --quick, else small)"
    )
    sparse.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    sparse.add_argument("--steps", type=int, default=None, help="inner steps per replica (multiple of 150)")
    sparse.add_argument(
        "--methods",
        default="",
        help="comma-separated subset, e.g. diloco-H30,sparseloco-k64-H30 (default: all)",
    )
    sparse.add_argument(
        "--aggregations",
        default="",
        help=f"add sparseloco-k64-H30-<rule> per rule, side by side ({','.join(AGGREGATION_RULES)})",
    )
    sparse.add_argument("--replicas", type=int, default=None, help="R (default: 2 with --quick, else 4)")
    sparse.add_argument(
        "--outer-lr", type=float, default=None, help="SparseLoCo's α for this run (default 1)"
    )
    sparse.add_argument("--no-progress", action="store_true")
    sparse.set_defaults(handler=run_sparseloco)
    infl = benches.add_parser(
        "influence",
        help="share of the update one identity and k <= R/2 Sybils steer, per aggregation rule; "
        "and k in {1, 5} Sybils weighted by verified history",
    )
    infl.add_argument("--quick", action="store_true", help="tiny config, R=4, 3 rounds (a few minutes)")
    infl.add_argument("--config", type=Path, default=None, help="default: tiny if --quick, else small")
    infl.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    infl.add_argument("--replicas", type=int, default=None, help="R honest (default: 4 with --quick, else 8)")
    infl.add_argument("--rounds", type=int, default=None, help="honest rounds measured (default: 3 / 2)")
    infl.add_argument("--no-progress", action="store_true")
    infl.set_defaults(handler=run_influence)
    over = benches.add_parser(
        "overlap", help="how much honest contributions overlap (index overlap, cosine) vs perturbed copies"
    )
    over.add_argument("--quick", action="store_true", help="tiny config, R in {2,4,8}, 3 rounds (minutes)")
    over.add_argument("--config", type=Path, default=None, help="default: tiny if --quick, else small")
    over.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    over.add_argument(
        "--replicas", default="", help="comma-separated R values (default: 2,4,8 with --quick, else 2,4,8,16)"
    )
    over.add_argument("--rounds", type=int, default=None, help="honest rounds per R (default: 3 / 5)")
    over.add_argument("--batch-size", type=int, default=None, help="per replica (default: 8 / 4)")
    over.add_argument("--inner-steps", type=int, default=None, help="H per round (default 30)")
    over.add_argument("--no-progress", action="store_true")
    over.set_defaults(handler=run_overlap)
    trust = benches.add_parser(
        "trust", help="verification against useless or harmful work: loss, exclusion, false exclusions"
    )
    trust.add_argument("--quick", action="store_true", help="tiny, batch 4, H=5, 6 rounds (~15 min)")
    trust.add_argument("--config", type=Path, default=None, help="default: tiny if --quick, else small")
    trust.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    trust.add_argument("--rounds", type=int, default=None, help="rounds per run (default: 6 / 10)")
    trust.add_argument(
        "--inner-steps", type=int, default=None, help="H per round (default: 5 / the config's)"
    )
    trust.add_argument("--modes", default="", help="comma-separated fault modes (default: all)")
    trust.add_argument(
        "--score-lag",
        type=int,
        default=1,
        help="sealed rounds before a round's score reaches the screens (default 1: the coordinator's worker)",
    )
    trust.add_argument(
        "--speeds",
        default="",
        help="paced rounds at mixed speeds: the honest replicas' steps as shares of H, e.g. 0.25,1,1,2 "
        "(default: every replica H steps)",
    )
    trust.add_argument(
        "--sybil",
        action="store_true",
        help="attacks by many identities instead (duplicates, a Sybil majority, rotating identities, "
        "predictable scoring, framing inside a chain) after the honest replicas earned their weight",
    )
    trust.add_argument("--no-progress", action="store_true")
    trust.set_defaults(handler=run_trust)
    chain_score = benches.add_parser(
        "chain-score",
        help="how much a chain's round helps θ against an anchor's, as the verifier scores it, per "
        "compression mode and chain optimiser (in process)",
    )
    chain_score.add_argument("--quick", action="store_true", help="one warm-up length (~1 min)")
    chain_score.add_argument("--config", type=Path, default=None, help="run config (default tiny)")
    chain_score.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    chain_score.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="instead: a chain and three anchors over this many rounds, sealed by the verifier's score, "
        "always, or without the chain, per compression mode (chain_rounds.json)",
    )
    chain_score.add_argument("--no-progress", action="store_true")
    chain_score.set_defaults(handler=run_chain_score)
    network = benches.add_parser(
        "network", help="the daemons in a tc-shaped netns lab vs hivemind's all-reduce (needs root)"
    )
    network.add_argument("--quick", action="store_true", help="tiny config, H=10, 3 chain rounds")
    network.add_argument("--config", type=Path, default=None, help="default: tiny if --quick, else small")
    network.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    network.add_argument("--slow-mbit", type=float, default=20.0, help="the chain's link rate")
    network.add_argument("--no-progress", action="store_true")
    network.set_defaults(handler=run_network)
    sync = benches.add_parser(
        "scale",
        help="the sync plane at 8..256 replicas, simulated (hub, any-holder, seeded, tiles); --calibrate",
    )
    sync.add_argument("--quick", action="store_true", help="small and 178m, R in {8, 16, 64} (seconds)")
    sync.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    sync.add_argument(
        "--anchor-share",
        type=float,
        default=0.5,
        help="share of the R replicas that are anchors (rest: chains)",
    )
    sync.add_argument(
        "--prefetch", action="store_true", help="any-holder, seeded: fetch announced payloads before the seal"
    )
    sync.add_argument(
        "--calibrate",
        action="store_true",
        help="instead: real daemons in the netns lab against the model (root; minutes) -> calibration.json",
    )
    sync.add_argument("--config", type=Path, default=None, help="--calibrate: run config (default small)")
    sync.add_argument(
        "--lab-mbit",
        type=float,
        nargs=2,
        metavar=("ANCHOR", "STAGE"),
        default=None,
        help="--calibrate: the anchors' and the stages' link rates in Mbit/s (default 100 20); low rates "
        "make the round link-bound",
    )
    sync.add_argument(
        "--remodel",
        action="store_true",
        help="--calibrate: no lab; run the model again for the lab measurement in OUT/calibration.json",
    )
    sync.add_argument("--no-progress", action="store_true")
    sync.set_defaults(handler=run_scale)
    for name, text, handler in (
        ("subspace", "full replicas vs anchors + compressed chains, over compression ratios", run_subspace),
        ("staleness", "async pipelines P in {1,2,4,8}: adamw vs nadam vs rotated_adamw", run_staleness),
    ):
        bench = benches.add_parser(name, help=text)
        bench.add_argument("--quick", action="store_true", help="tiny config (a few minutes)")
        bench.add_argument("--config", type=Path, default=None, help="default: tiny if --quick, else small")
        bench.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
        bench.add_argument("--steps", type=int, default=None, help="override the number of inner steps")
        bench.add_argument("--no-progress", action="store_true")
        bench.set_defaults(handler=handler)
        if name == "staleness":
            bench.add_argument("--depths", default="1,2,4,8", help="comma-separated subset of 1,2,4,8")
            bench.add_argument("--optimizers", default="adamw,nadam,rotated_adamw", help="must include adamw")
            bench.add_argument(
                "--eval-every",
                type=int,
                default=None,
                help="updates between evals (default 15 quick, 20 full)",
            )
        else:
            bench.add_argument(
                "--runs",
                default="",
                help="comma-separated subset, e.g. replicas,selective-16x (default: all)",
            )


def _config(args: argparse.Namespace):
    from hetnode.config import load_config

    return load_config(args.config or CONFIG_DIR / ("tiny.toml" if args.quick else "small.toml"))


def run_network(args: argparse.Namespace) -> int:
    from hetnode.lab.runs import network
    from hetnode.lab.runs.network_plan import plan_for

    plan = dataclasses.replace(plan_for(args.quick), slow_mbit=args.slow_mbit)
    report = network.run_benchmark(_config(args), plan, args.out, progress=not args.no_progress)
    t = report["targets"]

    def show(value: float | None, unit: str = "x") -> str:
        return "n/a" if value is None else f"{value:,.2f}{unit}"

    limit = show(t["round_time_over_physical_limit"])
    print(f"round time / physical limit (stage, {plan.slow_mbit:g} Mbit/s): {limit}")
    print(f"all-reduce fp16 bytes / SparseLoCo bytes:  {show(t['allreduce_bytes_over_sparseloco'])}")
    print(f"all-reduce fp16 time / SparseLoCo sync time: {show(t['allreduce_seconds_over_sparseloco'])}")
    print(f"chain tokens/s, compressed / uncompressed: {show(t['compressed_chain_speedup'])}")
    print(f"  the same with the chain alone on the CPUs: {show(t['compressed_chain_speedup_alone'])}")
    for mode, swarm in report["swarms"].items():
        for stage, times in (swarm.get("per_micro_batch") or {}).items():
            shown = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items() if v is not None)
            print(f"  {mode:<10} {stage}: per micro-batch {shown}")
    print(f"anchor tokens/s / hetnode train alone:      {show(t['anchor_over_local_tokens_per_s'])}")
    print(f"wrote {args.out / 'network.json'} and {args.out / 'network.png'}")
    return 0


def run_scale(args: argparse.Namespace) -> int:
    if args.calibrate:
        return run_scale_calibration(args)
    from hetnode.config import load_config
    from hetnode.lab.scale import model as scale

    plan = scale.plan_for(args.quick, args.anchor_share, args.prefetch)
    configs = {name: load_config(CONFIG_DIR / f"{name}.toml") for name in plan.configs}
    lab = load_config(CONFIG_DIR / "tiny.toml")  # the network lab's config, for the control-plane check
    report = scale.run_benchmark(configs, plan, args.out, progress=not args.no_progress, lab=lab)
    header = (
        "config",
        "R",
        "mode",
        "coord. egress",
        "stage down",
        "anchor down",
        "round s",
        "limit s",
        "control/peer",
    )
    print("{:<6} {:>4} {:<10} {:>14} {:>12} {:>12} {:>9} {:>9} {:>13}".format(*header))
    daemon = [r for r in report["rows"] if r.get("daemon")]
    for r in report["rows"]:
        mb = [
            r[k] / 1e6 for k in ("coordinator_egress_bytes", "stage_download_bytes", "anchor_download_bytes")
        ]
        print(
            f"{r['config']:<6} {r['replicas']:>4} {r['mode']:<10} {mb[0]:>11,.1f} MB {mb[1]:>9,.1f} MB "
            f"{mb[2]:>9,.1f} MB {r['round_s']:>9,.1f} {r['round_limit_s']:>9,.1f} "
            f"{r['control_bytes_per_peer'] / 1e3:>10,.1f} KB"
        )
    print("any-holder as the daemon paces it (8 holders at a time, each in its own order, stall timeouts):")
    for r in daemon:
        d = r["daemon"]
        egress = d["coordinator_egress_bytes"] / 1e6
        print(
            f"{r['config']:<6} {r['replicas']:>4} coord. egress {egress:>11,.1f} MB"
            f"  round {d['round_s']:>9,.1f} s  timed out {d['timed_out']}/{d['requests']}"
            + ("  FAILED (the sealer timed out too)" if d["failed"] else "")
        )
    for name, c in report["configs"].items():
        print(
            f"{name}: crossover R* = {c['crossover_R']['anchor']} (simulated: {c['crossover_R_simulated']} "
            f"against any-holder, {c['crossover_R_simulated_seeded']} against seeded)"
        )
        for mode, checks in report["targets"][name].items():
            for target, t in checks.items():
                verdict = "met" if t["met"] else "NOT met"
                print(f"  {mode:<20} {target}: {t['value']:.3f} (limit {t['limit']:.3f}) {verdict}")
    for name, pace in report["pace"].items():
        print(f"{name}: {pace['anchors']} anchors beside {pace['chains']} chains, per rule (assumed speeds):")
        at_cap = [
            (f"paced+overlap, cap {c['cap']} ({why[4:]})", c)
            for why, c in pace["paced+overlap_at_cap"].items()
        ]
        for label, r in [*pace["rules"].items(), *at_cap]:
            chain = r["chain_micro_batches"]
            print(
                f"  {label:<36} anchor idle {r['anchor_idle']:>6.1%}  round {r['round_s']:>7.1f} s  "
                f"anchor steps {r['anchor_steps']:>5}  chain micro-batches {'-' if chain is None else chain}"
            )
    print(f"wrote {args.out / 'scale.json'} and {args.out / 'scale.png'}")
    return 0


def run_scale_calibration(args: argparse.Namespace) -> int:
    from hetnode.config import load_config
    from hetnode.lab.scale import calibrate as scale_calibrate

    config = load_config(args.config or CONFIG_DIR / "small.toml")
    plan = scale_calibrate.CalibrationPlan()
    if args.lab_mbit is not None:
        anchor, stage = args.lab_mbit
        if not (0 < stage < anchor <= plan.coordinator_mbit):
            raise ConfigError(
                "--lab-mbit",
                "bench scale --calibrate",
                f"needs 0 < STAGE < ANCHOR <= {plan.coordinator_mbit:g}",
            )
        plan = dataclasses.replace(plan, anchor_mbit=anchor, stage_mbit=stage)
    if args.remodel:
        report = scale_calibrate.remodel(config, args.out)
    else:
        report = scale_calibrate.run_calibration(config, args.out, plan, progress=not args.no_progress)
    print(f"{'quantity':<46} {'model':>14} {'lab':>14} {'model/lab':>10}")
    for c in report["comparison"]:
        lab = "n/a" if c["lab"] is None else f"{c['lab']:,.3f}"
        ratio = "-" if c["model_over_lab"] is None else f"{c['model_over_lab']:.2f}"
        mark = "" if c["within_25pct"] else "  (outside 25 %)"
        print(f"{c['quantity']:<46} {c['model']:>14,.3f} {lab:>14} {ratio:>10}{mark}")
    print(f"wrote {args.out / 'calibration.json'}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def run_sparseloco(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import sparseloco

    plan = sparseloco.plan_for(
        args.quick, args.steps, _names(args.methods), _names(args.aggregations), args.replicas, args.outer_lr
    )
    report = sparseloco.run_benchmark(_config(args), plan, args.out, progress=not args.no_progress)
    header = ("method", "rule", "eval loss", "bytes/round", "total bytes", "vs fp32", "codec/inner")
    print("{:<30} {:<9} {:>9} {:>12} {:>12} {:>8} {:>11}".format(*header))
    for name, r in report["methods"].items():
        ratio = r["codec_over_inner"]
        rule = r["method"]["aggregation"] or "-"
        print(
            f"{name:<30} {rule:<9} {r['final_eval_loss']:>9.4f} {r['bytes_per_replica_per_round']:>12,.0f} "
            f"{r['bytes_per_replica_total']:>12,.0f} {r['compression_vs_dense_fp32']:>7.1f}x "
            f"{(ratio or 0) * 100:>10.2f}%"
        )
    print(f"wrote {args.out / 'sparseloco.json'} and {args.out / 'sparseloco.png'}")
    return 0


def run_influence(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import influence

    plan = influence.plan_for(args.quick, args.replicas, args.rounds)
    report = influence.run_influence(_config(args), plan, args.out, progress=not args.no_progress)
    ks = list(report["naive_share"])
    print(f"R = {report['replicas']} honest; share of the update's norm (push, in median norms), worst case")
    print("{:<10} {:>8} ".format("rule", "honest≤") + " ".join(f"{'k=' + k:>15}" for k in ks))
    print("{:<10} {:>8} ".format("k/(R+k)", "") + " ".join(f"{report['naive_share'][k]:>15.3f}" for k in ks))
    for rule, r in report["rules"].items():
        cells = " ".join(f"{r['sybils'][k]['share']:>7.3f} ({r['sybils'][k]['max_push']:>5.2f})" for k in ks)
        print(f"{rule:<10} {r['honest_share_max']:>8.3f} {cells}")
    _print_weighted(report["weighted"])
    print(f"wrote {args.out / 'influence.json'}, {args.out / 'influence.png'} and influence-weighted.png")
    return 0


def _print_weighted(weighted: dict) -> None:
    """The weighted cases: Sybil share (stated bound) per rule, k and history h; the majority attack."""
    full, hs = weighted["full_weight"], [str(h) for h in weighted["histories"]]
    print(
        f"\nweighted: R = {weighted['replicas']} honest at F = {full} each, Sybils at min(h, F) "
        "(h = 0: probation, not sealed); Sybils' share (bound k·w/(k·w+R·F)), worst strategy"
    )
    print("{:<10} {:>3} ".format("rule", "k") + " ".join(f"{'h=' + h:>15}" for h in hs))
    for rule, by_h in weighted["rules"].items():
        for k in map(str, weighted["sybils"]):
            cells = " ".join(f"{by_h[h][k]['share']:>6.3f} ({by_h[h][k]['bound']:.3f})" for h in hs)
            print(f"{rule:<10} {k:>3} {cells}")
    majority = weighted["majority"]
    labels = ["headcount", *hs]
    print(
        f"majority: {majority['sybils']} Sybils at the mean honest update / {majority['divisor']:g}; "
        "honest share / ‖Δ‖ kept, by headcount and per h"
    )
    print("{:<10} ".format("rule") + " ".join(f"{label:>13}" for label in labels))
    print(
        "{:<10} ".format("norm kept") + " ".join(f"{majority['norm_kept'][label]:>13.3f}" for label in labels)
    )
    for rule, effect in majority["rules"].items():
        cells = " ".join(
            f"{effect[label]['honest_share']:>6.3f}/{effect[label]['delta_kept']:<6.3f}" for label in labels
        )
        print(f"{rule:<10} {cells}")


def run_overlap(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import overlap

    try:
        counts = tuple(int(r) for r in _names(args.replicas))
    except ValueError as exc:
        raise ConfigError("--replicas", "bench overlap", str(exc)) from None
    plan = overlap.plan_for(args.quick, counts, args.rounds, args.batch_size, args.inner_steps)
    report = overlap.run_overlap(_config(args), plan, args.out, progress=not args.no_progress)
    print(f"{report['config']}, H={plan.inner_steps}, batch {plan.batch_size}; honest pairs, all rounds")
    print(
        "{:>4} {:>12} {:>12} {:>12} {:>12} {:>14}".format(
            "R", "overlap max", "median<=", "cosine max", "median<=", "own prev. max"
        )
    )
    for replicas, result in report["by_replicas"].items():
        rounds = result["rounds"]
        own = [r["own_previous"]["overlap"]["max"] for r in rounds if r["own_previous"]["overlap"]]
        print(
            f"{replicas:>4} {max(r['pairs']['overlap']['max'] for r in rounds):>12.3f} "
            f"{max(r['pairs']['overlap']['median'] for r in rounds):>12.3f} "
            f"{max(r['pairs']['cosine']['max'] for r in rounds):>12.3f} "
            f"{max(r['pairs']['cosine']['median'] for r in rounds):>12.3f} "
            f"{max(own) if own else float('nan'):>14.3f}"
        )
    every = [r for result in report["by_replicas"].values() for r in result["rounds"]]
    cells = ", ".join(
        f"f={f}: {min(r['perturbed'][str(f)]['overlap'] for r in every):.3f}" for f in report["fractions"]
    )
    print(f"perturbed copy vs original, index overlap: {cells}")
    s = report["suggestion"]
    print(
        f"suggested index_overlap threshold {s['index_overlap_threshold']} "
        f"(catches f in {s['caught_fractions']}; "
        f"{s['current_threshold']} catches {s['caught_fractions_at_current_threshold']}); "
        f"cosine threshold {s['cosine_threshold']}"
    )
    print(f"wrote {args.out / 'overlap.json'} and {args.out / 'overlap.png'}")
    return 0


def run_subspace(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import subspace

    only = tuple(name.strip() for name in args.runs.split(",") if name.strip())
    plan = subspace.plan_for(args.quick, args.steps, only)
    report = subspace.run_subspace(_config(args), plan, args.out, progress=not args.no_progress)
    print(
        "{:<16} {:>6} {:>9} {:>12} {:>11}".format("run", "ratio", "eval loss", "act B/tok/bd", "projection")
    )
    for name, r in report["runs"].items():
        ratio = r.get("compression_ratio")
        act = r.get("activation_bytes_per_token_per_boundary")
        proj = r.get("projection_overhead")
        loss = r["final_eval_loss"]
        print(f"{name:<16} {ratio or 0:>6.1f} {loss:>9.4f} {act or 0:>12.1f} {(proj or 0) * 100:>10.2f}%")
    print(f"wrote {args.out / 'subspace.json'} and {args.out / 'subspace.png'}")
    return 0


def run_staleness(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import staleness

    if args.eval_every is not None and args.eval_every < 1:
        raise ConfigError("--eval-every", "bench staleness", f"must be at least 1, got {args.eval_every}")
    try:
        depths = tuple(int(d) for d in args.depths.split(","))
        optimizers = tuple(o.strip() for o in args.optimizers.split(","))
        plan = staleness.plan_for(args.quick, args.steps, depths, optimizers, args.eval_every)
    except ValueError as exc:
        raise ConfigError("--depths/--optimizers", "bench staleness", str(exc)) from None
    report = staleness.run_staleness(_config(args), plan, args.out, progress=not args.no_progress)
    if report["target_eval_loss"] is not None:
        print(f"target eval loss (P=1 AdamW): {report['target_eval_loss']:.4f}")
    print("{:<20} {:>9} {:>12} {:>10}".format("run", "eval loss", "its→async", "opt share"))
    for name, r in report["runs"].items():
        its = r["iterations_to_async_adamw"]
        loss, share = r["final_eval_loss"], r["optimizer_share"] * 100
        print(f"{name:<20} {loss:>9.4f} {its if its else '-':>12} {share:>9.1f}%")
    print(f"wrote {args.out / 'staleness.json'} and {args.out / 'staleness.png'}")
    return 0


def run_chain_score(args: argparse.Namespace) -> int:
    from hetnode.config import load_config
    from hetnode.lab.experiments import chain_score_bench  # the coordinator's verifier, measured in process

    config = load_config(args.config or CONFIG_DIR / "tiny.toml")
    if args.rounds:
        return run_chain_rounds(args, config)
    plan = chain_score_bench.plan_for(args.quick)
    report = chain_score_bench.run_benchmark(config, plan, args.out, progress=not args.no_progress)
    print(f"{'mode/chain optimiser':<28} {'least score':>11} {'median share of an anchor':>26}")
    for key, entry in report["summary"].items():
        share = entry["median_share"]
        print(f"{key:<28} {entry['least_score']:>11.3f} {'n/a' if share is None else f'{share:.2f}':>26}")
    print(f"(a chain scoring below 0 is left out of the seal; margin {report['margin']})")
    print(f"wrote {args.out / 'chain_score.json'} and {args.out / 'chain_score.png'}")
    return 0


def run_chain_rounds(args: argparse.Namespace, config) -> int:  # noqa: ANN001
    if args.rounds < 2:
        raise SystemExit(f"--rounds must be at least 2, got {args.rounds}")
    from hetnode.lab.experiments import chain_rounds_bench

    plan = chain_rounds_bench.ChainRoundsPlan(rounds=args.rounds)
    report = chain_rounds_bench.run_benchmark(config, plan, args.out, progress=not args.no_progress)
    print(
        f"{'mode/rule':<22} {'final loss':>10} {'loss, 2nd half':>14} {'chain sealed':>12} "
        f"{'stage score':>11}"
    )
    for key, entry in report["summary"].items():
        sealed, score = entry["chain_sealed_share"], entry["stage_score_median_second_half"]
        print(
            f"{key:<22} {entry['final_eval_loss']:>10.4f} {entry['mean_eval_loss_second_half']:>14.4f} "
            f"{'-' if sealed is None else f'{sealed:.2f}':>12} {'-' if score is None else f'{score:.3f}':>11}"
        )
    print(f"wrote {args.out / 'chain_rounds.json'} and {args.out / 'chain_rounds.png'}")
    return 0


def run_trust(args: argparse.Namespace) -> int:
    if args.sybil:
        return run_sybil(args)
    from hetnode.lab.experiments import trust_bench  # the coordinator's verifier, measured in process

    try:
        speeds = tuple(float(x) for x in _names(args.speeds))
        plan = trust_bench.plan_for(
            args.quick, args.rounds, _names(args.modes), args.inner_steps, args.score_lag, speeds
        )
    except ValueError as exc:
        raise ConfigError("--modes/--inner-steps/--score-lag/--speeds", "bench trust", str(exc)) from None
    report = trust_bench.run_benchmark(_config(args), plan, args.out, progress=not args.no_progress)
    print(
        f"clean: final eval loss {report['final_eval_loss_clean']:.4f}, "
        f"false exclusions {report['false_exclusions_clean']}, "
        f"verify share {report['verify_share_clean']:.1%}; scores {plan.score_lag} round(s) behind the seal"
    )
    if report["steps"]:
        print(
            f"paced at mixed speeds: steps {report['steps']}; the least share of its steps an honest "
            f"contribution was counted: {report['honest_steps_counted_clean']}"
        )
    header = ("mode", "weight", "out from", "no credit", "loss verified", "unverified", "vs clean", "false")
    print("{:<10} {:>6} {:>8} {:>9} {:>13} {:>10} {:>9} {:>5} {:>7}".format(*header, "verify"))
    for mode, r in report["modes"].items():
        out = "never" if r["rounds_to_exclusion"] is None else f"round {r['rounds_to_exclusion']}"
        credit = "never" if r["rounds_to_no_credit"] is None else f"round {r['rounds_to_no_credit']}"
        print(
            f"{mode:<10} {r['rounds_with_weight']:>6} {out:>8} {credit:>9} {r['final_eval_loss']:>13.4f} "
            f"{r['final_eval_loss_unverified']:>10.4f} {r['loss_vs_clean']:>+9.2%} "
            f"{r['false_exclusions']:>5} {r['verify_share']:>7.1%}"
        )
    print(f"wrote {args.out / 'trust.json'} and {args.out / 'trust.png'}")
    return 0


def run_sybil(args: argparse.Namespace) -> int:
    from hetnode.lab.experiments import (
        sybil_bench,  # the coordinator's verifier, weights and credit, in process
    )

    plan = sybil_bench.plan_for(args.quick, args.rounds)
    report = sybil_bench.run_benchmark(_config(args), plan, args.out, progress=not args.no_progress)
    p = report["plan"]
    print(
        f"{p['honest']} honest anchors and a chain, {p['history']} rounds alone, then {p['attack_rounds']} "
        f"attacked; full weight after {report['full_weight']} verified rounds"
    )
    header = ("scenario", "honest credit", "left out", "loss vs clean", "weighted rounds", "attacker credit")
    print("{:<12} {:>13} {:>8} {:>13} {:>15} {:>15}".format(*header))
    for name, r in report["scenarios"].items():
        print(
            f"{name:<12} {r['honest_credit_share_of_clean']:>12.1%} {len(r['honest_left_out']):>8} "
            f"{r['loss_vs_clean']:>+13.2%} {r['rounds_attacker_sealed_with_weight']:>15} "
            f"{r['attacker_credit'] / max(r['one_replica_credit'], 1):>12.2f} rr"
        )
    extra = report["scenarios"].get("predictable")
    if extra:
        shares = ", ".join(f"{d['honest_credit_share_of_clean']:.1%}" for d in extra["draws"])
        print(
            f"predictable (means over {len(extra['draws'])} sets of draws): "
            f"{extra['harmful_rounds_scored']} of {extra['harmful_rounds']} harmful rounds scored, "
            f"{extra['harmful_rounds_sealed']} sealed; honest credit per draw {shares}"
        )
    framing = report["scenarios"].get("framing")
    if framing:
        print(
            f"framing: honest upstream credited in {framing['upstream_credited_rounds']} of "
            f"{p['attack_rounds']} rounds, the lying stage in {framing['downstream_credited_rounds']}"
        )
    print("(attacker credit in rounds of one replica's credit: rr)")
    print(f"wrote {args.out / 'sybil.json'}")
    return 0
