"""torch's one-time costs, paid while a peer waits rather than when it must train.

The first optimiser a process builds imports `torch._dynamo` (≈ 1 CPU-second here: 5 s under the 0.2-core
quota of a spare in `hetnode bench chains`), and the first backward pass sets up autograd's engine. A spare
that steps into a broken chain pays them between its claim and its first micro-batch, in the round the chain
is racing to save; an idle peer pays them before (docs/chains.md, "Spares")."""

from __future__ import annotations

import torch


def warm_up_torch() -> None:
    """Build an optimiser and run one forward, backward and step on a throwaway layer."""
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.ones(2, 4)).square().mean().backward()
    optimizer.step()
