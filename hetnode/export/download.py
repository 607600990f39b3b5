"""The downloads of `hetnode export --from URL` and `hetnode sample --from URL`, in the CLI's words.

The bounded GET itself (byte and time budgets, no redirects, 503 asked again, one printable line of the
sender's words) is `hetnode/service/http_download.py`, shared with a joining peer's tokenizer download; this
names what its errors say here: the deadline is the user's `--timeout`, and a bare 404 means no checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from hetnode.service.http_download import Budget, get_retrying

NO_CHECKPOINT = "no checkpoint here (none written yet, or a coordinator too old to serve one)"
TIMEOUT_FLAG = "--timeout"


def budget(timeout_s: float, max_bytes: int) -> Budget:
    """What one `--from URL` may cost: `--timeout` seconds for everything, `max_bytes` written to disk for
    one copy of the checkpoint."""
    return Budget.starting_now(timeout_s, max_bytes, TIMEOUT_FLAG)


def fetch(url: str, dest: Path, limit: int, within: Budget, missing: str = NO_CHECKPOINT) -> None:
    """`url` into `dest` (at most `limit` bytes, within the budget); a 503 is asked again."""
    get_retrying(url, dest, limit, within, missing)
