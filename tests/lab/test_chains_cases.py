"""`hetnode bench chains` acts on the chain as the status showed it at its first whole seal: a chain formed
before the fastest candidate was ready keeps its order (a working chain is not re-planned), and killing
"a worker of the pool" must then kill one of that pool, not the chain's lone first stage."""

from __future__ import annotations

from hetnode.lab.runs import chains_cases
from hetnode.lab.runs.chains_figures import first_stage
from hetnode.lab.runs.chains_plan import FIRST


def record_with(names):
    return {"layout_before": {"names": names}}


def test_the_pool_and_the_lead_are_read_from_the_chain_as_it_formed():
    planned = record_with([[FIRST], ["stage-1a", "stage-1b"]])
    assert first_stage(planned) == FIRST
    assert chains_cases._second_stage(None, planned) == ["stage-1a", "stage-1b"]
    # formed while stage-0 was not ready: stage-1a leads, stage-0 joined the second stage's pool
    reordered = record_with([["stage-1a"], ["stage-1b", FIRST]])
    assert first_stage(reordered) == "stage-1a"
    assert chains_cases._second_stage(None, reordered) == ["stage-1b", FIRST]


def test_without_a_status_the_planned_first_stage_leads():
    assert first_stage({}) == FIRST and first_stage(record_with([])) == FIRST
