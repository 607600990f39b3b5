"""The round rules' projection (`hetnode/lab/scale/pace.py`): frame bytes from the real codec, a chain's
pipeline, the budget from the sealer's own `RoundBudget`, and what each rule leaves an anchor idle."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetnode.config import load_config, replace
from hetnode.lab.scale.pace import Pace, embedding_sync_bytes, pace_report, project

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_later_stage_downloads_each_replicas_embedding_payload_instead_of_a_drift_frame():
    config = load_config(CONFIGS / "178m.toml")
    m = config.model
    one = embedding_sync_bytes(config, 1)
    assert embedding_sync_bytes(config, 10) == 10 * one
    assert one < m.vocab_size * m.d_model * 4 / 20  # the V×d fp32 frame it replaces, per hop per round
    assert embedding_sync_bytes(replace(config, "pipeline", compression="none"), 10) == 0


def pace(**changes) -> Pace:
    base = Pace(inner_steps=10, floor=2, cap=20, anchor_step_s=0.1, mb_s=1.0, frame_s=1.0,
                chain_fixed_s=5.0, sync_s=1.5, stage_sync_s=3.0)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_lockstep_waits_for_the_chain_and_the_sync_overlap_hides_only_the_sync():
    p = pace()
    lock, over = project(p, "lockstep", 4, 1), project(p, "overlap", 4, 1)
    assert lock["round_s"] == pytest.approx(5 + 10 + 1.5)  # the chain's H, then the sync
    assert over["round_s"] == pytest.approx(5 + 10 + 3.0)  # its link carries its own sync too
    assert lock["anchor_idle"] == pytest.approx(1 - 1.0 / 16.5)


def test_paced_rounds_leave_out_a_chain_whose_floor_cannot_fit_and_hold_the_anchors_at_their_cap():
    p = pace()
    paced = project(p, "paced+overlap", 4, 1)
    assert paced["chain_micro_batches"] == 0 and paced["anchor_steps"] == p.cap  # budget 2 s: the cap's
    assert paced["round_s"] == pytest.approx(2.0) and paced["anchor_idle"] == pytest.approx(0.0)
    slow_sync = project(dataclasses.replace(p, sync_s=4.0), "paced+overlap", 4, 1)
    assert slow_sync["anchor_idle"] == pytest.approx(0.5)  # a cap's 2 s of training, then waits on sync
    # a chain fast enough for its floor within the cap's time is in, with what fits
    fast_chain = project(dataclasses.replace(p, chain_fixed_s=0.0, mb_s=0.2, frame_s=0.2), "paced", 4, 1)
    assert fast_chain["chain_micro_batches"] >= p.floor


def test_the_report_says_which_cap_hides_the_sync_and_which_lets_the_chains_in():
    config = load_config(CONFIGS / "178m.toml")
    row = {"anchors": 4, "chains": 4, "round_s": 5.0, "stage_download_bytes": 1e7, "stage_upload_bytes": 1e7}
    report = pace_report(config, 178_000_000, row, stage_mbit=20.0)
    rules = report["rules"]
    assert rules["lockstep"]["anchor_idle"] > 0.9  # the anchors wait for the 20 Mbit/s chains
    assert (
        rules["paced+overlap"]["anchor_idle"]
        < rules["paced"]["anchor_idle"]
        < rules["lockstep"]["anchor_idle"]
    )
    at_cap = report["paced+overlap_at_cap"]
    assert at_cap["for_sync"]["anchor_idle"] == pytest.approx(0.0, abs=0.02)
    assert at_cap["for_chains"]["chain_micro_batches"] >= report["pace"]["floor"]
    assert not at_cap["for_chains"]["allowed"]  # far past what the config check allows
