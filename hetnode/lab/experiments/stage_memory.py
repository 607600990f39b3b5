"""A chain stage's memory: measured on CPU at a small size, modelled at 178m and 1b (issue 36).

Measured: every tensor the stage holds, counted by storage (a storage shared by two holders counts once):
its weights and buffers, gradients, optimiser state, the stashed weight snapshots and inputs of the
micro-batches in flight, and what autograd saves for backward (`saved_tensors_hooks` sees every saved
tensor, so activations are counted exactly). Sampled whenever autograd saves a tensor, after every
forward and backward, and inside the optimiser step (when the gradients are all there); the peak is
what a device must hold at least (allocator slack and the CUDA context come on top).

Modelled: the same parts from the config, with the tensors a pre-norm block saves per token (see
`block_saved`): in fp32 it must equal the measurement; the GPU figures assume bf16 autocast.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hetnode.algo.optim import ROTATED_NAME_PARTS
from hetnode.config import Config
from hetnode.model.decoder import parameter_shapes
from hetnode.planning.layer_split import split_layers
from hetnode.training.stage_worker import Frame, StageWorker, build_stage_worker

PARTS = ("weights", "grads", "optimizer", "snapshots", "stash", "activations")
GiB = 2**30


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _weight_like(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a snapshot or the live weights), or a view of one (a transposed weight)."""
    base = t if t._base is None else t._base
    return base.is_leaf and base.requires_grad


class Ledger:
    """Bytes a `StageWorker` holds, by part, and the peak of their total."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.saved: list[weakref.ref[torch.Tensor]] = []
        self.peak: dict[str, int] = dict.fromkeys(PARTS, 0)  # the parts at the peak of the total
        self.part_max: dict[str, int] = dict.fromkeys(PARTS, 0)  # each part's own peak
        self.peak_total = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(weakref.ref(t))
        self.sample()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def parts(self) -> dict[str, Iterable[torch.Tensor]]:
        w = self.worker
        flights = list(w.in_flight.values())
        snapshots = {id(f.weights): f.weights for f in flights if f.weights is not None}
        saved = [t for ref in self.saved if (t := ref()) is not None]
        latest = w._latest() if w._latest is not None else None
        return {
            "weights": [*w.stage.parameters(), *w.stage.buffers()],
            "grads": [p.grad for p in w.stage.parameters() if p.grad is not None],
            "optimizer": [v for s in w.optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
            # and the weights a backward recomputes on (its micro-batch is no longer in flight)
            "snapshots": [t for s in snapshots.values() for t in s.tensors.values()]
            + ([] if latest is None else list(latest.tensors.values()))
            + [t for t in saved if _weight_like(t)],
            "stash": [t for f in flights for t in (f.inputs, f.tokens, f.targets)],
            "activations": saved,
        }

    def sample(self) -> int:
        seen: set[int] = set()
        sizes = dict.fromkeys(PARTS, 0)
        for part, tensors in self.parts().items():
            for t in tensors:
                ptr, nbytes = _storage(t)
                if ptr not in seen:
                    seen.add(ptr)
                    sizes[part] += nbytes
        total = sum(sizes.values())
        self.part_max = {part: max(self.part_max[part], sizes[part]) for part in PARTS}
        if total > self.peak_total:
            self.peak_total, self.peak = total, sizes
        self.saved = [ref for ref in self.saved if ref() is not None]
        return total


def measure_stage0(config: Config, stages: int, recompute: bool, rounds: int = 2) -> dict:
    """Stage 0 of a `stages`-deep chain under 1F1B (P in flight), fed downstream gradients of the right
    shape (their values do not change the memory): the peak by part, in bytes."""
    splits = split_layers(config.model.n_layers, [1.0] * stages)
    worker = build_stage_worker(config, splits, 0, config.pipeline.chain_optimizer, True, True, seed=0)
    worker.recompute = recompute
    ledger = Ledger(worker)
    step = worker.optimizer.step

    def sampled_step(*args, **kwargs):  # the gradients are all there now
        ledger.sample()
        out = step(*args, **kwargs)
        ledger.sample()
        return out

    worker.optimizer.step = sampled_step  # type: ignore[method-assign]
    d = config.data
    generator = torch.Generator().manual_seed(0)
    total = stages * rounds
    frames: dict[int, Frame] = {}
    with ledger.hooks():
        for cycle in range(total + stages - 1):
            if cycle < total:
                window = torch.randint(
                    0, config.model.vocab_size, (d.batch_size, d.seq_len + 1), generator=generator
                )
                frames[cycle] = worker.forward(cycle, (window[:, :-1], window[:, 1:]))
                ledger.sample()
            mb = cycle - (stages - 1)
            if mb >= 0:
                shape = frames.pop(mb).tensor.shape
                grad = (1e-3 * torch.randn(shape, generator=generator)).to(worker.wire_dtype)
                worker.backward(mb, grad)
                ledger.sample()
    return {
        "peak": ledger.peak_total,
        "at_peak": ledger.peak,
        "part_max": ledger.part_max,
        "in_flight": stages,
    }


# -- the analytic model ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """Bytes per saved element: `matmul` for what linear layers and attention make, `stream` for the
    residual stream and the norms' internals (fp32 under autocast too)."""

    name: str
    matmul: int
    stream: int
    casts: bool  # autocast saves each linear's own bf16 copy of its input (and of its weight)


FP32 = Precision("fp32", 4, 4, False)
BF16_AUTOCAST = Precision("bf16 autocast", 2, 4, True)


def block_saved(config: Config, p: Precision) -> int:
    """Bytes one block saves for backward per token (flash-style attention: no T×T matrix).

    Attention: norm input x, x·rsqrt, the norm's output (fp32: once; autocast: a bf16 copy per q/k/v
    projection), q and k after the rotary embedding (not before: the rotation's tables need no
    gradient), v, the attention output and its (B, T, d) copy for the output projection, the log-sum-exp
    (H) and the norm scale (1). MLP: the same norm (its output once, or twice under autocast), gate and
    up (f each), silu(gate) and the product."""
    m = config.model
    d, f, h = m.d_model, m.ffn_hidden, m.n_heads
    norms = 2 * (2 * d * p.stream + p.stream)  # x and x·rsqrt, + the scale, per norm
    attn_in = (3 if p.casts else 1) * d * (p.matmul if p.casts else p.stream)
    mlp_in = (2 if p.casts else 1) * d * (p.matmul if p.casts else p.stream)
    attention = 5 * d * p.matmul + 4 * h
    mlp = 4 * f * p.matmul
    return norms + attn_in + mlp_in + attention + mlp


def _stage_shapes(config: Config, layers: range, first: bool, last: bool) -> dict[str, tuple[int, ...]]:
    def held(name: str) -> bool:
        if name.startswith("blocks."):
            return int(name.split(".")[1]) in layers
        if name.startswith("embed."):
            return first or (last and config.model.tie_embeddings)
        return last

    return {n: s for n, s in parameter_shapes(config.model).items() if held(n)}


def _optimizer_elements(config: Config, shapes: dict[str, tuple[int, ...]], name: str) -> int:
    moments = 2 * sum(_numel(s) for s in shapes.values())
    if name != "rotated_adamw":
        return moments
    one_sided = config.inner.rotation == "one_sided"
    extra = 0
    for n, s in shapes.items():
        if len(s) == 2 and any(part in n for part in ROTATED_NAME_PARTS):
            sides = [min(s)] if one_sided else list(s)  # one-sided: the smaller side only
            extra += 2 * sum(size**2 for size in sides)  # a statistic and a basis per side
    return moments + extra


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def model_stage(config: Config, stages: int, index: int, recompute: bool, p: Precision) -> dict:
    """Bytes stage `index` of a `stages`-deep chain holds at its peak, by part (fp32 weights, gradients
    and optimiser state; activations of one micro-batch with `recompute`, of all P−s in flight without)."""
    layers = split_layers(config.model.n_layers, [1.0] * stages)[index]
    first, last = index == 0, index == stages - 1
    shapes = _stage_shapes(config, layers, first, last)
    n = sum(_numel(s) for s in shapes.values())
    tokens = config.data.batch_size * config.data.seq_len
    in_flight = stages - index
    graphs = 1 if (recompute or last) else in_flight
    acts = tokens * len(layers) * block_saved(config, p)
    if p.casts:  # bf16 copies of the block weights, saved while a graph lives
        acts += 2 * sum(_numel(s) for nm, s in shapes.items() if nm.startswith("blocks.") and len(s) == 2)
    if last:
        acts += tokens * config.model.vocab_size * (p.matmul + 4)  # logits and their fp32 log-softmax
    width = config.pipeline.subspace_rank if config.pipeline.compression != "none" else config.model.d_model
    ids = config.data.batch_size * (config.data.seq_len + 1) * 8  # the window: tokens and targets share it
    stash = ids + (0 if first else 2 * width * tokens)  # and the received bf16 frame
    snapshots = 0 if last else in_flight
    parts = {
        "weights": 4 * n,
        "grads": 4 * n,
        "optimizer": 4 * _optimizer_elements(config, shapes, config.pipeline.chain_optimizer),
        "snapshots": 4 * n * snapshots,
        "stash": stash * in_flight if not last else stash,
        "activations": acts * graphs,
    }
    return {"peak": sum(parts.values()), "parts": parts, "in_flight": in_flight, "params": n}
