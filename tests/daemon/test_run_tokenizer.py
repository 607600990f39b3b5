"""A joining peer fetches the run's pinned tokenizer from the coordinator's real checkpoint route over HTTP on
loopback: the pinned bytes are kept and trained with; another hash, an oversize or endless body, or no
tokenizer served at all are refused with an error that says which, and nothing is kept or trained on."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bootstrap.checkpoint_store import CheckpointRoutes, keep_tokenizer
from hetnode.config import DataConfig
from hetnode.daemon import run_tokenizer
from hetnode.daemon.run_tokenizer import coordinator_http, download_tokenizer, ensure_run_tokenizer
from hetnode.data import BpeTokenizer, TokenDataset
from hetnode.data.pinned_tokenizer import pinned_path
from hetnode.data.prepared import prepare_tokens
from hetnode.errors import CheckpointError, ConfigError, DataError, RefusedAnswer
from hetnode.replica.checkpoint import MAX_TOKENIZER_BYTES
from hetnode.service.http_server import HttpServer

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER_ID = "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"
TEXTS = [f"Line {i} of the coordinator's corpus: rivers, bridges and {i % 7} trains." for i in range(80)]


@pytest.fixture(scope="module")
def run_bpe() -> BpeTokenizer:
    return BpeTokenizer.train(TEXTS, 290, "run")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HttpServer, Path]]:
    """The coordinator's checkpoint routes on its real HTTP server, over an empty checkpoints folder."""
    root = tmp_path / "coordinator" / "checkpoints"
    root.mkdir(parents=True)
    server = HttpServer("127.0.0.1", 0, CheckpointRoutes(root).routes(), request_timeout_s=2.0)
    server.start()
    yield server, root
    server.stop()


@pytest.fixture
def peer_cfg(tmp_path: Path) -> DataConfig:
    """A peer's BPE run over its own text source (which it would train a BPE on, unpinned)."""
    texts = tmp_path / "peer-texts"
    texts.mkdir()
    for i in range(30):
        (texts / f"doc-{i:02d}.txt").write_text(
            f"Peer document {i}: rivers and trains. " * 6, encoding="utf-8"
        )
    return DataConfig(
        source=f"dir:{texts}",
        tokenizer="bpe",
        bpe_vocab_size=300,
        seq_len=15,
        batch_size=2,
        eval_fraction=0.2,
        data_dir=str(tmp_path / "peer-cache"),
    )


def pinned(cfg: DataConfig, sha: str) -> DataConfig:
    return DataConfig(**{**cfg.__dict__, "tokenizer_sha256": sha})


def sha_of(tokenizer: BpeTokenizer) -> str:
    return hashlib.sha256(tokenizer.to_json().encode()).hexdigest()


def ensure(cfg: DataConfig, base: str | None, wait_s: float = 5.0) -> Path | None:
    return asyncio.run(ensure_run_tokenizer(cfg, base, asyncio.Event(), wait_s=wait_s, attempt_s=5.0))


def kept(cfg: DataConfig) -> list[str]:
    """Every file the peer's data cache holds (a refused download leaves nothing, not even a part)."""
    cache = Path(cfg.data_dir)
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_the_pinned_tokenizer_is_fetched_kept_and_trained_with(served, peer_cfg, run_bpe):
    server, root = served
    keep_tokenizer(root, run_bpe)  # as the coordinator's bookkeeping does once its corpus is built
    cfg = pinned(peer_cfg, sha_of(run_bpe))
    path = ensure(cfg, server.url)
    assert path == pinned_path(Path(cfg.data_dir), cfg.tokenizer_sha256)
    assert path.read_text(encoding="utf-8") == run_bpe.to_json() and kept(cfg) == [path.name]

    dataset = TokenDataset.build(cfg, vocab_size=320, seed=0)
    assert dataset.tokenizer.to_json() == run_bpe.to_json()  # the run's ids, not a BPE learnt here
    assert dataset.tokenizer.vocab_size == 290 and not list(Path(cfg.data_dir).glob("bpe-*.json"))

    server.stop()  # a copy at hand: nothing is asked again, so a coordinator away does not matter
    assert ensure(cfg, server.url) is None
    assert ensure(pinned(peer_cfg, ""), None) is None  # no pin: the peer trains its own, as before


def test_a_copy_of_prepared_shards_alone_trains_with_the_coordinators_tokenizer(served, peer_cfg, tmp_path):
    """The large-corpus flow: the coordinator reads a prepared `tokens:` folder and serves its tokenizer; a
    peer's copy of the shards without `tokenizer.json` fetches it, and the bytes are the pinned ones."""
    server, root = served
    folder = tmp_path / "prepared"
    info = prepare_tokens(peer_cfg, folder, 20, tmp_path / "prepare-cache")["tokenizer"]
    run = pinned(DataConfig(**{**peer_cfg.__dict__, "source": f"tokens:{folder}"}), info["sha256"])
    coordinators = TokenDataset.build(run, vocab_size=320, seed=0, data_dir=tmp_path / "coordinator-cache")
    keep_tokenizer(root, coordinators.tokenizer)  # what the coordinator serves: the folder's bytes, re-saved

    copy = tmp_path / "peer-copy"
    copy.mkdir()
    for shard in folder.iterdir():
        if shard.name != "tokenizer.json":
            (copy / shard.name).write_bytes(shard.read_bytes())
    peer = DataConfig(**{**run.__dict__, "source": f"tokens:{copy}"})
    assert ensure(peer, server.url) == pinned_path(Path(peer.data_dir), info["sha256"])
    ours = TokenDataset.build(peer, vocab_size=320, seed=0)
    assert ours.tokenizer.to_json() == (folder / "tokenizer.json").read_text(encoding="utf-8")
    assert ours.train_tokens == coordinators.train_tokens and ours.tokenizer.name == info["name"]


def test_a_tokenizer_of_another_hash_is_refused_naming_both(served, peer_cfg, run_bpe):
    server, root = served
    keep_tokenizer(root, run_bpe)
    other = BpeTokenizer.train([t.upper() for t in TEXTS], 290, "other")
    cfg = pinned(peer_cfg, sha_of(other))
    with pytest.raises(RefusedAnswer) as refused:
        ensure(cfg, server.url)
    assert f"sha256 {sha_of(run_bpe)} is not the run's data.tokenizer_sha256 {sha_of(other)}" in str(
        refused.value
    )
    assert "not training on it" in str(refused.value)
    assert kept(cfg) == []
    with pytest.raises(DataError, match=f"not the run's data.tokenizer_sha256 {sha_of(other)}"):
        TokenDataset.build(cfg, vocab_size=320, seed=0)  # and the peer will not train a BPE of its own


def test_a_malformed_file_is_refused_even_when_the_pin_names_it(served, peer_cfg):
    server, root = served
    (root / "tokenizer.json").write_bytes(b'{"model": "not a tokenizer"}')
    cfg = pinned(peer_cfg, hashlib.sha256(b'{"model": "not a tokenizer"}').hexdigest())
    with pytest.raises(RefusedAnswer, match="the pinned hash names no BPE tokenizer hetnode can use"):
        ensure(cfg, server.url)
    assert kept(cfg) == []


def test_an_oversize_tokenizer_is_refused_before_its_body_is_read(served, peer_cfg, run_bpe):
    server, root = served
    with open(root / "tokenizer.json", "wb") as f:  # sparse: 16 MiB + 1 on the coordinator's disk
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    cfg = pinned(peer_cfg, sha_of(run_bpe))
    started = time.monotonic()
    with pytest.raises(RefusedAnswer, match=f"answer of {MAX_TOKENIZER_BYTES + 1:,} bytes, more than the"):
        ensure(cfg, server.url)
    assert time.monotonic() - started < 2.0 and kept(cfg) == []


def test_an_endless_body_without_a_length_is_cut_at_the_limit(peer_cfg, run_bpe, monkeypatch):
    """A server that declares nothing and never stops: the peer reads the limit and one chunk more."""
    monkeypatch.setattr(run_tokenizer, "MAX_TOKENIZER_BYTES", 256 << 10)
    listener = socket.create_server(("127.0.0.1", 0))
    sent = [0]

    def flood() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
            chunk = b"x" * 65536
            try:
                while sent[0] < 1 << 30:  # a gibibyte: far past anything read before the refusal
                    conn.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                pass  # the peer hung up

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    cfg = pinned(peer_cfg, sha_of(run_bpe))
    try:
        with pytest.raises(RefusedAnswer, match=f"longer than the {256 << 10:,} bytes allowed"):
            download_tokenizer(f"http://127.0.0.1:{listener.getsockname()[1]}", cfg, Path(cfg.data_dir), 10.0)
        thread.join(10)
    finally:
        listener.close()
    assert not thread.is_alive() and sent[0] < 64 << 20  # cut off long before the gibibyte
    assert kept(cfg) == []


def test_no_tokenizer_served_is_asked_again_then_a_clear_error(served, peer_cfg, run_bpe, monkeypatch):
    server, root = served
    cfg = pinned(peer_cfg, sha_of(run_bpe))
    with pytest.raises(CheckpointError, match="HTTP 404 no tokenizer here") as missing:
        download_tokenizer(server.url, cfg, Path(cfg.data_dir), 5.0)
    assert not isinstance(missing.value, RefusedAnswer)  # it may pass: the coordinator may be building it
    monkeypatch.setattr(run_tokenizer, "FIRST_RETRY_S", 0.1)
    with pytest.raises(
        CheckpointError, match=f"no copy of the run's tokenizer \\(sha256 {cfg.tokenizer_sha256}\\)"
    ):
        ensure(cfg, server.url, wait_s=0.3)
    assert kept(cfg) == []

    # a coordinator that writes it while the peer waits: the peer's next ask takes it
    writer = threading.Timer(0.3, keep_tokenizer, (root, run_bpe))
    writer.start()
    try:
        assert ensure(cfg, server.url, wait_s=10.0) == pinned_path(Path(cfg.data_dir), cfg.tokenizer_sha256)
    finally:
        writer.cancel()


def test_where_the_coordinator_serves_http():
    assert coordinator_http("http://coordinator:8400/", "/ip4/10.0.0.1/tcp/1/p2p/" + PEER_ID, PEER_ID) == (
        "http://coordinator:8400"
    )
    # joined through the coordinator's own multiaddr: its host, at the default status port
    assert coordinator_http(None, f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER_ID}", PEER_ID) == "http://10.0.0.1:8400"
    assert coordinator_http(None, f"/ip6/::1/tcp/31337/p2p/{PEER_ID}", PEER_ID) == "http://[::1]:8400"
    # through a member: its host says nothing of the coordinator's
    assert coordinator_http(None, f"/ip4/10.0.0.2/tcp/31337/p2p/{OTHER_ID}", PEER_ID) is None


def test_no_address_to_fetch_from_says_how_to_give_one(peer_cfg, run_bpe):
    cfg = pinned(peer_cfg, sha_of(run_bpe))
    with pytest.raises(ConfigError, match="join with --peer http://HOST:PORT") as refused:
        ensure(cfg, None)
    assert str(pinned_path(Path(cfg.data_dir), cfg.tokenizer_sha256)) in str(refused.value)
    assert not os.path.exists(cfg.data_dir)
