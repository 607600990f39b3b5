"""`InnerTrainer`: one replica's inner optimisation loop on its own data shard.

This is the unit later roles reuse: `hetnode train` runs it alone; an anchor runs it for H steps per
outer round and then syncs. It knows nothing about networks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetnode.algo.optim import build_optimizer
from hetnode.config import Config
from hetnode.data import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.model.subspace import SubspaceConstraint
from hetnode.training.precision import autocast_for
from hetnode.training.schedule import warmup_cosine
from hetnode.training.state_file import load_state, save_state


@dataclass(frozen=True)
class StepResult:
    step: int  # steps done after this one
    loss_tensor: torch.Tensor  # on the trainer's device: reading it waits for the step to finish
    tokens: int  # tokens in this step's batch
    lr: float

    @property
    def loss(self) -> float:
        """The step's mean loss; on a GPU a host sync (the device path reads it once a round)."""
        return float(self.loss_tensor)


class InnerTrainer:
    """AdamW inner steps with gradient clipping and warmup + cosine, on the batches of its data slots.

    Normally a replica owns one slot. Given several, a step averages the gradients of all their
    batches: exactly what synchronous data parallelism over those slots computes (the DDP baseline).

    On CUDA the forward (and so its backward) runs in bf16 autocast (`precision.autocast_for`); the
    parameters and AdamW state stay fp32, so what the anchor reads back after H steps is fp32 master weights.

    `deferred_checks`: False (local runs, the simulator), a non-finite loss raises `FloatingPointError` at
    once, before the step changes anything: a host sync per step. True (an anchor), a step never reads a
    tensor's value: the first non-finite step is only noted on the device, and `check_finite` (once a
    round) raises; the weights and optimiser state after that step are not finite and must not be used.
    """

    def __init__(
        self,
        config: Config,
        model: nn.Module,
        dataset: TokenDataset,
        device: torch.device | str = "cpu",
        slots: Sequence[int] = (0,),
        num_slots: int = 1,
        constraint: SubspaceConstraint | None = None,
    ) -> None:
        if not slots or any(not 0 <= s < num_slots for s in slots):
            raise ValueError(f"slots {list(slots)} must be a non-empty subset of range({num_slots})")
        self.config = config
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.dataset = dataset
        self.slots = tuple(slots)
        self.num_slots = num_slots
        # a step sees batch × seq tokens per slot: the rotated optimiser's bases fit its FLOP budget of that
        tokens = config.data.batch_size * config.data.seq_len * len(self.slots)
        self.optimizer = build_optimizer(self.model, config.inner, tokens_per_step=tokens)
        # Compress-everything mode keeps an anchor's residual writers in span(U) too.
        self.constraint = constraint
        if constraint is not None:
            constraint.attach(self.model)
        self.step = 0
        # the learning-rate schedule's position is step + schedule_offset: a replica that joins a swarm at
        # round r follows the swarm's schedule (r·H), not a warmup of its own
        self.schedule_offset = 0
        self.tokens = 0
        self.deferred_checks = False
        self._first_nonfinite = torch.tensor(-1, device=self.device)  # deferred: the first bad step, or -1

    def lr_at(self, step: int) -> float:
        inner = self.config.inner
        return warmup_cosine(
            step, inner.lr, inner.warmup_steps, self.config.train.max_steps, inner.min_lr_ratio
        )

    def train_step(self, batch_index: int | None = None, position: int | None = None) -> StepResult:
        """One optimiser step on the batches that (slot, `batch_index`) selects for each of this trainer's
        slots (default: its own step count; a replica in a swarm passes the round's assigned batches), at
        the schedule's `position` (default: step + schedule_offset; paced rounds pass the swarm's)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses, tokens = [], 0
        for slot in self.slots:
            index = self.step if batch_index is None else batch_index
            inputs, targets = self.dataset.train_batch(slot, self.num_slots, index)
            with autocast_for(self.device):
                loss = self.model.loss(self._to_device(inputs), self._to_device(targets))
            if self.deferred_checks:
                self._note_finite(loss)
            elif not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss at step {self.step}: {loss.item()}")
            (loss / len(self.slots)).backward()
            losses.append(loss.detach())
            tokens += inputs.numel()
        if self.constraint is not None:
            self.constraint.project_gradients(self.model)
        if self.config.inner.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.inner.grad_clip)
        lr = self.lr_at(self.step + self.schedule_offset if position is None else position)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.constraint is not None:
            self.constraint.project_parameters(self.model)
        self.step += 1
        self.tokens += tokens
        return StepResult(step=self.step, loss_tensor=torch.stack(losses).mean(), tokens=tokens, lr=lr)

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A CPU batch on the trainer's device: to a GPU from pinned memory without waiting for the copy
        (the caching host allocator keeps the pinned block until the copy has run)."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _note_finite(self, loss: torch.Tensor) -> None:
        """Deferred checks: keep the first step whose loss is not finite, on the device (no sync)."""
        bad = ~torch.isfinite(loss.detach()) & (self._first_nonfinite < 0)
        self._first_nonfinite = torch.where(bad, self.step, self._first_nonfinite)

    def first_nonfinite_step(self) -> int | None:
        """Deferred checks: the first step whose loss was not finite (None: none yet). One host sync."""
        first = int(self._first_nonfinite)
        return None if first < 0 else first

    def check_finite(self) -> None:
        """Deferred checks: raise `FloatingPointError` if any step so far had a non-finite loss. One host
        sync: call it once a round, where the host waits for the device anyway."""
        first = self.first_nonfinite_step()
        if first is not None:
            raise FloatingPointError(
                f"non-finite training loss at step {first} (checked after step {self.step - 1}): "
                "the weights and optimiser state since are not finite"
            )

    @torch.no_grad()
    def evaluate(self, num_batches: int | None = None) -> float:
        """Mean loss over the fixed held-out batches (the same ones every call)."""
        batches = self.dataset.eval_batches(num_batches or self.config.train.eval_batches)
        self.model.eval()
        total = 0.0
        for inputs, targets in batches:
            with autocast_for(self.device):  # the precision training ran in, so the two losses compare
                total += self.model.loss(inputs.to(self.device), targets.to(self.device)).item()
        return total / len(batches)

    def state_dict(self, weights: bool = True) -> dict[str, Any]:
        """`weights=False`: without the model's weights (a replica stands on θ after a restart), and with
        copies of the optimiser's tensors, so the state can be written while training goes on."""
        if not weights:
            return {
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "step": self.step,
                "tokens": self.tokens,
                "model_config": self.config.model.__dict__.copy(),
            }
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens": self.tokens,
            "model_config": self.config.model.__dict__.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("model_config") != self.config.model.__dict__:
            written, wanted = state.get("model_config"), self.config.model.__dict__
            raise CheckpointError(f"checkpoint was written for model {written}, not {wanted}")
        if "model" in state:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self._first_nonfinite.fill_(-1)  # the loaded state is what steps go on from


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a trainer state (`state_dict()`, tensors and plain values) as a safetensors state file,
    atomically: a crash never leaves half of one, and reading it back runs no code."""
    save_state(path, state)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A state `save_checkpoint` wrote; CheckpointError if it is missing or unreadable."""
    try:
        state = load_state(path)
    except CheckpointError as exc:
        if not Path(path).exists():
            raise CheckpointError(f"{path}: no checkpoint to resume from") from None
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: unreadable checkpoint (not a trainer state)")
    return state


def load_legacy_checkpoint(path: Path) -> dict[str, Any]:
    """An old `hetnode train` checkpoint (`checkpoint.pt`, a torch pickle), read with `weights_only`:
    tensors and plain containers, never code. Only to convert it (`run_checkpoints.convert_legacy`)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint to resume from") from None
    except Exception as exc:  # torch raises many types for corrupt or hostile files: all mean unreadable
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {first})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: unreadable checkpoint (not a trainer state)")
    return state
