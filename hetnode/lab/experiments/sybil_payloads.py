"""What the Sybils of `sybil_bench.py` send in place of honest work, made from decoded payloads: a payload
under another name (`relabelled`), negated, scaled, or a copy with a share of its top-k positions moved
(`perturbed`: what passes a copy screen)."""

from __future__ import annotations

import dataclasses

import torch

from hetnode.wire.sync_payload import DecodedPayload


def relabelled(messages: list[DecodedPayload], peer: str) -> list[DecodedPayload]:
    return [dataclasses.replace(m, replica=peer) for m in messages]


def negated(messages: list[DecodedPayload]) -> list[DecodedPayload]:
    return [dataclasses.replace(m, sparse={n: (i, -v) for n, (i, v) in m.sparse.items()}) for m in messages]


def scaled(sparse: dict, factor: float) -> dict:
    return {n: (i, v * factor) for n, (i, v) in sparse.items()}


def perturbed(
    messages: list[DecodedPayload], peer: str, moved: float, gen: torch.Generator, numels: dict[str, int]
) -> list[DecodedPayload]:
    """`messages` under `peer`'s name with a share `moved` of each tensor's positions moved to positions
    it did not select (values kept): a copy that a ≥ 0.9-overlap screen lets through."""
    out = []
    for m in messages:
        sparse = {}
        for name, (idx, vals) in m.sparse.items():
            idx = idx.reshape(-1).long().clone()
            numel = numels[name]
            count = int(round(moved * idx.numel()))
            if count:
                chosen = torch.randperm(idx.numel(), generator=gen)[:count]
                free = torch.ones(numel, dtype=torch.bool)
                free[idx] = False
                candidates = free.nonzero().reshape(-1)
                idx[chosen] = candidates[torch.randperm(candidates.numel(), generator=gen)[:count]]
            sparse[name] = (idx, vals.reshape(-1).clone())
        out.append(dataclasses.replace(m, replica=peer, sparse=sparse))
    return out
