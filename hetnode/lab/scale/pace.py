"""How much of each round an anchor trains under each round rule, projected at 178m and 1b (issue 35):
H100-class anchors on 1 Gbit/s beside chains whose stages sit on 20 Mbit/s links, for `hetnode bench scale`.

Per round, each replica's work and the sync (docs/scale.md, "Round rules"):
- an anchor: inner steps of 6·P·B·T FLOPs each at `ANCHOR_FLOPS`;
- a chain: the pipeline's fill, then one micro-batch per `mb_s`, its slowest stage's pace: compute
  (6·P_s·B·T at `STAGE_FLOPS`) or a link carrying one act frame one way and one grad frame the other (the
  real frame codec's bytes). No V×d drift frame: every stage holds θ's embedding and builds T_fix' itself;
- the sync: the scale model's any-holder round for this swarm (`round_s` of its row). Overlapped, a stage's
  own sync bytes share its link with the activations; a later stage's include the round's sealed
  embedding payloads (one per replica), which it now downloads to keep θ's embedding.
Rules, as the daemon runs them: `lockstep` (H steps, then sync), `overlap` (H steps, the sync behind the
next round's), `paced` (a time budget from `RoundBudget`, each replica the steps that fit, a replica whose
floor does not fit sits out, then sync) and `paced+overlap`. An anchor's idle share is 1 − its training
seconds / the round's seconds. Assumed speeds, not measured ones: no GPU was lent to measure them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hetnode.config import Config
from hetnode.lab.scale.schedules import MBIT
from hetnode.lab.scale.sizes import signed_payload_bytes
from hetnode.planning.rounds import SIT_OUT_SLACK, RoundBudget
from hetnode.wire.activation_frame import encode_frame

ANCHOR_FLOPS = 0.4 * 989e12  # an H100 SXM at 40 % of its dense bf16 peak
STAGE_FLOPS = 0.4 * 165e12  # a chain stage on an RTX 4090 at 40 % of its dense bf16 peak
RULES = ("lockstep", "overlap", "paced", "paced+overlap")
PACE_CONFIGS = ("178m", "1b")  # the GPU scales the assumed speeds are for


@dataclass(frozen=True)
class Pace:
    """One swarm's per-round quantities, in seconds."""

    inner_steps: int  # H
    floor: int  # paced: min_inner_steps
    cap: int  # paced: max_inner_steps
    anchor_step_s: float
    mb_s: float  # the chain's steady pace per micro-batch
    frame_s: float  # a stage link's time for one micro-batch's frame
    chain_fixed_s: float  # per round: the pipeline's fill and drain
    sync_s: float  # the round's sync
    stage_sync_s: float  # a stage link's time for its own sync bytes

    def chain_s(self, micro_batches: int, overlapped: bool) -> float:
        """A chain's round of `micro_batches`; overlapped, the link also carries the last round's sync."""
        busy = self.chain_fixed_s + micro_batches * self.mb_s
        if not overlapped:
            return busy
        slack = micro_batches * (self.mb_s - self.frame_s)  # link time compute leaves free
        return busy + max(0.0, self.stage_sync_s - slack)


def frame_bytes(config: Config) -> int:
    """One act or grad frame as the codec writes it, compressed to rank k in bf16."""
    d, p = config.data, config.pipeline
    width = p.subspace_rank if p.compression != "none" else config.model.d_model
    tokens = torch.zeros(d.batch_size, d.seq_len, dtype=torch.long)
    return len(encode_frame("act", 0, 0, torch.zeros(d.batch_size, d.seq_len, width, dtype=torch.bfloat16),
                            tokens, tokens))  # fmt: skip


def embedding_sync_bytes(config: Config, replicas: int) -> int:
    """What a later stage of a compressed chain downloads a round to keep θ's embedding: the round's sealed
    embedding payload of every replica (anchors, and each chain's first stage)."""
    if config.pipeline.compression == "none":
        return 0
    m, o = config.model, config.outer
    shape = {"embed.weight": (m.vocab_size, m.d_model)}
    return replicas * signed_payload_bytes("embed", shape, o.topk, o.tile)


def pace_of(config: Config, parameters: int, row: Mapping[str, Any], stage_mbit: float) -> Pace:
    """The quantities of `config`'s swarm from the scale model's any-holder row for it."""
    o, d, stages = config.outer, config.data, config.pipeline.stages
    flops = 6 * parameters * d.batch_size * d.seq_len
    act = frame_bytes(config)
    link = stage_mbit * MBIT
    frame_s = act / link  # acts one way, grads the other: full duplex
    mb_s = max(frame_s, flops / stages / STAGE_FLOPS)
    download = row["stage_download_bytes"] + embedding_sync_bytes(config, row["anchors"] + row["chains"])
    stage_sync = max(download, row["stage_upload_bytes"]) / link
    return Pace(
        inner_steps=o.inner_steps,
        floor=o.min_inner_steps or max(1, o.inner_steps // 4),
        cap=o.max_inner_steps or 2 * o.inner_steps,
        anchor_step_s=flops / ANCHOR_FLOPS,
        mb_s=mb_s,
        frame_s=frame_s,
        chain_fixed_s=(stages - 1) * 2 * mb_s,
        sync_s=row["round_s"],
        stage_sync_s=stage_sync,
    )


def project(pace: Pace, rule: str, anchors: int, chains: int) -> dict[str, Any]:
    """One rule's steady round: anchor idle share, the round's seconds, an anchor's steps and a chain's
    micro-batches per round (0: it sits every round out)."""
    overlapped = rule.endswith("overlap")
    H = pace.inner_steps
    if not rule.startswith("paced"):
        anchor_s, chain_n = H * pace.anchor_step_s, H
        train_s = max(anchor_s, pace.chain_s(H, overlapped) if chains else 0.0)
        anchor_steps = H
    else:
        budget = _budget(pace, anchors, chains, overlapped)
        anchor_steps = max(pace.floor, min(pace.cap, math.floor(budget / pace.anchor_step_s)))
        anchor_s = anchor_steps * pace.anchor_step_s
        chain_n = _chain_steps(pace, budget, overlapped) if chains else 0
        train_s = max(anchor_s, pace.chain_s(chain_n, overlapped) if chain_n else 0.0)
    round_s = max(train_s, pace.sync_s) if overlapped else train_s + pace.sync_s
    return {
        "rule": rule,
        "round_s": round_s,
        "anchor_idle": 1 - anchor_s / round_s,
        "anchor_steps": anchor_steps,
        "chain_micro_batches": chain_n if chains else None,
    }


def _chain_steps(pace: Pace, budget: float, overlapped: bool) -> int:
    """A chain's micro-batches in a paced round: what fits the budget, within the floor and the cap; 0
    when even its floor overruns the budget by more than SIT_OUT_SLACK (it sits out)."""
    if pace.chain_s(pace.floor, overlapped) > SIT_OUT_SLACK * budget:
        return 0
    fits = math.floor((budget - pace.chain_s(0, overlapped)) / pace.mb_s)
    return max(pace.floor, min(pace.cap, fits))


def _budget(pace: Pace, anchors: int, chains: int, overlapped: bool) -> float:
    """The budget the sealer's own `RoundBudget` reaches: anchors at H steps' time, the chains' floors in
    their records (each replica weighs one)."""
    budget = RoundBudget(pace.inner_steps, 0.5, 600.0, pace.cap / pace.inner_steps)
    budget.observe([(pace.inner_steps * pace.anchor_step_s, pace.inner_steps, 1)] * anchors)
    floors = [pace.chain_s(pace.floor, overlapped)] * chains
    seconds = budget.seconds_for(floors)
    for _ in range(budget.keep):  # the chains take part once their floor fits: their rounds count too
        n = _chain_steps(pace, seconds, overlapped) if chains else 0
        timings = [(pace.inner_steps * pace.anchor_step_s, pace.inner_steps, 1)] * anchors
        timings += [(pace.chain_s(n, overlapped), n, 1)] * (chains if n else 0)
        budget.observe(timings)
        seconds = budget.seconds_for(floors)
    return seconds


def pace_report(config: Config, parameters: int, row: Mapping[str, Any], stage_mbit: float) -> dict[str, Any]:
    """Every rule for one config's swarm (its anchors and chains from `row`), with the quantities used, and
    the cap that would let its chains into every paced round."""
    pace = pace_of(config, parameters, row, stage_mbit)
    anchors, chains = row["anchors"], row["chains"]
    rules = {rule: project(pace, rule, anchors, chains) for rule in RULES}
    # paced+overlap at larger caps (`outer.max_inner_steps`): where the fast anchors' cap time covers the
    # sync (no idle), and where it reaches a chain's floor (the budget then lets the chains in)
    caps = {
        "for_sync": math.ceil(pace.sync_s / pace.anchor_step_s),
        "for_chains": math.ceil(pace.chain_s(pace.floor, True) / pace.anchor_step_s),
    }
    allowed = 1024 // config.outer.probation_rounds  # the config check (weights by steps stay small)
    return {
        "config": config.run.name,
        "anchors": anchors,
        "chains": chains,
        "assumed": {"anchor_flops": ANCHOR_FLOPS, "stage_flops": STAGE_FLOPS, "stage_mbit": stage_mbit},
        "pace": dataclasses.asdict(pace),
        "rules": rules,
        "paced+overlap_at_cap": {
            why: {
                "cap": cap,
                "allowed": cap <= allowed,
                **project(
                    dataclasses.replace(pace, cap=max(pace.cap, cap)), "paced+overlap", anchors, chains
                ),
            }
            for why, cap in caps.items()
        },
    }
