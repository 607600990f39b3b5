"""The fetch plan: who is asked for which sealed payload, in which order."""

from collections import Counter

from hetnode.planning.fetch import Holder, fetch_order, holders_of, launch_rank, next_requests


def test_holders_are_the_replicas_that_applied_the_round_and_hold_the_shard():
    peers = [
        Holder("anchor", 5, frozenset({"embed", "0", "1", "head"})),
        Holder("stage0", 5, frozenset({"embed", "0"})),
        Holder("behind", 4, frozenset({"embed", "0", "1", "head"})),  # has not applied round 5
        Holder("ahead", 6, frozenset({"embed"})),  # applied 6, still keeps round 5's
        Holder("far", 7, frozenset({"embed"})),  # round 5's payloads are gone there
        Holder("new", None, frozenset({"embed"})),
    ]
    everyone = {holder.peer for holder in peers}
    holders = holders_of(5, peers, keep_rounds=2, sealed_authors=everyone)
    assert sorted(holders["embed"]) == ["ahead", "anchor", "stage0"]
    assert sorted(holders["1"]) == ["anchor"]
    assert "head" in holders and "behind" not in holders["head"]


def test_only_the_rounds_sealed_authors_count_as_holders_whatever_a_record_claims():
    # a thousand fresh identities claim to hold every shard of round 5: none contributed to it
    sybils = [Holder(f"sybil-{i}", 5, frozenset({"embed", "0", "head"})) for i in range(1000)]
    honest = Holder("anchor", 5, frozenset({"embed", "0", "head"}))
    holders = holders_of(5, [*sybils, honest], keep_rounds=2, sealed_authors={"anchor", "stage0"})
    assert holders == {"embed": ["anchor"], "0": ["anchor"], "head": ["anchor"]}


def test_each_fetcher_asks_the_holders_in_an_order_of_its_own():
    holders = [f"author-{i}" for i in range(64)]
    firsts = Counter(min(holders, key=lambda h: launch_rank(f"fetcher-{i}", 3, h)) for i in range(640))
    assert len(firsts) > 48  # no convoy: the first asked is spread over nearly all 64 authors
    assert max(firsts.values()) < 640 / 64 * 3
    assert min(holders, key=lambda h: launch_rank("f", 3, h)) != min(
        holders, key=lambda h: launch_rank("f", 4, h)
    )


def test_each_payload_lists_its_author_and_holders_then_the_sealer_never_the_fetcher():
    holders = {"0": ["h1", "h2", "me", "sealer"]}
    order = fetch_order("me", [("author", "0"), ("me", "0")], holders, "sealer")
    assert order[("author", "0")][-1] == "sealer"
    assert set(order[("author", "0")][:-1]) == {"author", "h1", "h2"}
    assert "me" not in order[("me", "0")] and len(order[("me", "0")]) == len(set(order[("me", "0")]))
    assert len(fetch_order("me", [("a", "0")], {"0": [f"h{i}" for i in range(20)]}, "s", 4)[("a", "0")]) == 5


def test_fetchers_spread_over_holders_instead_of_queueing_at_the_author():
    holders = {"0": [f"holder-{i}" for i in range(7)]}
    first = Counter(
        fetch_order(f"fetcher-{i}", [("author", "0")], holders, "sealer")[("author", "0")][0]
        for i in range(400)
    )
    assert len(first) == 8  # the author and all seven holders are asked first by somebody
    assert max(first.values()) < 400 / 8 * 1.6  # and none by far more than its share
    assert "sealer" not in first


def test_a_failed_holder_is_passed_over_for_every_payload_and_the_sealer_is_last():
    order = {("a", "0"): ["bad", "a", "sealer"], ("b", "0"): ["b", "bad", "sealer"], ("c", "1"): ["bad"]}
    tried: dict = {}
    assert next_requests(order, tried, set()) == {"bad": [("a", "0"), ("c", "1")], "b": [("b", "0")]}
    again = next_requests(order, tried, {"bad"})
    assert again == {"a": [("a", "0")], "b": [("b", "0")]}  # ("c", "1") has nobody left
    tried[("b", "0")] += 1  # b did not serve its own payload: skip "bad" too, ask the sealer
    assert next_requests({("b", "0"): order[("b", "0")]}, tried, {"bad", "b"}) == {"sealer": [("b", "0")]}


def test_holders_that_failed_us_lately_are_asked_after_the_sealer():
    holders = {"0": ["h1", "h2"]}
    order = fetch_order("me", [("author", "0")], holders, "sealer", demoted={"author", "h2"})
    candidates = order[("author", "0")]
    assert candidates[:2] == ["h1", "sealer"] and set(candidates[2:]) == {"author", "h2"}
