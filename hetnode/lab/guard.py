"""What every root lab command (`bench network`, `bench scale --calibrate`) shares around its daemons:

- a plan that cannot form what it measures is refused before anything starts, naming the config key and
  the value it needs (as `hetnode demo` refuses edges below a stage's minimum link);
- a running lab that stops making progress ends with the reason: who took which role, who exited;
- Ctrl+C and SIGTERM unwind the same way (`interruptible`), and the cleanup after them cannot be cut
  short by a second signal (`shielded`): the daemons stop in parallel, then the lab's namespaces go.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hetnode.config import Config
from hetnode.errors import ConfigError, HetnodeError
from hetnode.lab.netlab.hosts import NetLab
from hetnode.lab.procs import LabProcess

# after this many sealed rounds in a row without the rounds a lab waits for, it ends: a chain forms within
# a few boundaries when it can form at all
STALL_ROUNDS = 30
# what a daemon logs about its role (hetnode/daemon/peer.py), newest last
ROLE_LINES = re.compile(
    r"class (?P<cls>\w+), role (?P<first>idle \(wants \w+\)|\w+)"
    r"|boundary \d+: role (?P<role>\w+)"
    r"|chain \S+ (?P<live>live): stage (?P<stage>\d+)"
    r"|chain \S+ (?P<gone>not confirmed|is not complete)"
)


class LabStalled(HetnodeError):
    """A running lab stopped making progress; the message says why."""


# --- refusing a plan up front ------------------------------------------------------------------------


def check_roles_possible(config: Config, members: Mapping[str, tuple[str, float]], flag: str) -> None:
    """`members`: name -> (the role it asks for with --role, the Mbit/s it declares). A declared link below
    `network.stage_min_up_mbps` is slow: the daemon takes no role and waits idle, so the lab would wait
    for rounds that never come. Raises ConfigError naming `flag` and the config key."""
    floor = config.network.stage_min_up_mbps
    slow = {name: mbit for name, (_, mbit) in members.items() if mbit < floor}
    if slow:
        lowest = min(slow.values())
        names = ", ".join(sorted(slow))
        raise ConfigError(
            flag,
            "network.stage_min_up_mbps",
            f"{lowest:g} Mbit/s ({names}) is below the config's network.stage_min_up_mbps = {floor:g}: "
            f"those peers would take no role and wait idle; use {flag} >= {floor:g} "
            f"or a config with network.stage_min_up_mbps <= {lowest:g}",
        )


def check_chain_possible(config: Config, stages: int, flag: str) -> None:
    """A chain needs at least two stages, and no more stages than the model has layers."""
    layers = config.model.n_layers
    if not 2 <= stages <= layers:
        raise ConfigError(
            flag,
            "pipeline.stages",
            f"a chain of {stages} stage(s) cannot form: it needs 2 <= pipeline.stages <= model.n_layers "
            f"({layers})",
        )


# --- a lab that stops making progress -----------------------------------------------------------------


def roles_seen(logs: Mapping[str, Path]) -> dict[str, str]:
    """name -> the last role its daemon logged ("idle (wants idle), class slow", "stage 1 (live)", ...)."""
    out = {}
    for name, path in logs.items():
        try:
            text = path.read_text(errors="replace")
        except OSError:
            out[name] = "no log"
            continue
        role, link = "not decided yet", ""
        for m in ROLE_LINES.finditer(text):
            if m["cls"]:
                role, link = m["first"], f", class {m['cls']}"
            elif m["role"]:
                role = m["role"]
            elif m["live"]:
                role = f"stage {m['stage']} (chain live)"
            elif m["gone"]:
                role = f"idle (chain {m['gone']})"
        out[name] = role + link
    return out


def stalled_reason(processes: Sequence[LabProcess], logs: Mapping[str, Path]) -> str:
    """One line per daemon: its role, or how it exited."""
    roles = roles_seen(logs)
    lines = []
    for process in processes:
        code = process.proc.poll()
        what = roles.get(process.name, "coordinator")
        lines.append(f"  {process.name}: {what}" + ("" if code is None else f", exited with {code}"))
    return "\n".join(lines)


def check_running(processes: Sequence[LabProcess]) -> None:
    """A daemon that exited mid-run ends the lab: the rounds it should be in will not come."""
    for process in processes:
        code = process.proc.poll()
        if code is not None:
            raise LabStalled(f"{process.name} exited with {code} while the lab ran:\n{process.tail(15)}")


# --- signals ---------------------------------------------------------------------------------------------


def _still_stopping(signum: int, _frame: Any) -> None:
    # os.write, not print: a handler that prints while the main thread prints raises a reentrant-call error
    os.write(2, f"\n{signal.Signals(signum).name}: still stopping the lab, please wait\n".encode())


def _unwind(signum: int, _frame: Any) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the first signal unwinds; later ones only say so
        signal.signal(sig, _still_stopping)
    os.write(2, f"\n{signal.Signals(signum).name}: stopping the lab\n".encode())
    raise KeyboardInterrupt


@contextmanager
def _handlers(handler: Any) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def interruptible() -> Any:
    """While the lab runs: SIGTERM (a `timeout`, a CI runner, `kill`) unwinds as Ctrl+C does, by
    KeyboardInterrupt, so that every `finally` below runs and stops what the lab started."""
    return _handlers(_unwind)


def shielded() -> Any:
    """During a lab's cleanup: SIGINT and SIGTERM are noted, not raised, so the cleanup runs to its end
    (daemons left running keep their namespaces, and the veths in them, alive)."""
    return _handlers(_still_stopping)


@contextmanager
def lab_session(lab: NetLab) -> Iterator[NetLab]:
    """`with lab_session(NetLab(rates)) as lab:` builds the lab and removes it on the way out, shielded: a
    signal arriving then does not leave half of its namespaces behind (a build cut short removes what it
    made, and close() runs again here, which finds nothing more to do)."""
    try:
        yield lab.__enter__()
    finally:
        with shielded():
            lab.close()
