"""A chain of P stage workers in one process, run on the asynchronous 1F1B schedule (docs/chains.md,
"Asynchronous 1F1B with weight stashing").

Time advances in cycles. In cycle c, stage s runs the forward of micro-batch c−s (a forward sweep from
the first stage to the last), then every stage runs the backward of micro-batch c−(P−1) (a sweep back).
Stage s therefore holds P−s micro-batches in flight and each update it applies was computed on weights
P−1−s updates old; the last stage is never stale. After the last micro-batch of a round no new forward
starts and the pipeline drains (one bubble per outer step). Frames pass through the wire codec when a
`FrameLimits` is given, so bytes are counted from encoded messages and validated like network input.

`run_1f1b` is the schedule over any stages; `PipelineChain` runs it over bare stage workers fed from a data
slot (the staleness bench), `hetnode.lab.sim.stage_chain.StageChain` over the stages a chain member runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hetnode.config import Config
from hetnode.data import TokenDataset
from hetnode.training.stage_worker import Frame, StageWorker, build_stage_worker
from hetnode.wire.activation_frame import FrameLimits, decode_frame, encode_frame

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets)
Feed = Callable[[], tuple[int, Batch]]  # the first stage's next micro-batch and its index


class ChainStage(Protocol):
    """What the schedule calls on a stage: a `StageWorker`, or the daemon's `StageRound` around one."""

    def forward(self, mb: int, incoming: Frame | Batch) -> Frame | torch.Tensor: ...

    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None: ...


@dataclass
class ChainStats:
    losses: list[float] = field(default_factory=list)
    activation_bytes: int = 0  # forward frames, all boundaries
    gradient_bytes: int = 0  # backward frames, all boundaries
    tokens: int = 0


class Boundaries:
    """The transport between stages: a direct call, or the wire codec when `limits` are given (encoded
    bytes counted, decoded frames validated like network input). `round` goes in every frame's header."""

    def __init__(self, limits: FrameLimits | None = None) -> None:
        self.limits = limits
        self.round = 0

    def carry(self, frame: Frame, stats: ChainStats) -> Frame:
        if self.limits is None:
            return frame
        data = encode_frame("act", self.round, frame.mb, frame.tensor, frame.tokens, frame.targets)
        stats.activation_bytes += len(data)
        decoded = decode_frame(data, self.limits, expect_kind="act")
        return Frame(decoded.mb, decoded.tensor, decoded.tokens, decoded.targets)

    def carry_grad(self, mb: int, grad: torch.Tensor, stats: ChainStats) -> torch.Tensor:
        if self.limits is None:
            return grad
        data = encode_frame("grad", self.round, mb, grad)
        stats.gradient_bytes += len(data)
        return decode_frame(data, self.limits, expect_kind="grad").tensor


def run_1f1b(
    stages: Sequence[ChainStage],
    feed: Feed,
    micro_batches: int,
    boundaries: Boundaries,
    eval_every: int = 0,
    on_eval: Callable[[int], None] | None = None,
) -> ChainStats:
    """Push `micro_batches` from `feed` through `stages` on the 1F1B schedule and drain; each one is one
    update per stage.

    With `on_eval`, call it after every `eval_every` updates: right after a backward sweep every stage
    holds the same number of updates, so the chain's newest weights are a consistent model."""
    stats = ChainStats()
    losses: list[torch.Tensor] = []  # read once after the run: each read waits for the device
    pending: dict[tuple[int, int], Frame] = {}  # (stage, mb) -> frame waiting for that stage
    fed: list[int] = []  # the micro-batch index of each position, as the feed named it
    last = len(stages) - 1
    for cycle in range(micro_batches + last):
        for s, stage in enumerate(stages):
            position = cycle - s
            if not 0 <= position < micro_batches:
                continue
            if s == 0:
                mb, incoming = feed()
                fed.append(mb)
                stats.tokens += incoming[0].numel()
            else:
                mb = fed[position]
                incoming = pending.pop((s, mb))
            out = stage.forward(mb, incoming)
            if s < last:
                pending[(s + 1, mb)] = boundaries.carry(out, stats)
            else:
                losses.append(out)
        position = cycle - last
        if 0 <= position < micro_batches:
            mb, grad = fed[position], None
            for s in range(last, -1, -1):
                grad = stages[s].backward(mb, grad)
                if grad is not None:
                    grad = boundaries.carry_grad(mb, grad, stats)
            if on_eval is not None and eval_every > 0 and (position + 1) % eval_every == 0:
                on_eval(position + 1)
    stats.losses = torch.stack(losses).tolist() if losses else []
    return stats


class PipelineChain:
    """P stage workers fed from one data slot; the transport is a direct call (or the wire codec)."""

    def __init__(
        self,
        workers: Sequence[StageWorker],
        dataset: TokenDataset,
        slot: int = 0,
        num_slots: int = 1,
        limits: FrameLimits | None = None,
    ) -> None:
        if not workers or not workers[0].stage.first or not workers[-1].stage.last:
            raise ValueError("a chain runs from a first stage to a last stage")
        self.workers = list(workers)
        self.dataset = dataset
        self.slot = slot
        self.num_slots = num_slots
        self.boundaries = Boundaries(limits)
        self.step = 0  # micro-batches started so far (indexes the data schedule)

    @property
    def depth(self) -> int:
        return len(self.workers)

    def run(
        self, micro_batches: int, eval_every: int = 0, on_eval: Callable[[int], None] | None = None
    ) -> ChainStats:
        """Push `micro_batches` of our data slot through the pipeline and drain it (`run_1f1b`)."""
        return run_1f1b(self.workers, self._next_batch, micro_batches, self.boundaries, eval_every, on_eval)

    def _next_batch(self) -> tuple[int, Batch]:
        mb = self.step
        self.step += 1
        return mb, self.dataset.train_batch(self.slot, self.num_slots, mb)

    @torch.no_grad()
    def evaluate(self, batches: int) -> float:
        """Mean eval loss of the chain's newest weights, through the same boundary codec."""
        total = 0.0
        evals = self.dataset.eval_batches(batches)
        for tokens, targets in evals:
            x = tokens
            for worker in self.workers:
                x = worker.infer(x, tokens, targets)
            total += x.item()
        return total / len(evals)

    def params(self) -> dict[str, torch.Tensor]:
        """The chain's parameters by global name (a tied embedding appears once, from the first stage)."""
        out: dict[str, torch.Tensor] = {}
        for worker in self.workers:
            for name, param in worker.stage.named_parameters():
                out.setdefault(name, param)
        return out


def build_chain_workers(
    config: Config,
    splits: Sequence[range],
    optimizer: str,
    compress: bool,
    constrained: bool,
    seed: int,
    wire_dtype: torch.dtype | None = None,
) -> list[StageWorker]:
    """Stage workers for a chain over `splits`, optionally subspace-constrained and compressed.

    Wire dtype defaults to bf16 for compressed boundaries and fp32 otherwise."""
    return [
        build_stage_worker(config, splits, i, optimizer, compress, constrained, seed, wire_dtype)
        for i in range(len(splits))
    ]
