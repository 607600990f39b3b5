"""Subspace-compressed pipeline activations (docs/chains.md, "Subspace-compressed boundaries", arXiv
2601.02360).

Every block writes to the residual stream through two matrices (attention output, MLP down) and the
stream starts at the token embedding. If the trainable embedding and those writers are kept in span(U)
for all blocks before the last stage boundary, then x − T_fix[tok] ∈ span(U) at every boundary, and
the k coefficients c = (x − T_fix[tok])·U carry x exactly: x = c·Uᵀ + T_fix[tok]. Backward sends
(∂L/∂x)·U, which loses nothing either, since no parameter upstream can move x outside span(U).
"""

from __future__ import annotations

import torch

from hetnode.algo.random import portable_normal


def _generator(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + salt)


def orthonormal_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U (d×k) with orthonormal columns: a seeded Gaussian matrix orthonormalised by QR. Never sent."""
    if not 0 < k <= d:
        raise ValueError(f"subspace rank must be in [1, {d}], got {k}")
    gaussian = torch.randn(d, k, generator=_generator(seed, 1), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    # Fix the sign ambiguity of QR so every platform builds the same U.
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.float().contiguous()


def frozen_embedding(vocab: int, d: int, seed: int, std: float) -> torch.Tensor:
    """T_fix (V×d): the frozen random token embedding added at the input (same seed everywhere)."""
    return portable_normal((vocab, d), _generator(seed, 2), std).contiguous()


def project_columns(weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """U(UᵀW): a Linear weight (d_out=d, d_in) whose outputs then lie in span(U)."""
    return basis @ (basis.T @ weight)


def project_rows(table: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(T U)Uᵀ: an embedding table (V, d) whose rows then lie in span(U)."""
    return (table @ basis) @ basis.T


def encode_activations(
    x: torch.Tensor, tokens: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor
) -> torch.Tensor:
    """c = (x − T_fix[tok])·U, shape (B, T, k), in the dtype of x (the wire casts to bf16)."""
    return (x - fixed[tokens]) @ basis


def decode_activations(
    coeffs: torch.Tensor, tokens: torch.Tensor, basis: torch.Tensor, fixed: torch.Tensor
) -> torch.Tensor:
    """x = c·Uᵀ + T_fix[tok] (exact when x − T_fix[tok] ∈ span(U) and c is fp32)."""
    return coeffs.to(basis.dtype) @ basis.T + fixed[tokens]


def encode_gradient(grad_x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(∂L/∂x)·U: the k coefficients of the gradient's projection onto span(U)."""
    return grad_x @ basis


def decode_gradient(grad_coeffs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(∂L/∂c)·Uᵀ = P(∂L/∂x): the gradient the sender's stage back-propagates."""
    return grad_coeffs.to(basis.dtype) @ basis.T


def compression_ratio(d: int, k: int) -> float:
    """Activation bytes saved per token ≈ d/(k+1) (k coefficients + one token id vs d values)."""
    return d / (k + 1)
