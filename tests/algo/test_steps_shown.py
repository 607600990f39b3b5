"""`steps_shown` on synthetic updates: one tensor whose norm grows as work^k, with k chosen by the test."""

import torch

from hetnode.algo.scoring import steps_shown


def _update(norm: float) -> dict:
    values = torch.full((4,), norm / 2.0)  # four equal values: L2 norm = norm
    return {"w": (torch.arange(4), values)}


def test_a_replica_far_faster_than_all_others_is_counted_what_it_did_when_they_measure_no_exponent():
    """The others' work lies within 1.5× of each other: they measure no k. A replica with 4× their work at
    k = 0.6 (a steady-state swarm's) was counted 13 of 20 at a guessed 0.84; now counted all of it, while
    one that claims 4× with the others' norm is still counted about what they show."""
    k = 0.6
    work = {"a": 5.0, "b": 5.5, "c": 6.0, "fast": 20.0}
    updates = {p: _update(w**k) for p, w in work.items()}
    shown = steps_shown(updates, work, dict.fromkeys(updates, 1))
    assert shown["fast"] >= 20.0, shown
    assert all(shown[p] >= 0.95 * work[p] for p in "abc"), shown  # judged with the fast one among them
    liar = {p: updates[p] for p in "abc"} | {"liar": _update(5.0**k)}  # the others' norm, a claim of 4x
    shown = steps_shown(liar, work | {"liar": 20.0}, dict.fromkeys(liar, 1))
    assert shown["liar"] < 7.0, shown  # the most any k in [1/2, 1] shows for the others' norm


def test_a_measured_exponent_is_used_alone():
    """Others spread in work measure k; a claim above what their k shows is not rescued by another k."""
    k = 0.9
    work = {"a": 2.0, "b": 4.0, "c": 8.0}
    updates = {p: _update(w**k) for p, w in work.items()} | {"liar": _update(8.0**k)}
    shown = steps_shown(updates, work | {"liar": 16.0}, dict.fromkeys(work, 1) | {"liar": 1})
    assert 7.5 <= shown["liar"] <= 8.5, shown
