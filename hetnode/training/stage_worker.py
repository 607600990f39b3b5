"""`StageWorker`: one pipeline stage of a chain, with PipeDream-style weight stashing (docs/chains.md,
"Asynchronous 1F1B with weight stashing").

The worker is transport-agnostic: `forward` takes what arrived from upstream (a batch on the first
stage, a `Frame` elsewhere) and returns the `Frame` to send downstream (on the last stage the loss, a
0-dim tensor: reading it would wait for the device); `backward` takes the gradient that arrived from
downstream and returns the one to send upstream, copied to the host. The in-process simulator and the
networked chain differ only in how frames move.

Weight stashing: a forward pass runs on a snapshot of the weights at that moment (functional call on
cloned tensors) and the matching backward differentiates through that same snapshot, while the update
goes to the newest weights. Under the 1F1B schedule stage s of P then sees a delay of exactly P−1−s
updates, which `staleness` records for every micro-batch.

Memory (issue 36): stage s holds P−s micro-batches in flight, so it keeps no activations for them: the
forward runs without a graph and the backward runs it again on the stashed snapshot with grad
(`recompute`). A micro-batch in flight then costs its input (the tokens, or the k-wide frame as it
arrived) and a share of one snapshot per weight version. The last stage runs each backward right after
its forward: it keeps that graph, on the live weights (no snapshot, no recompute).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
from hetnode.training.gradient_checks import fold, host_finite, refusal, weights_ok
from hetnode.training.precision import autocast_for
from hetnode.training.schedule import schedule_position, warmup_cosine

Grads = dict[str, torch.Tensor | None]


@dataclass
class Frame:
    """What crosses a stage boundary: activations (or their subspace coefficients) and the token ids."""

    mb: int
    tensor: torch.Tensor  # (B, T, d) activations, or (B, T, k) coefficients when compressed
    tokens: torch.Tensor  # (B, T) ids: needed to rebuild x = c·Uᵀ + T_fix[tok]
    targets: torch.Tensor  # (B, T) ids: the last stage's labels travel with the activations


class _Weights:
    """One stashed weight version, shared by the micro-batches that ran on it, freed with the last of them."""

    __slots__ = ("__weakref__", "key", "tensors")

    def __init__(self, key: tuple, tensors: dict[str, torch.Tensor]) -> None:
        self.key = key
        self.tensors = tensors


@dataclass
class _InFlight:
    version: int
    weights: _Weights | None  # None: the live weights (the last stage, whose backward follows at once)
    inputs: torch.Tensor  # the tokens (first stage) or the frame tensor as it arrived
    tokens: torch.Tensor
    targets: torch.Tensor
    constraint: SubspaceConstraint | None  # the codec's U and T_fix as the forward saw them
    fixed: torch.Tensor | None  # the first stage's T_fix as the forward saw it
    graph: tuple[torch.Tensor | None, torch.Tensor] | None = None  # (received leaf, sent) when kept


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
        recompute: bool = True,
    ) -> None:
        if compress and constraint is None:
            raise ValueError("compressed boundaries need the subspace constraint")
        self.stage = stage
        self.device = next(
            stage.parameters()
        ).device  # where it trains; frames and batches arrive on the host
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.grad_clip = grad_clip
        self.constraint = constraint
        self.compress = compress
        self.wire_dtype = wire_dtype
        # False: keep every in-flight micro-batch's graph (today's memory, a third less compute)
        self.recompute = recompute
        # A stage that sends no gradient upstream (the first) has no host copy to check its weights'
        # gradients on: it reads a flag per backward, or, deferred, zeroes a refused gradient on the
        # device and counts it there (`take_refusals`, read once per round).
        self.defer_refusals = False
        self.refusals = torch.zeros((), dtype=torch.int64)
        self.schedule_offset = 0  # the swarm's schedule position minus ours (see InnerTrainer)
        # paced rounds: (round, our version when it began, H, the cap): the schedule moves by round
        self.paced_round: tuple[int, int, int, int] | None = None
        self.version = 0  # optimiser updates applied so far
        self.applied = 0  # micro-batches whose gradient is in the weights: the schedule's position
        # Micro-batches a step carries: a stage whose next stage is a pool of W workers keeps W times the
        # 1F1B window in flight to keep them busy, and steps once per W gradients, so that its weight delay,
        # counted in steps, stays P−1−s (`flush` applies a round's last, partial group)
        self.accumulate = 1
        self._pending: Grads | None = None  # the summed gradients of the group not yet stepped on
        self._pending_mbs: list[tuple[int, int]] = []  # (micro-batch, our version at its forward)
        self.in_flight: dict[int, _InFlight] = {}
        self.staleness: list[tuple[int, int]] = []  # (micro-batch, updates between its forward and backward)
        self._last_loss: torch.Tensor | None = None
        self._latest: weakref.ref[_Weights] | None = None  # the newest snapshot, while a micro-batch holds it
        # Seconds spent per activity: "compute" (forward + backward), "optimizer", "projection"
        # (subspace projections and the boundary codec). Benchmarks report overheads from these.
        self.timings: dict[str, float] = defaultdict(float)

    @property
    def last_loss(self) -> float | None:
        """The last stage's newest loss (reading it waits for the device: once per round, not per batch)."""
        return None if self._last_loss is None else float(self._last_loss)

    def take_refusals(self) -> int:
        """Micro-batches refused on the device since the last call (`defer_refusals`); one read."""
        count, self.refusals = int(self.refusals), torch.zeros_like(self.refusals)
        return count

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | torch.Tensor:
        start = time.perf_counter()
        try:
            return self._forward(mb, incoming)
        finally:
            self.timings["compute"] += time.perf_counter() - start

    def _forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | torch.Tensor:
        stage = self.stage
        if stage.first:
            host_tokens, host_targets = incoming  # type: ignore[misc]
            inputs = self._on_device(host_tokens)
        else:
            frame: Frame = incoming  # type: ignore[assignment]
            host_tokens, host_targets, inputs = frame.tokens, frame.targets, self._on_device(frame.tensor)
        tokens, targets = self._on_device(host_tokens), self._on_device(host_targets)
        weights = None if stage.last else self._stash_weights()
        fixed = stage.fixed_embedding
        flight = _InFlight(self.version, weights, inputs, tokens, targets, self.constraint, fixed)
        keep = stage.last or not self.recompute
        with torch.set_grad_enabled(keep):
            received, sent = self._run(flight)
        if keep:
            flight.graph = (received, sent)
        self.in_flight[mb] = flight
        if stage.last:
            self._last_loss = sent.detach()
            return self._last_loss
        # the wire needs the frame on the host (one copy, in the wire dtype); ids travel as they came
        return Frame(mb, sent.detach().to(self.wire_dtype).cpu(), host_tokens, host_targets)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor (a batch, a frame from the wire) on the stage's device: from pinned memory without
        blocking on a GPU (the copy queues before the forward that reads it), as it is on a CPU."""
        if tensor.device == self.device:
            return tensor
        if self.device.type == "cuda" and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _stash_weights(self) -> _Weights:
        """A snapshot of the weights as they are now: the newest one again if nothing wrote them since (the
        tensors' version counters also catch a rebase's in-place copy between two micro-batches)."""
        params = list(self.stage.named_parameters())
        key = (self.version, tuple(p._version for _, p in params))
        latest = self._latest() if self._latest is not None else None
        if latest is not None and latest.key == key:
            return latest
        weights = _Weights(key, {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params})
        self._latest = weakref.ref(weights)
        return weights

    def _run(self, flight: _InFlight) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The stage's forward of `flight` on its weights: (the leaf holding the received frame, what is
        sent: the frame tensor, or the loss). With grad enabled, that builds the graph backward needs."""
        stage, c = self.stage, flight.constraint
        received = None
        if stage.first:
            inputs = flight.inputs
        else:
            received = flight.inputs.detach().to(torch.float32).requires_grad_(torch.is_grad_enabled())
            inputs = self._decode(received, flight.tokens, c) if self.compress else received
        args = (inputs, flight.targets) if stage.last else (inputs,)
        weights = flight.weights
        with autocast_for(stage.rope_cos.device), _standing_on(stage, flight.fixed):
            out = stage(*args) if weights is None else functional_call(stage, weights.tensors, args)
        if stage.last or not self.compress:
            return received, out
        return received, self._encode(out, flight.tokens, c)

    # -- backward --------------------------------------------------------------------------------
    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back-propagate micro-batch `mb` through its stashed weights, update the newest weights, and
        return the gradient to send upstream (in wire dtype, on the host; None on the first stage).

        Gradients that are not finite, or whose norm the optimiser cannot square in float32, raise
        `UpdateRefused` before the step: the micro-batch is dropped, weights and optimiser untouched
        (under `defer_refusals` the first stage steps on a zero gradient instead and counts it)."""
        flight = self.in_flight.pop(mb)
        version = flight.version
        if not self.stage.last:
            if grad is None:
                raise ValueError(f"micro-batch {mb}: a non-last stage needs the downstream gradient")
            if grad.device.type == "cpu" and not host_finite(grad):  # from the wire: on the host already
                raise UpdateRefused(f"micro-batch {mb}: the gradient from the next stage is not finite")
        start = time.perf_counter()
        grads, upstream = self._gradients(flight, grad)
        del flight  # its snapshot goes now, before the step, unless another micro-batch shares it
        self.timings["compute"] += time.perf_counter() - start
        ok = weights_ok(list(grads.values()))
        sent = None
        if upstream is not None:  # the wire needs it on the host: check that copy, no extra device wait
            sent = fold(ok, upstream).to(self.wire_dtype).cpu()
            if not host_finite(sent):
                raise refusal(mb, list(grads.values()), upstream=True)
        elif self.defer_refusals:
            grads = {n: None if g is None else torch.where(ok, g, 0.0) for n, g in grads.items()}
            self.refusals = self.refusals.to(ok.device) + (~ok).long()
        elif not bool(ok):
            raise refusal(mb, list(grads.values()))
        self._add(grads, mb, version)
        if len(self._pending_mbs) >= self.accumulate:
            self.flush()
        return sent

    def _add(self, grads: Grads, mb: int, version: int) -> None:
        if self._pending is None:
            self._pending = grads
        else:
            for name, grad in grads.items():
                held = self._pending[name]
                self._pending[name] = grad if held is None else held if grad is None else held + grad
        self._pending_mbs.append((mb, version))

    def flush(self) -> int:
        """Step on the gradients held back for a group (their mean); the micro-batches it applied."""
        if self._pending is None:
            return 0
        count = len(self._pending_mbs)
        grads = {n: None if g is None else g / count for n, g in self._pending.items()}
        self.staleness.extend((mb, self.version - version) for mb, version in self._pending_mbs)
        self._pending, self._pending_mbs = None, []
        self._step(grads, count)
        return count

    @property
    def held_back(self) -> int:
        """Micro-batches back-propagated whose gradients wait for the rest of their group."""
        return len(self._pending_mbs)

    def _gradients(self, flight: _InFlight, grad: torch.Tensor | None) -> tuple[Grads, torch.Tensor | None]:
        """The weights' gradients and the received frame's, recomputing the forward unless its graph was
        kept; the graph (and a snapshot no other micro-batch shares) is freed on return, before the step."""
        with torch.enable_grad():
            received, sent = flight.graph if flight.graph is not None else self._run(flight)
        weights = dict(self.stage.named_parameters()) if flight.weights is None else flight.weights.tensors
        names = [n for n, t in weights.items() if t.requires_grad]
        leaves = [weights[n] for n in names] + ([] if received is None else [received])
        outputs = None if grad is None else grad.to(device=sent.device, dtype=sent.dtype)
        found = torch.autograd.grad(sent, leaves, outputs, allow_unused=True)
        grads: Grads = {n: None for n in weights}
        grads.update(zip(names, found[: len(names)], strict=True))
        return grads, None if received is None else found[-1]

    def _step(self, grads: Grads, micro_batches: int = 1) -> None:
        """One optimiser update with `grads`, the mean over `micro_batches`."""
        for name, param in self.stage.named_parameters():
            param.grad = grads[name]
        start = time.perf_counter()
        if self.constraint is not None:
            self.constraint.project_gradients(self.stage)
        projected = time.perf_counter()
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.stage.parameters(), self.grad_clip)
        if self.paced_round is None:
            lr = self.lr_at(self.applied + self.schedule_offset)
        else:
            round_, began, inner_steps, cap = self.paced_round
            lr = self.lr_at(schedule_position(round_, self.applied - began, inner_steps, cap))
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
        self.applied += micro_batches

    def drop_in_flight(self) -> None:
        """Forget unfinished micro-batches (a chain that lost a member), and gradients held back for a
        group; weights are unaffected."""
        self.in_flight.clear()
        self._pending, self._pending_mbs = None, []

    # -- boundary codec ----------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, tokens: torch.Tensor, c: SubspaceConstraint) -> torch.Tensor:
        start = time.perf_counter()
        out = encode_activations(x, tokens, c.basis.to(x.device), c.fixed.to(x.device))
        self._move_to_projection(time.perf_counter() - start)
        return out

    def _decode(self, coeffs: torch.Tensor, tokens: torch.Tensor, c: SubspaceConstraint) -> torch.Tensor:
        start = time.perf_counter()
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
        incoming, tokens = self._on_device(incoming), self._on_device(tokens)
        targets = None if targets is None else self._on_device(targets)
        inputs = incoming if self.stage.first else incoming.to(torch.float32)
        if not self.stage.first and self.compress:
            inputs = decode_activations(inputs, tokens, c.basis, c.fixed)
        if self.stage.last:
            return self.stage(inputs, targets)
        out = self.stage(inputs)
        if self.compress:
            out = encode_activations(out, tokens, c.basis, c.fixed)
        return out.to(self.wire_dtype)


@contextmanager
def _standing_on(stage: DecoderStage, fixed: torch.Tensor | None) -> Iterator[None]:
    """Run `stage` with the T_fix a micro-batch's forward saw (a round's start replaces it), so that
    its recompute is the same function even if that happened in between."""
    held, stage.fixed_embedding = stage.fixed_embedding, fixed
    try:
        yield
    finally:
        stage.fixed_embedding = held


def build_stage_worker(
    config: Config,
    splits: Sequence[range],
    index: int,
    optimizer: str,
    compress: bool,
    constrained: bool,
    seed: int,
    wire_dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> StageWorker:
    """The worker of stage `index` alone (a networked stage builds only its own layers), its weights, U and
    T_fix on `device` (the seeded values are drawn on the CPU: every device starts from the same bits).

    Every stage of a chain builds the same seeded constraint, so U and T_fix agree without a transfer."""
    inner = config.inner
    stage = build_stage(config.model, list(splits), index, seed=seed).to(device)
    constraint = None
    if (constrained or compress) and len(splits) > 1:
        constraint = SubspaceConstraint.create(
            config.model, config.pipeline.subspace_rank, splits[-1].start, config.run.seed
        ).to(device)
        constraint.attach(stage)
    dtype = wire_dtype or (torch.bfloat16 if compress else torch.float32)

    def lr_at(step: int) -> float:
        return warmup_cosine(step, inner.lr, inner.warmup_steps, config.train.max_steps, inner.min_lr_ratio)

    # one micro-batch a step: the rotated optimiser's bases fit its FLOP budget of batch × seq tokens
    tokens = config.data.batch_size * config.data.seq_len
    optim = build_optimizer(stage, inner, optimizer, tokens_per_step=tokens)
    return StageWorker(
        stage, optim, lr_at, inner.grad_clip, constraint, compress and constraint is not None, dtype
    )
