"""A fixed share of the CPU per lab process: one cgroup-v1 `cpu` folder each, with a CFS quota (root).

`cpu.cfs_quota_us` = share × `cpu.cfs_period_us` caps what the folder's processes run per period, so a
daemon given 0.3 of a core never runs more than that, however idle the rest of the machine is: while one
daemon waits for the network, another cannot use its share, and waiting shows as waiting. (Pinning with
`taskset` gives each process a whole core, which two cores cannot give five daemons.)

A process joins its folder before it execs the daemon (`prefix`), so everything it forks later (its
`p2pd`, DHT helpers) is in the folder too. Leaving removes the folders; a process still in one (a child
that outlived its daemon) is moved back to the root group first. The unified (v2) hierarchy here has no
cpu controller, so v1 is what this uses.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from hetnode.errors import HetnodeError
from hetnode.lab.guard import shielded

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000  # the kernel's default period; the quota is set against it
JOIN = 'echo $$ > "$0" && exec "$@"'  # sh: move this shell into the folder, then become the command


class QuotaUnavailable(HetnodeError):
    """No cgroup-v1 cpu controller here (or no root): the lab cannot fix each process's CPU share."""


def quota_us(share: float, period_us: int = PERIOD_US) -> int:
    """The CFS quota that caps a folder at `share` of one core (0.35: 35 % of a core per period)."""
    if not 0.01 <= share <= 64:
        raise ValueError(f"a CPU share is between 0.01 and 64 cores, got {share!r}")
    return max(1000, round(share * period_us))


def check_quotas_possible(root: Path = CPU_ROOT) -> None:
    if not (root / "cpu.cfs_quota_us").exists():
        raise QuotaUnavailable(
            f"no cgroup-v1 cpu controller at {root} (cpu.cfs_quota_us): the lab cannot give each "
            "daemon a fixed CPU share"
        )


class CpuQuotas:
    """`with CpuQuotas({"anchor-1": 0.3, ...}) as quotas:` makes `hetnode-<tag>-<name>` folders under the
    cpu hierarchy; `quotas.prefix(name)` is the command prefix that runs a process in its folder."""

    def __init__(self, shares: Mapping[str, float], root: Path = CPU_ROOT, tag: str | None = None) -> None:
        self.root = root
        self.tag = tag or uuid.uuid4().hex[:6]
        self.shares = dict(shares)
        for share in self.shares.values():
            quota_us(share)  # refused before anything is made
        self.folders: dict[str, Path] = {}

    def __enter__(self) -> CpuQuotas:
        check_quotas_possible(self.root)
        try:
            for name, share in self.shares.items():
                folder = self.root / f"hetnode-{self.tag}-{name}"
                folder.mkdir()
                self.folders[name] = folder
                period_file = folder / "cpu.cfs_period_us"  # the kernel makes it with the folder
                period = int(period_file.read_text().strip()) if period_file.exists() else PERIOD_US
                (folder / "cpu.cfs_quota_us").write_text(f"{quota_us(share, period)}\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with shielded():  # a second Ctrl+C must not leave folders behind
            self.close()

    def prefix(self, name: str) -> list[str]:
        """`sh -c` that joins `name`'s folder and execs the rest of the command line; none for a name
        without a share."""
        folder = self.folders.get(name)
        return [] if folder is None else ["sh", "-c", JOIN, str(folder / "cgroup.procs")]

    def throttling(self, name: str) -> dict[str, float] | None:
        """From the folder's cpu.stat: the share of CFS periods in which the quota held its processes back
        and the seconds they were held (a daemon that is rarely held had CPU to spare), or None."""
        folder = self.folders.get(name)
        if folder is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return parse_cpu_stat((folder / "cpu.stat").read_text())
        return None

    def close(self, wait_s: float = 5.0) -> None:
        """Remove every folder: wait a little for its processes to be gone, then move what is left to the
        root group (a folder with processes cannot be removed)."""
        deadline = time.monotonic() + wait_s
        for name, folder in list(self.folders.items()):
            while folder.exists():
                try:
                    folder.rmdir()
                except OSError:
                    if time.monotonic() < deadline:
                        time.sleep(0.1)
                        continue
                    self._evict(folder)
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                    break
            self.folders.pop(name, None)

    def _evict(self, folder: Path) -> None:
        with contextlib.suppress(OSError):
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.procs").write_text(f"{pid}\n")


def parse_cpu_stat(text: str) -> dict[str, float]:
    """`cpu.stat` (nr_periods, nr_throttled, throttled_time in ns) as {throttled_share, throttled_s}."""
    stat = {
        key: int(value) for key, value in (line.split()[:2] for line in text.splitlines() if line.strip())
    }
    periods = stat.get("nr_periods", 0)
    return {
        "throttled_share": stat.get("nr_throttled", 0) / periods if periods else 0.0,
        "throttled_s": stat.get("throttled_time", 0) / 1e9,
    }


def stray_folders(root: Path = CPU_ROOT) -> list[Path]:
    """Folders this module made that still exist (a lab killed with SIGKILL leaves them)."""
    return sorted(root.glob("hetnode-*")) if root.exists() else []
