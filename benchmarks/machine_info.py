"""What a benchmark's JSON records about the machine it ran on (for the scripts in this folder): the CPUs,
Python, platform and the load average before and after, since a busy machine changes every timing."""

from __future__ import annotations

import os
import platform
import time


def machine(load_before: tuple[float, float, float]) -> dict:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def when(started: float) -> dict:
    """The run's start (UTC) and length, for a run that began at `started` (time.time())."""
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
    }
