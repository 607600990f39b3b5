"""Tile grids (docs/sync.md, "Compression"): largest-divisor tiles, k scaling, exact to/from tiles."""

import pytest
import torch

from hetnode.algo.sparseloco import SparseLoCoCodec
from hetnode.algo.tiling import largest_divisor_at_most, tile_grid


def test_full_tiles() -> None:
    g = tile_grid((128, 256))
    assert (g.tile_rows, g.tile_cols, g.tile_elems) == (64, 64, 4096)
    assert g.num_tiles == 8 and g.k == 64 and g.total_selected == 512


@pytest.mark.parametrize(
    ("shape", "c1", "c2", "k"),
    [
        ((96, 40), 48, 40, 30),  # 64*1920/4096 = 30
        ((384, 1024), 64, 64, 64),
        ((100, 7), 50, 7, 5),  # 64*350/4096 = 5.47 -> 5
        ((67, 64), 1, 64, 1),  # 67 prime
        ((1, 1), 1, 1, 1),
    ],
)
def test_largest_divisor_tiles(shape: tuple[int, int], c1: int, c2: int, k: int) -> None:
    g = tile_grid(shape)
    assert (g.tile_rows, g.tile_cols, g.k) == (c1, c2, k)
    assert g.num_tiles * g.tile_elems == shape[0] * shape[1]


@pytest.mark.parametrize(
    ("shape", "chunk", "k"),
    [((128,), 64, 1), ((257,), 1, 1), ((384,), 64, 1), ((2, 3, 4), 24, 1), ((), 1, 1), ((4, 4, 4, 4), 64, 1)],
)
def test_non_matrix_chunks(shape: tuple[int, ...], chunk: int, k: int) -> None:
    g = tile_grid(shape)
    assert (g.tile_rows, g.tile_cols, g.k) == (1, chunk, k)


def test_k_scales_with_topk_and_caps() -> None:
    assert tile_grid((128,), topk=4096).k == 64  # whole chunk
    assert tile_grid((64, 64), topk=5000).k == 4096
    assert tile_grid((64, 64), topk=1).k == 1
    assert tile_grid((32, 32), tile=32, topk=16).k == 16
    assert tile_grid((96, 96), tile=32, topk=16).tile_elems == 1024


def test_bad_parameters() -> None:
    for kwargs in ({"tile": 65}, {"tile": 0}, {"topk": 0}):
        with pytest.raises(ValueError):
            tile_grid((64, 64), **kwargs)
    with pytest.raises(ValueError):
        tile_grid((0, 64))


def test_largest_divisor() -> None:
    assert [largest_divisor_at_most(n, 64) for n in (1, 64, 128, 96, 257, 1000)] == [1, 64, 64, 48, 1, 50]


@pytest.mark.parametrize("shape", [(128, 256), (96, 40), (67, 13), (257,), (2, 3, 4), (), (384,)])
def test_to_from_tiles_inverse(shape: tuple[int, ...]) -> None:
    g = tile_grid(shape)
    t = torch.randn(shape)
    tiles = g.to_tiles(t)
    assert tiles.shape == (g.num_tiles, g.tile_elems)
    assert torch.equal(g.from_tiles(tiles), t)
    assert torch.equal(g.to_tiles(g.from_tiles(tiles)), tiles)


def test_tile_contents_and_flat_indices() -> None:
    g = tile_grid((128, 192))
    t = torch.arange(128 * 192).reshape(128, 192)
    tiles = g.to_tiles(t)
    # tile 1 is rows 0..63, cols 64..127; its position r*64+c is element (r, 64+c)
    assert torch.equal(tiles[1].reshape(64, 64), t[:64, 64:128])
    assert torch.equal(tiles[4].reshape(64, 64), t[64:, 64:128])
    pos = torch.tensor([[0, 4095]] * g.num_tiles)
    assert torch.equal(g.flat_indices(pos), tiles.gather(1, pos).reshape(-1))


def test_payload_ratio_256() -> None:
    codec = SparseLoCoCodec(topk=64)
    ct = codec.compress(torch.randn(256, 256))
    assert ct.nbytes == 16 * 64 * 12 // 8 + 16 * 64 // 4 + 20
    assert 256 * 256 * 4 / ct.nbytes >= 140
