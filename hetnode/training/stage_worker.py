"""`StageWorker`: one pipeline stage of a chain, with PipeDream-style weight stashing (DESIGN §2.4).

The worker is transport-agnostic: `forward` takes what arrived from upstream (a batch on the first
stage, a `Frame` elsewhere) and returns the `Frame` to send downstream (the loss on the last stage);
`backward` takes the gradient that arrived from downstream and returns the one to send upstream. The
in-process simulator and the networked chain differ only in how frames move.

Weight stashing: a forward pass runs on a snapshot of the weights at that moment (functional call on
cloned tensors) and the matching backward differentiates through that same snapshot, while the update
goes to the newest weights. Under the 1F1B schedule stage s of P then sees a delay of exactly P−1−s
updates, which `staleness` records for every micro-batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from hetnode.algo.optim import build_optimizer
from hetnode.algo.subspace import decode_activations, encode_activations
from hetnode.config import Config
from hetnode.errors import UpdateRefused
from hetnode.model.decoder import DecoderStage, build_stage
from hetnode.model.subspace import SubspaceConstraint
from hetnode.training.schedule import schedule_position, warmup_cosine

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class Frame:
    """What crosses a stage boundary: activations (or their subspace coefficients) and the token ids."""

    mb: int
    tensor: torch.Tensor  # (B, T, d) activations, or (B, T, k) coefficients when compressed
    tokens: torch.Tensor  # (B, T) ids: needed to rebuild x = c·Uᵀ + T_fix[tok]
    targets: torch.Tensor  # (B, T) ids: the last stage's labels travel with the activations


@dataclass
class _InFlight:
    version: int
    params: dict[str, torch.Tensor]
    received: torch.Tensor | None  # leaf holding the incoming frame tensor (None on the first stage)
    sent: torch.Tensor  # the tensor whose gradient arrives from downstream (or the loss)


class StageWorker:
    """Runs forward/backward for one stage, stashing weights per micro-batch and stepping its optimiser."""

    def __init__(
        self,
        stage: DecoderStage,
        optimizer: torch.optim.Optimizer,
        lr_at: Callable[[int], float],
        grad_clip: float = 0.0,
        constraint: SubspaceConstraint | None = None,
        compress: bool = False,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        if compress and constraint is None:
            raise ValueError("compressed boundaries need the subspace constraint")
        self.stage = stage
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.grad_clip = grad_clip
        self.constraint = constraint
        self.compress = compress
        self.wire_dtype = wire_dtype
        self.schedule_offset = 0  # the swarm's schedule position minus ours (see InnerTrainer)
        # paced rounds: (round, our version when it began, H, the cap): the schedule moves by round
        self.paced_round: tuple[int, int, int, int] | None = None
        self.version = 0  # optimiser updates applied so far
        self.in_flight: dict[int, _InFlight] = {}
        self.staleness: list[tuple[int, int]] = []  # (micro-batch, updates between its forward and backward)
        self.last_loss: float | None = None
        # Seconds spent per activity: "compute" (forward + backward), "optimizer", "projection"
        # (subspace projections and the boundary codec). Benchmarks report overheads from these.
        self.timings: dict[str, float] = defaultdict(float)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | float:
        start = time.perf_counter()
        try:
            return self._forward(mb, incoming)
        finally:
            self.timings["compute"] += time.perf_counter() - start

    def _forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | float:
        stage = self.stage
        snapshot = {
            n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in stage.named_parameters()
        }
        if stage.first:
            tokens, targets = incoming  # type: ignore[misc]
            received, inputs = None, tokens
        else:
            frame: Frame = incoming  # type: ignore[assignment]
            tokens, targets = frame.tokens, frame.targets
            received = frame.tensor.detach().to(torch.float32).requires_grad_(True)
            inputs = self._decode(received, tokens) if self.compress else received
        if stage.last:
            loss = functional_call(stage, snapshot, (inputs, targets))
            self.in_flight[mb] = _InFlight(self.version, snapshot, received, loss)
            self.last_loss = loss.item()
            return self.last_loss
        out = functional_call(stage, snapshot, (inputs,))
        sent = self._encode(out, tokens) if self.compress else out
        self.in_flight[mb] = _InFlight(self.version, snapshot, received, sent)
        return Frame(mb, sent.detach().to(self.wire_dtype), tokens, targets)

    # -- backward --------------------------------------------------------------------------------
    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back-propagate micro-batch `mb` through its stashed weights, update the newest weights, and
        return the gradient to send upstream (in wire dtype; None on the first stage).

        Gradients that are not finite, or whose norm the optimiser cannot square in float32, raise
        `UpdateRefused` before the step: the micro-batch is dropped, weights and optimiser untouched."""
        flight = self.in_flight.pop(mb)
        start = time.perf_counter()
        if self.stage.last:
            flight.sent.backward()
        else:
            if grad is None:
                raise ValueError(f"micro-batch {mb}: a non-last stage needs the downstream gradient")
            torch.autograd.backward(flight.sent, grad.to(torch.float32))
        self.timings["compute"] += time.perf_counter() - start
        upstream = flight.received.grad if flight.received is not None else None
        refuse_unsafe_gradients(mb, [p.grad for p in flight.params.values()], upstream)
        self.staleness.append((mb, self.version - flight.version))
        self._step(flight.params)
        return None if upstream is None else upstream.detach().to(self.wire_dtype)

    def _step(self, snapshot: dict[str, torch.Tensor]) -> None:
        for name, param in self.stage.named_parameters():
            param.grad = snapshot[name].grad
        start = time.perf_counter()
        if self.constraint is not None:
            self.constraint.project_gradients(self.stage)
        projected = time.perf_counter()
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.stage.parameters(), self.grad_clip)
        if self.paced_round is None:
            lr = self.lr_at(self.version + self.schedule_offset)
        else:
            round_, began, inner_steps, cap = self.paced_round
            lr = self.lr_at(schedule_position(round_, self.version - began, inner_steps, cap))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stepped = time.perf_counter()
        if self.constraint is not None:
            self.constraint.project_parameters(self.stage)
        done = time.perf_counter()
        self.timings["projection"] += (projected - start) + (done - stepped)
        self.timings["optimizer"] += stepped - projected
        self.version += 1

    def drop_in_flight(self) -> None:
        """Forget unfinished micro-batches (a chain that lost a member); weights are unaffected."""
        self.in_flight.clear()

    # -- boundary codec ----------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        start, c = time.perf_counter(), self.constraint
        out = encode_activations(x, tokens, c.basis.to(x.device), c.fixed.to(x.device))
        self._move_to_projection(time.perf_counter() - start)
        return out

    def _decode(self, coeffs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        start, c = time.perf_counter(), self.constraint
        out = decode_activations(coeffs, tokens, c.basis.to(coeffs.device), c.fixed.to(coeffs.device))
        self._move_to_projection(time.perf_counter() - start)
        return out

    def _move_to_projection(self, seconds: float) -> None:
        # The boundary codec runs inside a timed forward: book it as projection, not compute, so the
        # three timings stay disjoint (its share of the backward pass stays in compute).
        self.timings["projection"] += seconds
        self.timings["compute"] -= seconds

    @torch.no_grad()
    def infer(
        self, incoming: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward with the newest weights, no stashing (evaluation); same boundary codec as training."""
        c = self.constraint
        inputs = incoming if self.stage.first else incoming.to(torch.float32)
        if not self.stage.first and self.compress:
            inputs = decode_activations(inputs, tokens, c.basis, c.fixed)
        if self.stage.last:
            return self.stage(inputs, targets)
        out = self.stage(inputs)
        if self.compress:
            out = encode_activations(out, tokens, c.basis, c.fixed)
        return out.to(self.wire_dtype)


def refuse_unsafe_gradients(
    mb: int, grads: Sequence[torch.Tensor | None], upstream: torch.Tensor | None = None
) -> None:
    """Raise `UpdateRefused` unless the weights' gradients and the one to send upstream are finite and the
    weights' total norm squares to a finite float32: clipping divides by that norm, and Adam's second
    moment (and the rotated optimiser's GGᵀ, each entry at most ‖G‖²) accumulates squares of it."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g is not None]
    total = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    if not total < FLOAT32_MAX**0.5:  # NaN fails too
        raise UpdateRefused(f"micro-batch {mb}: gradient norm {total:.3g} is not finite or too large")
    if upstream is not None and not bool(torch.isfinite(upstream).all()):
        raise UpdateRefused(f"micro-batch {mb}: the gradient for the previous stage is not finite")


def build_stage_worker(
    config: Config,
    splits: Sequence[range],
    index: int,
    optimizer: str,
    compress: bool,
    constrained: bool,
    seed: int,
    wire_dtype: torch.dtype | None = None,
) -> StageWorker:
    """The worker of stage `index` alone (a networked stage builds only its own layers).

    Every stage of a chain builds the same seeded constraint, so U and T_fix agree without a transfer."""
    inner = config.inner
    stage = build_stage(config.model, list(splits), index, seed=seed)
    constraint = None
    if (constrained or compress) and len(splits) > 1:
        constraint = SubspaceConstraint.create(
            config.model, config.pipeline.subspace_rank, splits[-1].start, config.run.seed
        )
        constraint.attach(stage)
    dtype = wire_dtype or (torch.bfloat16 if compress else torch.float32)

    def lr_at(step: int) -> float:
        return warmup_cosine(step, inner.lr, inner.warmup_steps, config.train.max_steps, inner.min_lr_ratio)

    optim = build_optimizer(stage, inner, optimizer)
    return StageWorker(
        stage, optim, lr_at, inner.grad_clip, constraint, compress and constraint is not None, dtype
    )
