"""`python tests/swarm/coordinator_hooks.py SECONDS CRASH_FILE hetnode-args...`: the hetnode CLI with two
faults a test needs and production code has no flag for:
- every evaluation of the coordinator's bookkeeping worker is SECONDS slower (it sleeps in short steps and
  ends its sleep when the coordinator stops, as a real evaluation's batches do);
- once CRASH_FILE exists, the coordinator kills itself (SIGKILL) at its next seal, after the round's seal
  line is on disk and before the seal is stored: the last instant before a seal goes out."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bootstrap import bookkeeping  # noqa: E402
from hetnode.cli.main import main  # noqa: E402
from hetnode.protocol import sealing  # noqa: E402

SLOW_S = float(sys.argv.pop(1))
CRASH_FILE = Path(sys.argv.pop(1))
_evaluate = bookkeeping.Bookkeeper.evaluate
_publish = sealing.Sealer.publish


def slow_evaluate(self: bookkeeping.Bookkeeper) -> float:
    print("slow evaluation: started", file=sys.stderr, flush=True)
    deadline = time.monotonic() + SLOW_S
    while time.monotonic() < deadline:
        if self._stopping.is_set():
            raise bookkeeping.Stopped
        time.sleep(0.05)
    return _evaluate(self)


async def publish_or_crash(self: sealing.Sealer, sealed: sealing.SealedRound, seen: dict) -> None:
    if CRASH_FILE.exists():
        print(f"crash before storing the seal of round {sealed.record['round']}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    await _publish(self, sealed, seen)


bookkeeping.Bookkeeper.evaluate = slow_evaluate
sealing.Sealer.publish = publish_or_crash

if __name__ == "__main__":
    sys.exit(main())
