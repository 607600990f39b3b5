"""The coordinator's history format: seal lines and evaluated lines folded into one entry per round."""

from hetnode.wire.round_history import is_evaluated_line, merge_history


def test_history_lines_merge_into_one_entry_per_round():
    rows = [
        {"round": 0, "contributors": ["a"], "eval_loss": None, "evaluated": False},
        {"round": 1, "contributors": ["a", "b"], "eval_loss": None, "evaluated": False},
        {"round": 0, "evaluated": True, "eval_loss": 4.5, "scores": {"a": 0.2}},
        {"round": 7, "evaluated": True, "eval_loss": 1.0},  # no seal line: dropped
        "torn",
    ]
    merged = merge_history(rows)
    assert [e["round"] for e in merged] == [0, 1]
    assert merged[0]["eval_loss"] == 4.5 and merged[0]["scores"] == {"a": 0.2} and merged[0]["evaluated"]
    assert merged[1]["eval_loss"] is None and merged[1]["contributors"] == ["a", "b"]


def test_old_histories_pass_unchanged_and_a_round_sealed_twice_takes_the_newest():
    old = [
        {"round": 0, "contributors": ["a"], "eval_loss": 5.0},
        {"round": 1, "contributors": [], "eval_loss": 4.9},
    ]
    assert merge_history(old) == old
    assert not is_evaluated_line({"round": 2, "evaluated": True, "contributors": []})  # a seal line
    twice = [
        {"round": 3, "contributors": ["a"], "evaluated": False},
        {"round": 3, "contributors": [], "caught_up_from": "b"},  # sealed before a crash, then caught up
        {"round": 3, "evaluated": True, "eval_loss": 4.0},
    ]
    merged = merge_history(twice)
    assert merged[0].get("eval_loss") is None and merged[1]["eval_loss"] == 4.0
