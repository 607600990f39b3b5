"""Run as a script under a chosen ATEN_CPU_CAPABILITY: print the digests of θ⁰, T_fix, U and of θ after two
outer steps with α = 0.7 under every aggregation rule, as JSON (what tests/model/test_portable_theta.py
compares across processes)."""

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetnode.algo.aggregate import AGGREGATION_RULES, aggregate_sparse, outer_sgd_step  # noqa: E402
from hetnode.algo.packing import pack_uint2, pack_uint12  # noqa: E402
from hetnode.algo.sparseloco import CompressedTensor, SparseLoCoCodec  # noqa: E402
from hetnode.algo.subspace import frozen_embedding, orthonormal_basis  # noqa: E402
from hetnode.config import load_config  # noqa: E402
from hetnode.model.decoder import build_model  # noqa: E402
from hetnode.model.shards import layer_digests  # noqa: E402


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def payload(codec: SparseLoCoCodec, shape: tuple[int, ...], g: torch.Generator) -> CompressedTensor:
    """A payload as it arrives on the wire (the same bytes on every replica): positions, codes and table
    drawn with integer and float64 generators, which do not depend on the CPU's SIMD path."""
    grid = codec.grid(shape)
    tiles = [
        torch.randperm(grid.tile_elems, generator=g)[: grid.k].sort().values for _ in range(grid.num_tiles)
    ]
    positions = torch.stack(tiles).reshape(-1).numpy()
    codes = torch.randint(0, 4, (grid.total_selected,), generator=g).numpy()
    table = tuple(float(x) for x in (torch.randn(4, generator=g, dtype=torch.float64) * 1e-3).float())
    shift = float(torch.randn(1, generator=g, dtype=torch.float64).float()[0] * 1e-4)
    return CompressedTensor(grid.shape, pack_uint12(positions), pack_uint2(codes), shift, table)


def main() -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    m = config.model
    params = {n: p.detach().clone() for n, p in build_model(m, seed=0).named_parameters()}
    out = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "init": layer_digests(params),
        "t_fix": digest(frozen_embedding(m.vocab_size, m.d_model, 0, m.init_std)),
        "u": digest(orthonormal_basis(m.d_model, 15, 0)),
    }
    codec = SparseLoCoCodec(config.outer.topk, config.outer.tile)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    rounds = []
    for step in range(2):
        contributions = []
        for replica in ("a", "b", "c", "d", "e"):  # 5 contributors: the trimmed mean drops one at each end
            g = torch.Generator().manual_seed(1000 * step + ord(replica))
            sparse = {n: codec.sparse(payload(codec, shape, g)) for n, shape in shapes.items()}
            contributions.append((replica, sparse))
        rounds.append(contributions)
    out["after_two_steps"] = {}
    for rule in AGGREGATION_RULES:  # every aggregation rule, from the same θ⁰
        theta = {n: p.clone() for n, p in params.items()}
        for contributions in rounds:
            delta = aggregate_sparse(contributions, shapes, rule=rule)
            outer_sgd_step(theta, delta, lr=0.7, weight_decay=0.01)
        out["after_two_steps"][rule] = layer_digests(theta)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
