"""The lab's WAN links: profiles refuse what no link can be, the delay line holds, jitters and drops packets
as asked (seeded), and in a real lab (root) an emulated link adds the RTT and loss asked of it, and
leaves no emulator, tap or namespace behind."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from hetnode.lab.netlab.hosts import NetLab, lab_namespaces, lab_unavailable
from hetnode.lab.netlab.wan import PRESETS, DelayLine, LinkProfile, LinkProfileError, link_profile
from hetnode.lab.runs.wan_check import echo, echo_summary, steady_rate

NEEDS_ROOT = pytest.mark.skipif(
    bool(lab_unavailable()) or not os.path.exists("/dev/net/tun"),
    reason=lab_unavailable() or "the WAN emulator needs /dev/net/tun",
)


@pytest.mark.parametrize(
    "bad",
    [
        {"down_mbit": 0.0},
        {"up_mbit": float("nan")},
        {"delay_ms": -1.0},
        {"delay_ms": 10.0, "jitter_ms": 11.0},
        {"loss": 0.9},
        {"loss": float("inf")},
        {"delay_ms": 1e9},
    ],
)
def test_a_profile_no_link_can_be_is_refused(bad):
    with pytest.raises(LinkProfileError):
        LinkProfile(**bad)


def test_profiles_come_from_presets_rates_or_nothing():
    assert link_profile("home-cable") == PRESETS["home-cable"]
    assert link_profile("home-cable").up_mbit < link_profile("home-cable").down_mbit  # asymmetric
    assert link_profile(20.0) == LinkProfile(down_mbit=20.0, up_mbit=20.0)
    assert not link_profile(20.0).emulated and not link_profile(None).emulated
    assert link_profile("far").emulated and link_profile("far").rtt_ms == 150.0
    with pytest.raises(LinkProfileError, match="presets"):
        link_profile("dial-up")


def test_a_delay_line_holds_each_packet_for_its_delay_in_order():
    line = DelayLine(0.050)
    for i in range(5):
        assert line.push(i * 0.001, bytes([i]))
    assert line.pop_due(0.049) == []
    assert line.next_due() == pytest.approx(0.050)
    assert line.pop_due(0.0525) == [b"\x00", b"\x01", b"\x02"]
    assert line.pop_due(1.0) == [b"\x03", b"\x04"] and len(line) == 0 and line.passed == 5


def test_jitter_stays_in_its_band_and_never_reorders_unless_asked():
    fifo = DelayLine(0.020, 0.005)
    for i in range(2000):
        fifo.push(i * 1e-4, i.to_bytes(2, "big"))
    out = [int.from_bytes(p, "big") for p in fifo.pop_due(10.0)]
    assert out == list(range(2000))  # FIFO: a later packet waits for the one ahead
    free = DelayLine(0.020, 0.005, reorder=True)
    for i in range(2000):
        free.push(0.0, i.to_bytes(2, "big"))
    dues = []
    while len(free):
        due = free.next_due()
        dues.append(due)
        free.pop_due(due)
    assert min(dues) >= 0.015 and max(dues) <= 0.025  # delay +- jitter
    assert max(dues) - min(dues) > 0.008  # and it does jitter
    order = [int.from_bytes(p, "big") for p in _drain(DelayLine(0.020, 0.005, reorder=True), 2000)]
    assert order != sorted(order)  # reordered, as asked


def _drain(line: DelayLine, n: int) -> list[bytes]:
    for i in range(n):
        line.push(0.0, i.to_bytes(2, "big"))
    return line.pop_due(10.0)


def test_loss_is_drawn_per_packet_at_the_asked_rate_and_a_seed_fixes_which():
    import random

    def lost(seed: int) -> list[int]:
        line = DelayLine(0.0, loss=0.05, rng=random.Random(seed))
        return [i for i in range(20_000) if not line.push(0.0, b"")]

    first = lost(7)
    assert 0.04 < len(first) / 20_000 < 0.06
    assert lost(7) == first and lost(8) != first


def test_a_full_line_drops_at_the_tail():
    line = DelayLine(1.0, max_packets=3)
    assert [line.push(0.0, b"x") for _ in range(5)] == [True, True, True, False, False]
    assert line.overflowed == 2


def test_echo_and_rate_summaries_follow_their_definitions():
    summary = echo_summary(10, 8, {1: 0.010, 2: 0.020, 3: 0.030, 4: 0.040})
    assert summary["loss_up"] == pytest.approx(0.2) and summary["loss_down"] == pytest.approx(0.5)
    assert summary["rtt_ms_mean"] == pytest.approx(25.0) and summary["rtt_ms_p50"] == pytest.approx(30.0)
    rate = steady_rate([[0.0, 0], [1.0, 1_000_000], [3.0, 6_000_000]], warm_s=1.0)
    assert rate["mbit_steady"] == pytest.approx(20.0) and rate["mbit_overall"] == pytest.approx(16.0)


def _emulator_pids(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"wan_emulator.*{tag}"], capture_output=True, text=True).stdout
    return found.split()


@NEEDS_ROOT
@pytest.mark.slow
def test_an_emulated_link_adds_the_asked_rtt_and_loss_and_leaves_nothing_behind():
    lossy = LinkProfile(delay_ms=15.0, jitter_ms=1.0, loss=0.10)
    with NetLab(
        {"core": None, "far": LinkProfile(delay_ms=15.0, jitter_ms=1.0), "lossy": lossy}, seed=3
    ) as lab:
        tag = lab.tag
        assert lab.emulator is not None and lab.emulator.alive() and _emulator_pids(tag)
        near = echo(lab.hosts["core"], lab.hosts["core"], 20, 0.005, 0.3)
        far = echo(lab.hosts["far"], lab.hosts["core"], 200, 0.005, 0.5)
        assert 28.0 <= far["rtt_ms_mean"] <= 34.0  # 2 x 15 ms, plus a little of the probe's own
        assert far["rtt_ms_mean"] > 20 * near["rtt_ms_mean"]
        assert far["loss_up"] == 0 and far["loss_down"] == 0
        lossy_echo = echo(lab.hosts["lossy"], lab.hosts["core"], 1000, 0.002, 0.5)
        assert 0.05 <= lossy_echo["loss_up"] <= 0.16 and 0.05 <= lossy_echo["loss_down"] <= 0.16
    deadline = time.monotonic() + 10
    while _emulator_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _emulator_pids(tag) and not lab_namespaces(tag)
