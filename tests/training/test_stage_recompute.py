"""A stage recomputes its activations in backward (issue 36): a chain trains bit for bit as the worker did
when it kept every micro-batch's graph and a clone of the weights per micro-batch (`_KeptGraphs`, a copy
of that worker), while it holds one snapshot per weight version in flight, none on the last stage, and no
activations between a micro-batch's forward and its backward."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from hetnode.config import Config, replace
from hetnode.data import TokenDataset
from hetnode.lab.sim.pipeline import PipelineChain, build_chain_workers
from hetnode.planning.layer_split import split_layers
from hetnode.training.stage_worker import Frame, StageWorker

STAGES = 4


class _KeptGraphs(StageWorker):
    """The worker before recomputation: every micro-batch clones all weights and keeps its graph until its
    backward, which accumulates into the clone's `.grad`; the upstream gradient stays on the device."""

    def _forward(self, mb, incoming):
        stage = self.stage
        params = stage.named_parameters()
        snapshot = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params}
        if stage.first:
            tokens, targets = incoming
            received, inputs = None, tokens
        else:
            tokens, targets = incoming.tokens, incoming.targets
            received = incoming.tensor.detach().to(torch.float32).requires_grad_(True)
            inputs = self._decode(received, tokens, self.constraint) if self.compress else received
        if stage.last:
            loss = functional_call(stage, snapshot, (inputs, targets))
            self.in_flight[mb] = (self.version, snapshot, received, loss)
            return loss.detach()
        out = functional_call(stage, snapshot, (inputs,))
        sent = self._encode(out, tokens, self.constraint) if self.compress else out
        self.in_flight[mb] = (self.version, snapshot, received, sent)
        return Frame(mb, sent.detach().to(self.wire_dtype), tokens, targets)

    def backward(self, mb, grad=None):
        version, snapshot, received, sent = self.in_flight.pop(mb)
        if self.stage.last:
            sent.backward()
        else:
            torch.autograd.backward(sent, grad.to(torch.float32))
        self.staleness.append((mb, self.version - version))
        self._step({n: t.grad for n, t in snapshot.items()})
        return None if received is None else received.grad.detach().to(self.wire_dtype)


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    return replace(tiny_config, "data", batch_size=4)


@pytest.fixture(scope="module")
def dataset(config: Config) -> TokenDataset:
    return TokenDataset.build(config.data, config.model.vocab_size, seed=config.run.seed)


def _workers(config: Config, compress: bool, optimizer: str = "rotated_adamw", stages: int = STAGES):
    splits = split_layers(config.model.n_layers, [1.0] * stages)
    return build_chain_workers(config, splits, optimizer, compress=compress, constrained=compress, seed=0)


def _kept_graphs(worker: StageWorker) -> _KeptGraphs:
    w = worker
    return _KeptGraphs(w.stage, w.optimizer, w.lr_at, w.grad_clip, w.constraint, w.compress, w.wire_dtype)


def _recording(workers: list[StageWorker]) -> list[list[torch.Tensor | None]]:
    """Every gradient each worker sends upstream, in order."""
    sent: list[list[torch.Tensor | None]] = [[] for _ in workers]
    for log, worker in zip(sent, workers, strict=True):
        backward = worker.backward

        def recorded(mb, grad=None, backward=backward, log=log):
            out = backward(mb, grad)
            log.append(None if out is None else out.cpu())
            return out

        worker.backward = recorded  # type: ignore[method-assign]
    return sent


def _state(worker: StageWorker) -> list[torch.Tensor]:
    state = [p.detach() for p in worker.stage.parameters()]
    for per_param in worker.optimizer.state.values():
        state += [v for v in per_param.values() if torch.is_tensor(v)]
    return state


@pytest.mark.parametrize(
    ("compress", "recompute"),
    [(True, True), (False, True), (True, False)],
    ids=["bf16-coefficients", "dense-fp32", "graphs-kept-switch"],
)
def test_a_chain_trains_bit_for_bit_as_when_every_graph_was_kept(config, dataset, compress, recompute):
    config = replace(config, "inner", grad_clip=0.5)  # clipping reads the whole gradient: it must match too
    new = _workers(config, compress)
    for worker in new:
        worker.recompute = recompute
    old = [_kept_graphs(w) for w in _workers(config, compress)]
    sent_new, sent_old = _recording(new), _recording(old)
    chains = [PipelineChain(new, dataset), PipelineChain(old, dataset)]
    for _ in range(2):  # two rounds: the pipeline drains and fills again
        losses_new, losses_old = (chain.run(5).losses for chain in chains)
        assert losses_new == losses_old
    for s, (a, b) in enumerate(zip(new, old, strict=True)):
        assert a.staleness == b.staleness and a.version == b.version == 10
        assert [g is None for g in sent_new[s]] == [g is None for g in sent_old[s]]
        for x, y in zip(sent_new[s], sent_old[s], strict=True):
            assert x is None or (x.dtype == y.dtype and torch.equal(x, y)), s
        for x, y in zip(_state(a), _state(b), strict=True):
            assert torch.equal(x, y), s
    assert sent_new[1] and all(g.device.type == "cpu" for g in sent_new[1])  # the wire's host copy


def test_in_flight_micro_batches_hold_their_input_and_a_shared_snapshot_but_no_graph(config, dataset):
    workers = _workers(config, compress=True)
    seen: list[tuple[int, int, int, bool]] = []  # (stage, micro-batches in flight, snapshots, graphs kept)
    for s, worker in enumerate(workers):
        backward = worker.backward

        def inspected(mb, grad=None, backward=backward, worker=worker, s=s):
            flights = worker.in_flight.values()
            snapshots = {id(f.weights) for f in flights if f.weights is not None}
            seen.append((s, len(flights), len(snapshots), any(f.graph is not None for f in flights)))
            return backward(mb, grad)

        worker.backward = inspected  # type: ignore[method-assign]
    PipelineChain(workers, dataset).run(8)
    for s, in_flight, snapshots, graphs in seen:
        assert in_flight <= STAGES - s
        if s == STAGES - 1:  # the last stage: its graph on the live weights, used at once
            assert (in_flight, snapshots, graphs) == (1, 0, True)
        else:
            assert 1 <= snapshots <= in_flight and not graphs
    first = [(n, k) for s, n, k, _ in seen if s == 0]
    assert first[0] == (STAGES, 1)  # the warm-up ran all on version 0: one snapshot for them all
    assert (STAGES, STAGES) in first  # then one version each
    assert not workers[0].in_flight and workers[0]._latest() is None  # drained: every snapshot freed


def test_a_write_to_the_weights_between_two_forwards_gives_a_new_snapshot(config, dataset):
    worker = _workers(config, compress=True)[0]
    batch = dataset.train_batch(0, 1, 0)
    param = next(worker.stage.parameters())
    before = param.detach().clone()
    worker.forward(0, batch)
    worker.forward(1, batch)
    with torch.no_grad():
        param.add_(1.0)  # what a rebase does between two micro-batches
    worker.forward(2, batch)
    w0, w1, w2 = (worker.in_flight[mb].weights for mb in range(3))
    assert w0 is w1 and w2 is not w0
    name = next(n for n, _ in worker.stage.named_parameters())
    assert torch.equal(w0.tensors[name], before) and torch.equal(w2.tensors[name], before + 1.0)
