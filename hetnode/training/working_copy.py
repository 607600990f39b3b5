"""A round's working copy of θ (DESIGN §2.3): what a replica trains, built from the global parameters.

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

    def prepare(self, global_params: Params) -> tuple[Params, torch.Tensor | None]:
        if self.constraint is None:
            return {n: t.clone() for n, t in global_params.items()}, self.base_fixed
        reference = {n: self.constraint.project_tensor(n, t) for n, t in global_params.items()}
        embed = global_params["embed.weight"]
        return reference, self.base_fixed + (embed - reference["embed.weight"])
