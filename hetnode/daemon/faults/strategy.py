"""`Faults`: the strategy a role is handed for tests and benchmarks, with a hook at each point a fault acts.
This class is the honest peer: every hook hands back what it is given, or does the honest thing it stands
for, so an honest anchor or stage pays a method call and nothing else. A faulty peer overrides the hooks
its fault needs (`anchor.py`, `stage.py`); the roles never ask which fault they run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads the names of faults next door: nothing heavy loads with this class
    import asyncio

    import torch

    from hetnode.algo.sparseloco import CompressedTensor
    from hetnode.config import OuterConfig
    from hetnode.net.node import SwarmNode
    from hetnode.replica.global_model import GlobalModel
    from hetnode.training.local_rounds import LocalRounds


@dataclass
class OldTheta:
    """What `AnchorTraining.run_round` reads of a global model: θ, its round and its shards (what
    `train_from` hands back in place of the model we hold)."""

    params: dict[str, torch.Tensor]
    params_round: int
    shards: dict[str, list[str]]


class Faults:
    """The honest strategy (`HONEST`); subclasses are the faults of `hetnode join --fault NAME`."""

    name = "honest"
    # under overlap an honest anchor makes its round's Δ off the training thread (`LocalRounds.split`, then
    # `close`: error feedback, not `round_update`); a strategy that overrides `round_update` says False,
    # and its Δ is made in line, through the hook
    closes_aside = True

    # --- an anchor's round ---------------------------------------------------------------------------

    def round_update(
        self, local: LocalRounds, round_: int, peer_id: str, outer: OuterConfig
    ) -> dict[str, CompressedTensor]:
        """What round `round_` sends, compressed: the pseudo-gradient with error feedback."""
        return local.compress(round_)

    def train_from(self, global_model: GlobalModel) -> GlobalModel | OldTheta:
        """The θ the next round trains from: the one we hold."""
        return global_model

    async def announced_payloads(
        self,
        node: SwarmNode,
        global_model: GlobalModel,
        round_: int,
        payloads: dict[str, bytes],
        stop: asyncio.Event,
    ) -> dict[str, bytes]:
        """The payload messages a round announces as ours: our own."""
        return payloads

    def payload_bytes(self, payloads: dict[str, bytes]) -> dict[str, bytes]:
        """The bytes we hold and serve for each shard: the messages as encoded."""
        return payloads

    def announced_digests(self, digests: dict[str, str], payloads: dict[str, bytes]) -> dict[str, str]:
        """The sha256 per shard we announce: those of the payloads we serve."""
        return digests

    def after_apply(self, global_model: GlobalModel) -> bool:
        """After a sealed round is applied; True when this changed θ (the role checks agreement at once)."""
        return False

    # --- a chain stage's frames ----------------------------------------------------------------------

    def sent_activations(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor of an activation frame sent downstream: the forward's output."""
        return tensor

    def sent_gradients(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor of a gradient frame sent upstream: the backward's input gradient."""
        return tensor


HONEST = Faults()  # no state: one for every honest role
