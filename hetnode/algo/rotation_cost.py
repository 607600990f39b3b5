"""What `RotatedAdamW` costs per step, in FLOPs, against the step it follows, and the rule that bounds it.

For a rotated weight G ∈ R^{m×n} the model's forward and backward cost 6·m·n·T for T tokens, so every extra
product that touches all of G is a share of that step which does not shrink as T grows with it; only T does.
Counting matrix products (2 FLOPs per multiply-add) and factorisations, with a basis of block size b on a
side of size s (b = s: a full basis; s/b diagonal blocks of b×b), per step:

* statistics, L ← d·L + (1−d)·G Gᵀ on the left and R likewise with Gᵀ G: 2·m·n·b per side;
* three rotations (the gradient in, the first moment in, the update out): 3 · 2·m·n·b per side;
* a refresh every `refresh_every` steps: one power step stat·Q (2·s·b²), the QR with explicit Q
  ((8/3)·s·b², Householder), the estimated eigenvalues stat·Q (2·s·b²), the overlaps Q_newᵀ Q_old (2·s·b²)
  and the second moment moved onto them (2·m·n·b);
* once, at step 1, an eigendecomposition (about 9·s·b², the symmetric QR algorithm with vectors).

Element-wise work (Adam's own O(m·n)) is left out: it is what AdamW already costs.

The rule (`plan_bases`): each rotated matrix takes the richest bases whose per-step share of its own
6·m·n·T stays within a budget: both sides, else the smaller side alone, else the smaller side in
block-diagonal bases (the largest block that divides it and fits; Shampoo-style blocking), else none. As
parameters outside the rotated matrices cost nothing extra, every stage and the whole model then stay within
the budget too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

QR_FLOPS = 8.0 / 3.0  # Householder QR of a b×b block with Q formed, per b³
EIGH_FLOPS = 9.0  # symmetric eigendecomposition with eigenvectors, per b³
REFRESH_FLOPS = 2.0 + QR_FLOPS + 2.0 + 2.0  # power step, QR, eigenvalue estimate, overlaps; per b³
ROTATIONS_PER_STEP = 3  # gradient in, first moment in, update out


@dataclass(frozen=True)
class Bases:
    """Block sizes of the left and right bases of an m×n matrix; 0 keeps that side in the identity."""

    left: int
    right: int

    @property
    def rotated(self) -> bool:
        return self.left > 0 or self.right > 0


@dataclass(frozen=True)
class RotationFlops:
    """FLOPs the rotation adds to a step: per step (statistics, rotations, amortised refresh) and once."""

    statistics: float
    rotations: float
    refresh: float  # per step: one refresh's FLOPs / refresh_every
    eigh_once: float

    @property
    def per_step(self) -> float:
        return self.statistics + self.rotations + self.refresh

    def __add__(self, other: RotationFlops) -> RotationFlops:
        return RotationFlops(
            self.statistics + other.statistics,
            self.rotations + other.rotations,
            self.refresh + other.refresh,
            self.eigh_once + other.eigh_once,
        )


NO_FLOPS = RotationFlops(0.0, 0.0, 0.0, 0.0)


def full_bases(m: int, n: int, one_sided: bool) -> Bases:
    """Both sides in full, or only the smaller one (the right one for a square matrix, as the authors do)."""
    if not one_sided:
        return Bases(m, n)
    return Bases(m, 0) if m < n else Bases(0, n)


def rotation_flops(m: int, n: int, bases: Bases, refresh_every: int) -> RotationFlops:
    """The FLOPs `RotatedAdamW` adds for one m×n matrix with `bases` (see the module docstring)."""
    if refresh_every < 1:
        raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
    stats = rotations = refresh = eigh = 0.0
    for size, block in ((m, bases.left), (n, bases.right)):
        if block == 0:
            continue
        if size % block:
            raise ValueError(f"block {block} does not divide the side {size}")
        per_side = 2.0 * m * n * block  # one product of G with this side's basis (or G with itself)
        stats += per_side
        rotations += ROTATIONS_PER_STEP * per_side
        refresh += (REFRESH_FLOPS * size * block**2 + per_side) / refresh_every
        eigh += EIGH_FLOPS * size * block**2
    return RotationFlops(stats, rotations, refresh, eigh)


def step_flops(params: int, tokens: int) -> float:
    """Forward and backward of `params` weights over `tokens` tokens: 6·params·tokens."""
    return 6.0 * params * tokens


def share(m: int, n: int, bases: Bases, tokens: int, refresh_every: int) -> float:
    """The rotation's per-step FLOPs for one m×n matrix over that matrix's own step FLOPs."""
    return rotation_flops(m, n, bases, refresh_every).per_step / step_flops(m * n, tokens)


def plan_bases(
    m: int, n: int, tokens: int, budget: float, refresh_every: int, one_sided: bool = False
) -> Bases:
    """The richest bases of an m×n matrix whose `share` is at most `budget` (see the module docstring)."""
    if tokens < 1 or budget <= 0:
        raise ValueError(f"tokens must be >= 1 and budget > 0, got {tokens} and {budget}")
    candidates = [] if one_sided else [full_bases(m, n, one_sided=False)]
    smaller = full_bases(m, n, one_sided=True)
    side = smaller.left or smaller.right
    for block in sorted((b for b in range(1, side + 1) if side % b == 0), reverse=True):
        if block > 1:  # a 1×1 block is a sign: plain AdamW at more cost
            candidates.append(Bases(block, 0) if smaller.left else Bases(0, block))
    for bases in candidates:
        if share(m, n, bases, tokens, refresh_every) <= budget:
            return bases
    return Bases(0, 0)


@dataclass(frozen=True)
class Overhead:
    """The rotation's cost over a set of parameters (a model or a stage) against their step."""

    flops: RotationFlops
    step: float  # 6·params·tokens

    @property
    def per_step(self) -> float:
        return self.flops.per_step / self.step

    @property
    def eigh_once(self) -> float:
        """The step-1 eigendecomposition, in steps."""
        return self.flops.eigh_once / self.step


def overhead(
    shapes: Mapping[str, tuple[int, ...]],
    rotated: Callable[[str, tuple[int, ...]], bool],
    tokens: int,
    refresh_every: int,
    choose: Callable[[int, int], Bases],
) -> Overhead:
    """The rotation's FLOPs over parameters `shapes` (name → shape), `choose` giving each rotated matrix
    its bases; the step counts every parameter, rotated or not."""
    total = NO_FLOPS
    params = 0
    for name, shape in shapes.items():
        params += _numel(shape)
        if len(shape) == 2 and rotated(name, shape):
            m, n = shape
            total = total + rotation_flops(m, n, choose(m, n), refresh_every)
    return Overhead(total, step_flops(params, tokens))


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
