"""The subspace constraint on a decoder (docs/chains.md, "Subspace-compressed boundaries"): which weights stay
in span(U), and keeping them there.

Constrained: the trainable embedding and, in every block before the last stage boundary, the attention
output projection and the MLP down projection (the only writers to the residual stream). Blocks after
the last boundary never send activations, so they stay free. The constraint is kept by projecting the
gradients of those weights (so a split model computes the same gradients as the unsplit one) and the
weights themselves after every optimiser step and every outer step (Adam's per-coordinate scaling
would otherwise leave the subspace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hetnode.algo.subspace import frozen_embedding, orthonormal_basis, project_columns, project_rows
from hetnode.config import ModelConfig

WRITERS = ("attn.wo.weight", "mlp.w_down.weight")


@dataclass(frozen=True)
class SubspaceConstraint:
    basis: torch.Tensor  # U, d×k
    fixed: torch.Tensor  # T_fix, V×d
    last_boundary: int  # blocks [0, last_boundary) are constrained

    @classmethod
    def create(cls, cfg: ModelConfig, rank: int, last_boundary: int, seed: int) -> SubspaceConstraint:
        if cfg.tie_embeddings:
            raise ValueError("subspace compression needs an untied head (the head would be projected too)")
        if not 0 < last_boundary < cfg.n_layers:
            raise ValueError(f"last stage boundary must be inside 1..{cfg.n_layers - 1}, got {last_boundary}")
        return cls(
            basis=orthonormal_basis(cfg.d_model, rank, seed),
            fixed=frozen_embedding(cfg.vocab_size, cfg.d_model, seed, cfg.init_std),
            last_boundary=last_boundary,
        )

    def to(self, device: torch.device | str) -> SubspaceConstraint:
        """U and T_fix on `device`, once: the codec and the projections then move nothing per call."""
        return dataclasses.replace(self, basis=self.basis.to(device), fixed=self.fixed.to(device))

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    def is_constrained(self, name: str) -> bool:
        if name == "embed.weight":
            return True
        if name.startswith("blocks.") and name.endswith(WRITERS):
            return int(name.split(".")[1]) < self.last_boundary
        return False

    def project_tensor(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The projection of one named tensor (identity for unconstrained names)."""
        if not self.is_constrained(name):
            return value
        basis = self.basis.to(value.device, value.dtype)
        return project_rows(value, basis) if name == "embed.weight" else project_columns(value, basis)

    @torch.no_grad()
    def project_parameters(self, module: nn.Module) -> None:
        for name, param in module.named_parameters():
            if self.is_constrained(name):
                param.copy_(self.project_tensor(name, param))

    @torch.no_grad()
    def project_gradients(self, module: nn.Module) -> None:
        for name, param in module.named_parameters():
            if param.grad is not None and self.is_constrained(name):
                param.grad.copy_(self.project_tensor(name, param.grad))

    def attach(self, module: nn.Module) -> None:
        """Give a first stage the frozen embedding (x₀ = T_S[tok] + T_fix[tok]) and project its weights."""
        if getattr(module, "first", False):
            module.fixed_embedding = self.fixed.to(next(module.parameters()).device)
        self.project_parameters(module)
