"""A model's parameters grouped by layer ("embed", "0".."L-1", "head"): the unit of one sync message, and
the digests by which replicas show they hold bit-identical θ."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import torch

from hetnode.model import layer_of

Params = dict[str, torch.Tensor]


def shard_names(params: Params) -> dict[str, list[str]]:
    """Tensor names grouped by layer ("embed", "0".."L-1", "head"): one sync message per group."""
    shards: dict[str, list[str]] = defaultdict(list)
    for name in params:
        shards[layer_of(name)].append(name)
    return dict(shards)


def layer_digests(params: Params, prefix_chars: int = 16) -> dict[str, str]:
    """sha256 prefix of the exact bytes of each layer group: equal digests mean bit-identical layers."""
    digests = {}
    for shard, names in sorted(shard_names(params).items()):
        h = hashlib.sha256()
        for name in sorted(names):
            h.update(name.encode())
            h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
        digests[shard] = h.hexdigest()[:prefix_chars]
    return digests


@dataclass(frozen=True)
class ModelPart:
    """The contiguous slice of the model a replica holds: all of it (an anchor) or one chain stage's
    layers, with the embedding on the first stage and the final norm and head on the last."""

    layers: range
    first: bool
    last: bool
    # a later stage of a compressed chain holds θ's embedding too, without training it: it builds each round's
    # T_fix' from it (docs/chains.md, "Subspace-compressed boundaries"), as the first stage does, instead of
    # receiving a V×d frame
    embed: bool = False

    @classmethod
    def whole(cls, n_layers: int) -> ModelPart:
        return cls(range(n_layers), first=True, last=True, embed=True)

    @classmethod
    def of_stage(
        cls, splits: list[range] | tuple[range, ...], index: int, tracks_embedding: bool = False
    ) -> ModelPart:
        """Stage `index`'s slice; `tracks_embedding`: a compressed chain's stage (they all need θ's embedding
        for T_fix'; the first one has it anyway)."""
        first = index == 0
        return cls(splits[index], first=first, last=index == len(splits) - 1, embed=first or tracks_embedding)
