"""A stage's frame write may take as long as its measured upload rate needs (with slack), so that a slow
honest link is never cut mid-frame while a dead neighbour is noticed in seconds on a fast one; and every
config's frames fit its own minimum stage link."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetnode.config import load_config
from hetnode.daemon.chain_links import MIN_WRITE_TIMEOUT_S, WRITE_SLACK, frame_write_timeout_s
from hetnode.daemon.stage_training import frame_limits
from hetnode.lab.scale.pace import frame_bytes
from hetnode.wire.activation_frame import encode_drift

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_the_timeout_follows_the_frame_and_the_link():
    two_mb = 2 * 10**6
    at_10 = frame_write_timeout_s(two_mb, 10.0)
    assert at_10 == pytest.approx(MIN_WRITE_TIMEOUT_S + WRITE_SLACK * 1.6)  # 1.6 s at 10 Mbit/s
    assert frame_write_timeout_s(two_mb, 100.0) < at_10 < frame_write_timeout_s(two_mb, 1.0)
    assert frame_write_timeout_s(4 * two_mb, 10.0) > at_10
    assert frame_write_timeout_s(100, 1000.0) == pytest.approx(MIN_WRITE_TIMEOUT_S, abs=1e-3)
    assert frame_write_timeout_s(two_mb, 0.0) > 0  # an unmeasured link never divides by zero


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_frame_of_a_config_fits_its_minimum_stage_link(path: Path):
    config = load_config(path)
    compressed = config.pipeline.compression != "none"
    act = frame_bytes(config)  # the largest frame a stage writes: act and grad are the same shape
    assert act <= frame_limits(config, compressed).max_bytes
    assert len(encode_drift(10**6, 10**6 - 1)) < 64  # not V×d any more (134 MB at 1b)
    rate = config.network.stage_min_up_mbps
    transfer_s = act * 8 / (rate * 1e6)
    # and it leaves a link of that rate time to train: one frame each way per micro-batch, well under 10 s
    assert transfer_s < 10.0, f"{path.stem}: an act frame takes {transfer_s:.1f} s at {rate} Mbit/s"
