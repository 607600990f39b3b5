"""A joining peer's copy of the run's tokenizer, fetched from the coordinator it follows.

A run that pins `data.tokenizer_sha256` in its signed manifest names its tokenizer by hash. A peer with no
file of that hash (no `tokenizer.json` in its `tokens:` folder, or a text source it would otherwise train a
BPE on) asks the coordinator for `GET /api/checkpoint/tokenizer.json` before it takes a role, through the
bounded client every stranger's answer goes through (`hetnode/service/http_download.py`): at most
`MAX_TOKENIZER_BYTES`, within `ATTEMPT_S`, no redirects. The bytes must hash to the pin and load as a BPE;
then they are renamed into the data cache under their hash (`hetnode/data/pinned_tokenizer.py`), where the
dataset build takes them instead of training a tokenizer of its own.

What may pass is asked again, with backoff, for up to `WAIT_S`: the coordinator unreachable or restarting, a
404 (it writes the file once its corpus is built), a 503, a 5xx, a download too slow. What will not pass ends
the join at once with a RefusedAnswer (the CLI exits 2) and a log line, and nothing is trained: a file of
another hash (both named), one over the limit, one that is not a tokenizer, a redirect. The coordinator keeps
one tokenizer per run and serves those same bytes to every ask, so asking again brings the same refusal; a
daemon left waiting would never train and would hide the fault from whoever runs it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from hetnode.config import DataConfig
from hetnode.daemon.peer_address import in_daemon_thread
from hetnode.daemon.status_http import signed_url
from hetnode.data.pinned_tokenizer import TokenizerMismatch, adopt, fetch_target
from hetnode.errors import CheckpointError, ConfigError, DataError, RefusedAnswer
from hetnode.protocol.status_signed import SIGNED_PATH
from hetnode.replica.checkpoint import MAX_TOKENIZER_BYTES
from hetnode.service.http_download import Budget, get_retrying
from hetnode.service.http_server import DEFAULT_STATUS_PORT
from hetnode.service.lifecycle import Stopped, sleep_or_stop, unless_stopped

log = logging.getLogger(__name__)

TOKENIZER_ROUTE = "/api/checkpoint/tokenizer.json"  # the coordinator's (`bootstrap/checkpoint_store.py`)
ATTEMPT_S = 120.0  # one download, its 503s asked again included: 16 MiB at the slowest link a peer may have
WAIT_S = 600.0  # asking again while it may pass: a coordinator (re)starting builds its corpus first
FIRST_RETRY_S = 2.0
MAX_RETRY_S = 30.0
NOT_SERVED = "the coordinator serves no tokenizer (a byte-tokenizer run, or one too old to serve it)"


def coordinator_http(url: str | None, peer_maddr: str, coordinator: str) -> str | None:
    """The coordinator's HTTP base: the URL the peer joined through (`--peer http://HOST:PORT`); else, when
    it joined through the coordinator's own multiaddr, that host at the default status port; else None (a
    member's address says nothing of where the coordinator serves HTTP)."""
    if url is not None:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"
    target = signed_url(peer_maddr, DEFAULT_STATUS_PORT)
    if target is None or target[1] != coordinator:
        return None
    return target[0].removesuffix(SIGNED_PATH)


def download_tokenizer(base_url: str, cfg: DataConfig, data_dir: Path, timeout_s: float = ATTEMPT_S) -> Path:
    """One download of the run's tokenizer (blocking), kept in `data_dir` under its hash; the path. A plain
    CheckpointError may pass; a RefusedAnswer will not (another hash, over the limit, not a tokenizer)."""
    url = base_url.rstrip("/") + TOKENIZER_ROUTE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=data_dir, prefix=".tokenizer-", suffix=".part")
        os.close(fd)
    except OSError as exc:
        raise DataError(
            f"{data_dir}: cannot keep the run's tokenizer there ({exc}); set --data-cache"
        ) from None
    part = Path(name)
    try:
        budget = Budget.starting_now(timeout_s, MAX_TOKENIZER_BYTES, "the download's")
        get_retrying(url, part, MAX_TOKENIZER_BYTES, budget, NOT_SERVED)
        try:
            return adopt(part, cfg, data_dir, url)
        except TokenizerMismatch as exc:
            raise RefusedAnswer(
                f"{exc}; the coordinator serves another tokenizer than its manifest pins: not training on it"
            ) from None
        except DataError as exc:
            raise RefusedAnswer(f"{url}: {exc}") from None
        except OSError as exc:
            raise DataError(f"{data_dir}: cannot keep the run's tokenizer there ({exc})") from None
    finally:
        part.unlink(missing_ok=True)  # gone already once adopted


async def ensure_run_tokenizer(
    cfg: DataConfig,
    base_url: str | None,
    stop: asyncio.Event,
    wait_s: float = WAIT_S,
    attempt_s: float = ATTEMPT_S,
) -> Path | None:
    """Fetch the run's pinned tokenizer into the data cache when this peer holds no copy of it; the path
    fetched to, or None when nothing was needed (no pin, the byte tokenizer, a copy at hand). Asks again
    while a failure may pass, for up to `wait_s`; RefusedAnswer at once when it will not; `Stopped` on
    `stop`."""
    data_dir = Path(cfg.data_dir).expanduser()
    target = fetch_target(cfg, data_dir)
    if target is None:
        return None
    pin = cfg.tokenizer_sha256
    if base_url is None:
        raise ConfigError(  # a flag mends it, not a restart: exit 2
            "--peer",
            "peer",
            f"the run pins its tokenizer (sha256 {pin}) and this peer has no copy, nor the coordinator's "
            f"HTTP address to fetch it from: join with --peer http://HOST:PORT (the coordinator's status "
            f"URL), or copy the run's tokenizer to {target}",
        )
    deadline = time.monotonic() + wait_s
    pause = FIRST_RETRY_S
    while True:
        fetch = functools.partial(download_tokenizer, base_url, cfg, data_dir, attempt_s)
        try:
            path = await unless_stopped(
                stop, in_daemon_thread(fetch, attempt_s + 5.0), "fetching the run's tokenizer"
            )
        except RefusedAnswer as exc:
            log.error("the run's tokenizer: %s", exc)
            raise
        except (CheckpointError, TimeoutError) as exc:
            reason = str(exc) or "no answer (timed out)"
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"no copy of the run's tokenizer (sha256 {pin}) from {base_url} within {wait_s:g} s: "
                    f"{reason}; or copy it to {target}"
                ) from None
            log.warning("cannot fetch the run's tokenizer yet (%s); asking again in %.0f s", reason, pause)
            if await sleep_or_stop(stop, min(pause, left)):
                raise Stopped("stopped while waiting for the run's tokenizer") from None
            pause = min(2 * pause, MAX_RETRY_S)
            continue
        log.info("the run's tokenizer (sha256 %s…) came from %s: kept as %s", pin[:16], base_url, path)
        return path
