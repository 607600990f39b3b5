"""`python tests/swarm/slow_bookkeeping.py SECONDS hetnode-args...`: the hetnode CLI with every evaluation of
the coordinator's bookkeeping worker made SECONDS slower, a test's hook (production code has no such flag).
It sleeps in short steps and ends its sleep when the coordinator stops, as a real evaluation's batches do."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bootstrap import bookkeeping  # noqa: E402
from hetnode.cli.main import main  # noqa: E402

SLOW_S = float(sys.argv.pop(1))
_evaluate = bookkeeping.Bookkeeper.evaluate


def slow_evaluate(self: bookkeeping.Bookkeeper) -> float:
    print("slow evaluation: started", file=sys.stderr, flush=True)
    deadline = time.monotonic() + SLOW_S
    while time.monotonic() < deadline:
        if self._stopping.is_set():
            raise bookkeeping.Stopped
        time.sleep(0.05)
    return _evaluate(self)


bookkeeping.Bookkeeper.evaluate = slow_evaluate

if __name__ == "__main__":
    sys.exit(main())
