"""Tile layout for SparseLoCo top-k selection (docs/sync.md, "Compression").

A 2-D weight (m, n) is cut into c1×c2 tiles, c1 the largest divisor of m that is ≤ `tile` and c2 likewise
for n, so the common 64×64 case gives 4096-element tiles. Any other tensor (1-D biases and norms, scalars,
3-D+) is flattened and cut into 1-D chunks of the largest divisor of its length that is ≤ `tile`. Both cases
are handled as one: a non-2-D tensor is viewed as a (1, numel) matrix, so c1 = 1 and c2 is the chunk length.

Top-k is `topk` entries per tile×tile elements (default 64 of 4096 = 1.5625 %); smaller tiles get a
proportionally smaller k, at least 1. Positions inside a tile are < tile_elems ≤ 4096, so they fit 12 bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_TILE = 64  # tile*tile must stay ≤ 4096 so that within-tile positions fit the 12-bit wire format


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest d with d | n and d ≤ limit (n ≥ 1, limit ≥ 1); 1 for a prime n > limit."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class TileGrid:
    """How one tensor shape is cut into equal tiles, and how many entries each tile keeps.

    `matrix` is the 2-D view the tiles are cut from: the shape itself for 2-D tensors, (1, numel) otherwise.
    Tiles are numbered row-major over the (m/c1, n/c2) block grid; a position inside a tile is r*c2 + c.
    """

    shape: tuple[int, ...]
    matrix: tuple[int, int]
    tile_rows: int
    tile_cols: int
    k: int

    @property
    def numel(self) -> int:
        return self.matrix[0] * self.matrix[1]

    @property
    def tile_elems(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def blocks(self) -> tuple[int, int]:
        """Number of tiles along each matrix axis."""
        return self.matrix[0] // self.tile_rows, self.matrix[1] // self.tile_cols

    @property
    def num_tiles(self) -> int:
        br, bc = self.blocks
        return br * bc

    @property
    def total_selected(self) -> int:
        return self.num_tiles * self.k

    def to_tiles(self, t: torch.Tensor) -> torch.Tensor:
        """[*shape] → [num_tiles, tile_elems], tile-major, row-major inside each tile."""
        if tuple(t.shape) != self.shape:
            raise ValueError(f"tensor shape {tuple(t.shape)} does not match grid shape {self.shape}")
        (br, bc), c1, c2 = self.blocks, self.tile_rows, self.tile_cols
        return t.reshape(br, c1, bc, c2).permute(0, 2, 1, 3).reshape(self.num_tiles, self.tile_elems)

    def from_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """Exact inverse of `to_tiles`: [num_tiles, tile_elems] → [*shape]."""
        if tuple(tiles.shape) != (self.num_tiles, self.tile_elems):
            raise ValueError(
                f"tiles shape {tuple(tiles.shape)} does not match ({self.num_tiles}, {self.tile_elems})"
            )
        (br, bc), c1, c2 = self.blocks, self.tile_rows, self.tile_cols
        return tiles.reshape(br, bc, c1, c2).permute(0, 2, 1, 3).reshape(self.shape)

    def flat_indices(self, positions: torch.Tensor) -> torch.Tensor:
        """Within-tile positions [num_tiles, j] → flat indices into the tensor, same order, [num_tiles*j].

        Aggregation works on flat indices so that contributions from different peers line up.
        """
        if positions.ndim != 2 or positions.shape[0] != self.num_tiles:
            raise ValueError(f"positions must be [{self.num_tiles}, j], got {tuple(positions.shape)}")
        positions = positions.long()
        tile_id = torch.arange(self.num_tiles, device=positions.device).unsqueeze(1)
        bc, c1, c2, n = self.blocks[1], self.tile_rows, self.tile_cols, self.matrix[1]
        row = (tile_id // bc) * c1 + positions // c2
        col = (tile_id % bc) * c2 + positions % c2
        return (row * n + col).reshape(-1)


@functools.lru_cache(maxsize=4096)
def tile_grid(shape: tuple[int, ...], tile: int = 64, topk: int = 64) -> TileGrid:
    """The tile grid of `shape` for tile size `tile` and `topk` kept per tile×tile elements (docs/sync.md,
    "Compression").

    k = max(1, round(topk · tile_elems / tile²)) capped at tile_elems (Python's round: ties to even), so small
    chunks keep the same fraction as full tiles but never nothing.
    """
    shape = tuple(int(s) for s in shape)
    if not 1 <= tile <= MAX_TILE:
        raise ValueError(f"tile must be in [1, {MAX_TILE}] so positions fit 12 bits, got {tile}")
    if topk < 1:
        raise ValueError(f"topk must be ≥ 1, got {topk}")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if len(shape) == 2:
        matrix = (shape[0], shape[1])
    else:
        numel = 1
        for s in shape:
            numel *= s
        matrix = (1, numel)
    if matrix[0] * matrix[1] == 0:
        raise ValueError(f"cannot tile an empty tensor of shape {shape}")
    c1 = largest_divisor_at_most(matrix[0], tile)
    c2 = largest_divisor_at_most(matrix[1], tile)
    tile_elems = c1 * c2
    k = min(tile_elems, max(1, round(topk * tile_elems / (tile * tile))))
    return TileGrid(shape=shape, matrix=matrix, tile_rows=c1, tile_cols=c2, k=k)
