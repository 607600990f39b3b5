"""Processes seen through /proc: what runs below a daemon (its `p2pd`), and whether a pid still names the
process it named before (a pid is reused; with its start time it names one process)."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a daemon and its p2pd)."""
    return [pid, *descendants(pid)]


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process)."""
    fields = _stat(pid)
    return fields[19] if fields else None


def process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running (a zombie has exited; it only waits for its parent to reap it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"
