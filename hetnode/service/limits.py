"""A node's limits and budgets for a run (docs/security.md, "Exhaust a daemon"), from its manifest: the same
for a peer daemon and the
coordinator."""

from __future__ import annotations

import dataclasses

from hetnode.config import Config
from hetnode.model.decoder import count_parameters
from hetnode.net.budgets import NodeBudgets
from hetnode.net.node import NodeLimits


def limits_of(config: Config) -> NodeLimits:
    """The node's limits and budgets for a run: sized from its probe size and frame limit, and the state
    budget from the model, so that one peer's catch-up (all of dense θ, retried once) always fits."""
    n = config.network
    probe_bytes, frame_bytes = int(n.probe_mb * 2**20), int(n.max_frame_mb * 2**20)
    budgets = NodeBudgets.sized(probe_bytes, frame_bytes)
    theta_bytes = 4 * count_parameters(config.model)
    budgets = dataclasses.replace(
        budgets,
        state_bytes_per_peer=max(budgets.state_bytes_per_peer, 2 * theta_bytes),
        state_bytes_global=max(budgets.state_bytes_global, 8 * theta_bytes),
    )
    return NodeLimits(probe_bytes, n.probe_s, n.requests_per_min, budgets)
