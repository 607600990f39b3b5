"""A round's working copy of θ (docs/chains.md, "Subspace-compressed boundaries"): what a replica trains,
built from the global parameters.

Under the subspace constraint the working copy is P(θ^t) and the embedding's out-of-subspace part joins
the frozen table, T_fix' = T_fix + (T_S − P(T_S)), so the working input embedding equals the global one.
"""

from __future__ import annotations

import dataclasses

import torch

from hetnode.model.subspace import SubspaceConstraint

Params = dict[str, torch.Tensor]


@dataclasses.dataclass
class WorkingCopy:
    """Builds a round's working copy from the global parameters (projection + embedding drift)."""

    constraint: SubspaceConstraint | None  # None: train the global parameters as they are
    base_fixed: torch.Tensor | None  # T_fix of the architecture (None when no subspace mode is on)

    def prepare(
        self, global_params: Params, drift: torch.Tensor | None = None
    ) -> tuple[Params, torch.Tensor | None]:
        """(working copy, T_fix') of `global_params`. A chain stage without the embedding is given the
        first stage's `drift` T_S − P(T_S) instead (docs/chains.md, "Subspace-compressed boundaries": sent
        once per round)."""
        if self.constraint is None:
            return {n: t.clone() for n, t in global_params.items()}, self.base_fixed
        reference = {n: self.constraint.project_tensor(n, t) for n, t in global_params.items()}
        if "embed.weight" in global_params:
            drift = embedding_drift(global_params["embed.weight"], reference["embed.weight"])
        elif drift is None:
            raise ValueError("a stage without the embedding needs the first stage's embedding drift")
        return reference, self.base_fixed + drift


def embedding_drift(embed: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
    """The out-of-subspace part of the embedding, T_S − P(T_S): what joins the frozen table."""
    return embed - projected
