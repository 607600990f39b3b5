"""The coordinator's bookkeeping worker beside the seal (`bootstrap/bookkeeping.py`), on real parts: the
tiny model, real payloads and the verifier, a SQLite ledger, checkpoints on disk, the Prometheus registry.
Slow evaluations are made by a hook in the test (a subclass), never by a flag in the code."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
import torch

from bootstrap.bookkeeping import Bookkeeper, RoundWork, Stopped, credit_rows, snapshot
from bootstrap.checkpoint_store import CheckpointRoutes, keep_tokenizer
from bootstrap.ledger import Contribution, Ledger
from bootstrap.swarm_metrics import SwarmMetrics
from bootstrap.verifier import replica_of
from hetnode.config import Config, replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.data.tokenizer import ByteTokenizer
from hetnode.model.shards import layer_digests
from hetnode.replica.checkpoint import list_checkpoints, load_checkpoint
from hetnode.replica.global_model import GlobalModel, PreparedRound
from hetnode.service.metrics import PeerMetrics
from hetnode.wire.round_history import merge_history

LAG = "hetnode_bookkeeping_lag_rounds"
SKIPPED = "hetnode_bookkeeping_skipped_rounds_total"


class SlowBooks(Bookkeeper):
    """The hook: each evaluation waits for the test to release it (and ends if the coordinator stops)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.evaluating = threading.Event()
        self.release = threading.Event()
        self.fail_next = False

    def evaluate(self) -> float:
        self.evaluating.set()
        while not self.release.wait(0.01):
            if self._stopping.is_set():
                raise Stopped
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the evaluation hook failed on purpose")
        return super().evaluate()


@pytest.fixture
def parts(tiny_config: Config, tmp_path: Path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    peer_metrics = PeerMetrics(trains=False)
    metrics = SwarmMetrics(peer_metrics, ledger)
    metrics.sample = lambda name: peer_metrics.registry.get_sample_value(name) or 0.0  # for the tests
    yield tiny_config, ledger, metrics, tmp_path
    ledger.close()


def books_for(cls, config: Config, ledger: Ledger, metrics: SwarmMetrics, folder: Path, theta: GlobalModel):
    lines: list[dict] = []
    books = cls(config, ledger, folder / "checkpoints", "run-x", lines.append, metrics)
    books.build(theta.params, theta.params_round)
    return books, lines


def synthetic_round(theta: GlobalModel, peer: str = "peer-a") -> RoundWork:
    """A checked step of θ (small, seeded) as a sealed round of one contributor, without payloads."""
    round_ = theta.params_round + 1
    generator = torch.Generator().manual_seed(round_)
    delta = {n: 1e-3 * torch.randn(t.shape, generator=generator) for n, t in theta.params.items()}
    credit = Contribution(peer, peer, "anchor", 100, 2, 10)
    return RoundWork(
        round_, step=PreparedRound(round_, delta), sealed=[peer], credits=[credit], sealed_at=1.0
    )


def seal(books: Bookkeeper, theta: GlobalModel, work: RoundWork) -> None:
    """What the keeper does: a snapshot only if asked for, commit, digests, hand over."""
    if books.needs_base(work.round):
        work.base, work.base_round = snapshot(theta.params), work.round - 1
    theta.commit(work.step)
    work.digests = theta.digests()
    books.submit(work)


async def until(check, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not in time"
        await asyncio.sleep(0.01)


def test_real_rounds_are_scored_credited_evaluated_and_checkpointed_on_a_bit_exact_copy(parts):
    config, ledger, metrics, folder = parts
    config = replace(config, "outer", inner_steps=2, checkpoint_every_rounds=2)
    theta = GlobalModel(config)
    books, lines = books_for(Bookkeeper, config, ledger, metrics, folder, theta)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    peers = ["honest-a", "honest-b", "honest-c"]
    trainers = {p: AnchorTraining(config, dataset, p) for p in peers}

    async def main() -> None:
        books.start()
        for round_ in range(3):
            payloads = {p: trainers[p].run_round(round_, theta) for p in peers}
            decoded = [(p, theta.decode_contribution(p, round_, payloads[p])) for p in peers]
            credits = [Contribution(p, p, "anchor", 1000, 2, 1) for p in peers]
            work = RoundWork(
                round_,
                step=theta.prepare(round_, decoded),
                sealed=peers,
                scorable=decoded,
                replicas={p: replica_of(p, None) for p in peers},
                credits=credits,
                sealed_at=float(round_),
            )
            seal(books, theta, work)
            await until(lambda: books.lag == 0)  # one at a time: each round in full
        await books.close()

    asyncio.run(main())
    assert [line["round"] for line in lines] == [0, 1, 2] and not any(line["skipped"] for line in lines)
    for line in lines:
        assert set(line["scores"]) == set(peers) and line["eval_loss"] > 0 and line["tokens"] == 3000
    assert books.held == 2 and layer_digests(books.theta) == theta.digests()  # bit for bit
    assert ledger.totals().rounds == 3 and len(ledger.recent_verdicts()) == 9
    written = {round_: folder for round_, folder in list_checkpoints(folder / "checkpoints")}
    assert set(written) == {0, 2}  # every 2 rounds, from the worker's copy of the round it names
    params, manifest = load_checkpoint(written[2])  # loads only if its bytes hash to its digests
    assert manifest.layer_digests == theta.digests()


def test_behind_it_takes_the_newest_first_skips_the_older_and_says_how_far_behind(parts):
    config, ledger, metrics, folder = parts
    config = replace(config, "outer", verify=False)
    theta = GlobalModel(config)
    books, lines = books_for(SlowBooks, config, ledger, metrics, folder, theta)
    sample = metrics.sample

    async def main() -> None:
        books.start()
        seal(books, theta, synthetic_round(theta))  # round 0: the worker takes it and waits in evaluate
        await until(books.evaluating.is_set)
        seal(books, theta, synthetic_round(theta))  # round 1 waits
        assert not books._pending[-1].base  # one round may wait with its step alone
        third = synthetic_round(theta)
        assert books.needs_base(third.round)  # a second one brings a snapshot and supersedes round 1
        seal(books, theta, third)
        assert sample(LAG) == 3 and books.lag == 3
        books.release.set()
        await until(lambda: books.lag == 0)
        await books.close()

    asyncio.run(main())
    by_round = {line["round"]: line for line in lines}
    assert by_round[0]["eval_loss"] > 0 and not by_round[0]["skipped"]
    assert by_round[1]["skipped"] and "eval_loss" not in by_round[1]  # superseded: credited only
    assert by_round[2]["eval_loss"] > 0 and not by_round[2]["skipped"]  # the newest, in full
    assert sample(LAG) == 0 and sample(SKIPPED) == 1
    assert ledger.totals().rounds == 3  # every sealed round is credited, skipped or not
    assert books.held == 2 and layer_digests(books.theta) == theta.digests()


def test_a_failing_evaluation_is_logged_and_the_next_round_goes_on(parts, caplog):
    config, ledger, metrics, folder = parts
    config = replace(config, "outer", verify=False)
    theta = GlobalModel(config)
    books, lines = books_for(SlowBooks, config, ledger, metrics, folder, theta)
    books.release.set()
    books.fail_next = True

    async def main() -> None:
        books.start()
        for _ in range(2):
            seal(books, theta, synthetic_round(theta))
            await until(lambda: books.lag == 0)
        await books.close()

    with caplog.at_level(logging.ERROR, logger="bootstrap.bookkeeping"):
        asyncio.run(main())
    assert "round 0: evaluation failed" in caplog.text and "on purpose" in caplog.text
    assert "eval_loss" not in lines[0] and lines[0]["tokens"] == 100  # credited all the same
    assert lines[1]["eval_loss"] > 0 and ledger.totals().rounds == 2


def test_a_clean_stop_ends_the_phase_in_hand_and_credits_the_rounds_waiting(parts):
    config, ledger, metrics, folder = parts
    config = replace(config, "outer", verify=False)
    theta = GlobalModel(config)
    books, lines = books_for(SlowBooks, config, ledger, metrics, folder, theta)

    async def main() -> float:
        books.start()
        seal(books, theta, synthetic_round(theta))
        await until(books.evaluating.is_set)  # it never gets released: the stop ends it
        seal(books, theta, synthetic_round(theta))
        started = asyncio.get_running_loop().time()
        await books.close(timeout_s=10)
        return asyncio.get_running_loop().time() - started

    took = asyncio.run(main())
    assert took < 5
    assert [line["round"] for line in lines] == [0, 1] and all(line["skipped"] for line in lines)
    assert ledger.totals().rounds == 2


def test_a_round_sealed_before_a_crash_is_credited_by_the_next_life(parts):
    config, ledger, metrics, folder = parts
    theta = GlobalModel(config)
    books, _ = books_for(Bookkeeper, config, ledger, metrics, folder, theta)
    credits = [Contribution("peer-a", "a", "anchor", 100, 2, 10)]
    seal_line = {"round": 4, "contributors": ["peer-a"], "time": 9.0, "evaluated": False}
    history = merge_history(
        [
            {"round": 3, "contributors": ["peer-a"], "time": 8.0, "eval_loss": 4.0},  # before this change
            seal_line | {"credits": credit_rows(credits)},
        ]
    )
    [line] = books.recover(history)
    assert line["round"] == 4 and line["recovered"] and line["tokens"] == 100
    assert ledger.totals().rounds == 1 and ledger.standings()[0].tokens == 100
    merged = merge_history([*history, line])
    assert merged[1]["evaluated"] is True and merged[1]["contributors"] == ["peer-a"]


def test_a_bpe_runs_tokenizer_is_kept_beside_the_checkpoints_and_served(parts):
    """What `hetnode export --from URL` downloads instead of rebuilding the BPE from a data config."""
    config, ledger, metrics, folder = parts
    config = replace(config, "data", tokenizer="bpe", bpe_vocab_size=300, max_documents=400, batch_size=2)
    books, _ = books_for(Bookkeeper, config, ledger, metrics, folder, GlobalModel(config))
    kept = folder / "checkpoints" / "tokenizer.json"
    assert kept.read_text() == books.dataset.tokenizer.to_json()
    answer = CheckpointRoutes(folder / "checkpoints").tokenizer()
    with answer.file:
        assert answer.file.read() == kept.read_bytes() and answer.length == kept.stat().st_size
    assert keep_tokenizer(folder / "checkpoints", ByteTokenizer()) is None and not kept.exists()
    assert CheckpointRoutes(folder / "checkpoints").tokenizer().status == 404


def run_in_order(books: Bookkeeper, theta: GlobalModel, rounds: int) -> None:
    async def main() -> None:
        books.start()
        for _ in range(rounds):
            seal(books, theta, synthetic_round(theta))
            await until(lambda: books.lag == 0)
        await books.close()

    asyncio.run(main())


def test_evaluation_and_its_sample_come_every_k_rounds_credit_every_round(parts):
    config, ledger, metrics, folder = parts
    config = replace(replace(config, "outer", verify=False), "train", eval_every_rounds=3)
    config = replace(config, "samples", tokens=4)
    theta = GlobalModel(config)
    books, lines = books_for(Bookkeeper, config, ledger, metrics, folder, theta)
    run_in_order(books, theta, 7)
    evaluated = [line["round"] for line in lines if "eval_loss" in line]
    assert evaluated == [0, 3, 6] and all(lines[r]["eval_loss"] > 0 for r in evaluated)
    assert [line["round"] for line in lines if "sample" in line] == [0, 3, 6]
    assert not any(line["skipped"] for line in lines)  # not evaluated is not skipped: scored and credited
    assert ledger.totals().rounds == 7 and all(line["tokens"] == 100 for line in lines)
    # the history as readers see it: the seal lines' nulls stay on the rounds between
    seals = [{"round": r, "contributors": ["peer-a"], "eval_loss": None, "sample": None} for r in range(7)]
    merged = merge_history([*seals, *lines])
    assert [e["round"] for e in merged if e["eval_loss"] is not None] == [0, 3, 6]
    assert all(e["sample"] is None for e in merged if e["eval_loss"] is None)


def test_a_due_evaluation_the_worker_skipped_comes_with_the_next_round_it_takes_in_full(parts):
    config, ledger, metrics, folder = parts
    config = replace(replace(config, "outer", verify=False), "train", eval_every_rounds=2)
    theta = GlobalModel(config)
    books, lines = books_for(SlowBooks, config, ledger, metrics, folder, theta)

    async def main() -> None:
        books.start()
        seal(books, theta, synthetic_round(theta))  # round 0, due: held in its evaluation
        await until(books.evaluating.is_set)
        for _ in range(3):  # rounds 1-3 wait; 2 and 3 bring snapshots: 1 and 2 are superseded
            seal(books, theta, synthetic_round(theta))
        books.release.set()
        await until(lambda: books.lag == 0)
        for _ in range(2):  # rounds 4 and 5, one at a time
            seal(books, theta, synthetic_round(theta))
            await until(lambda: books.lag == 0)
        await books.close()

    asyncio.run(main())
    by_round = {line["round"]: line for line in lines}
    assert by_round[1]["skipped"] and by_round[2]["skipped"]  # round 2 was due, and skipped
    assert [r for r, line in sorted(by_round.items()) if "eval_loss" in line] == [0, 3, 4]
    assert books.held == 5 and layer_digests(books.theta) == theta.digests()


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_forwards_run_on_the_device_while_theta_steps_and_is_checkpointed_on_cpu(parts):
    """On a CPU machine: cpu threaded through, the CPU path; on a GPU machine the same test runs cuda."""
    config, ledger, metrics, folder = parts
    config = replace(replace(config, "outer", inner_steps=2, checkpoint_every_rounds=2), "samples", tokens=4)
    theta = GlobalModel(config)
    lines: list[dict] = []
    books = Bookkeeper(config, ledger, folder / "checkpoints", "run-x", lines.append, metrics, device=DEVICE)
    books.build(theta.params, theta.params_round)
    assert books.verifier.device == DEVICE and next(books.sampler.model.parameters()).device == DEVICE
    assert (books.forwards is books.model) == (DEVICE.type == "cpu")
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in books.theta.values())
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    peers = ["honest-a", "honest-b", "honest-c"]
    trainers = {p: AnchorTraining(config, dataset, p) for p in peers}
    published: dict[int, dict[str, str]] = {}

    async def main() -> None:
        books.start()
        for round_ in range(2):
            payloads = {p: trainers[p].run_round(round_, theta) for p in peers}
            decoded = [(p, theta.decode_contribution(p, round_, payloads[p])) for p in peers]
            work = RoundWork(
                round_,
                step=theta.prepare(round_, decoded),
                sealed=peers,
                scorable=decoded,
                replicas={p: replica_of(p, None) for p in peers},
                credits=[Contribution(p, p, "anchor", 1000, 2, 1) for p in peers],
                sealed_at=float(round_),
            )
            seal(books, theta, work)
            published[round_] = work.digests
            await until(lambda: books.lag == 0)
        await books.close()

    asyncio.run(main())
    assert all(set(line["scores"]) == set(peers) for line in lines)
    assert all(line["scores"][p] > 0 for line in lines for p in peers)  # honest work, wherever scored
    assert books.held == 1 and layer_digests(books.theta) == theta.digests()  # bit for bit, any device
    with torch.no_grad():  # the reference: θ's eval loss on CPU in fp32
        batches = books.dataset.eval_batches(config.train.eval_batches)
        cpu_loss = sum(books.model.loss(x, y).item() for x, y in batches) / len(batches)
    loss = lines[-1]["eval_loss"]
    assert loss == cpu_loss if DEVICE.type == "cpu" else abs(loss - cpu_loss) < 0.02 * cpu_loss
    assert lines[-1]["sample"]["tokens"] > 0
    [(written, checkpoint)] = list_checkpoints(folder / "checkpoints")  # round 0's: every 2 rounds
    assert written == 0 and load_checkpoint(checkpoint)[1].layer_digests == published[0]


def test_the_swarms_passes_over_the_data_are_counted_and_told_once_past_max_epochs(parts, caplog):
    """Many slots read the corpus at once: the replicas' own guard counts one replica's steps, so the
    coordinator counts the swarm's credited tokens against the run's training tokens (from the ledger's
    totals across a restart) and says once when they pass `train.max_epochs`."""
    config, ledger, metrics, folder = parts
    theta = GlobalModel(config)
    books, lines = books_for(Bookkeeper, config, ledger, metrics, folder, theta)
    train_tokens = books.dataset.train_tokens
    per_round = train_tokens // 2 + 1  # two rounds pass one epoch
    config = replace(config, "train", max_epochs=1.0)
    books.config = config

    async def main() -> None:
        books.start()
        for _ in range(3):
            work = synthetic_round(theta)
            work.credits = [Contribution("peer-a", "peer-a", "anchor", per_round, 2, 10)]
            seal(books, theta, work)
            await until(lambda: books.lag == 0)
        await books.close()

    with caplog.at_level(logging.ERROR, logger="bootstrap.bookkeeping"):
        asyncio.run(main())
    epochs = [line["data_epochs"] for line in lines]
    assert epochs == [round(k * per_round / train_tokens, 4) for k in (1, 2, 3)]
    told = [r for r in caplog.records if "passes over the run's" in r.getMessage()]
    assert len(told) == 1 and "round 1" in told[0].getMessage()  # the round that passed it, once
    again, _ = books_for(Bookkeeper, config, ledger, metrics, folder, theta)  # a restart: from the ledger
    assert again._swarm_tokens == 3 * per_round
