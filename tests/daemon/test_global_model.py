"""The global model over real encoded payloads: all-or-nothing apply, state transfer, local state resume."""

import msgpack
import pytest
import torch

from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.planning.rounds import data_slot
from hetnode.replica.global_model import GlobalModel


@pytest.fixture(scope="module")
def dataset(tiny_config):
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, tiny_config.run.seed)


def _round_of(config, dataset, peers, global_model):
    payloads = {}
    for peer in peers:
        training = AnchorTraining(config, dataset, peer)
        payloads[peer] = training.run_round(global_model.params_round + 1, global_model)
    return payloads


@pytest.fixture
def fast_config(tiny_config):
    from hetnode.config import replace

    return replace(tiny_config, "outer", inner_steps=2)


def test_replicas_applying_the_same_seal_hold_identical_parameters(fast_config, dataset):
    a, b = GlobalModel(fast_config), GlobalModel(fast_config)
    payloads = _round_of(fast_config, dataset, ["peer-a", "peer-b"], a)
    a.apply(0, sorted(payloads.items()))
    b.apply(0, sorted(payloads.items()))
    assert a.digests() == b.digests() and a.params_round == 0
    assert a.digests() != GlobalModel(fast_config).digests()  # the round changed θ


def test_a_bad_payload_leaves_theta_untouched(fast_config, dataset):
    model = GlobalModel(fast_config)
    before = model.digests()
    payloads = _round_of(fast_config, dataset, ["peer-a", "peer-b"], model)
    message = msgpack.unpackb(payloads["peer-b"]["head"], raw=False)
    message["tensors"][0]["q"][0] = float("nan")
    payloads["peer-b"]["head"] = msgpack.packb(message, use_bin_type=True, use_single_float=True)
    with pytest.raises(WireError, match="finite"):
        model.apply(0, sorted(payloads.items()))
    assert model.digests() == before and model.params_round == -1
    good = _round_of(fast_config, dataset, ["peer-a"], model)
    with pytest.raises(WireError, match="header"):  # a payload replayed under another replica's name
        model.apply(0, [("peer-z", good["peer-a"])])
    with pytest.raises(ValueError, match="does not follow"):
        model.apply(5, [])


def test_state_transfer_reproduces_theta_exactly(fast_config, dataset):
    source = GlobalModel(fast_config)
    source.apply(0, sorted(_round_of(fast_config, dataset, ["peer-a"], source).items()))
    joiner = GlobalModel(fast_config)
    state = {shard: source.state_payload(shard) for shard in source.shards}
    with pytest.raises(WireError, match="digests"):  # the digests the source publishes must match
        joiner.load_state(0, state, expect_digests=GlobalModel(fast_config).digests())
    assert joiner.params_round == -1  # nothing changed
    joiner.load_state(0, state, expect_digests=source.digests())
    assert joiner.digests() == source.digests() and joiner.params_round == 0
    partial = {shard: source.state_payload(shard) for shard in list(source.shards)[:-1]}
    with pytest.raises(WireError, match="shards"):
        GlobalModel(fast_config).load_state(0, partial)


def test_local_state_resumes_error_feedback_optimiser_and_round(fast_config, dataset, tmp_path):
    model = GlobalModel(fast_config)
    training = AnchorTraining(fast_config, dataset, "peer-a")
    model.apply(0, [("peer-a", training.run_round(0, model))])
    training.save_local_state(tmp_path / "state.pt", model)

    restored_model = GlobalModel(fast_config)
    restored = AnchorTraining(fast_config, dataset, "peer-a")
    assert restored.load_local_state(tmp_path / "state.pt", restored_model)
    assert restored_model.params_round == 0 and restored_model.digests() == model.digests()
    assert (
        restored.feedback_norm() == pytest.approx(training.feedback_norm()) and restored.feedback_norm() > 0
    )
    assert restored.trainer.step == training.trainer.step == 2
    # the next round is the same whether or not the daemon restarted
    assert restored.run_round(1, restored_model) == training.run_round(1, model)
    assert not AnchorTraining(fast_config, dataset, "peer-b").load_local_state(tmp_path / "none.pt", model)


def test_data_slots_differ_between_peers():
    slots = {data_slot(f"Qm{i}") for i in range(50)}
    assert len(slots) > 40  # spread over the slots, few collisions
    assert data_slot("QmX") == data_slot("QmX")


def test_payload_bytes_are_deterministic_across_processes_in_one_round(fast_config, dataset):
    model = GlobalModel(fast_config)
    first = AnchorTraining(fast_config, dataset, "peer-a").run_round(0, model)
    second = AnchorTraining(fast_config, dataset, "peer-a").run_round(0, model)
    assert first == second  # seeded init, the same slot and batches: the sha256 a peer announces is stable
    assert torch.equal(model.params["embed.weight"], GlobalModel(fast_config).params["embed.weight"])


def test_stage_contributions_cover_their_own_shards_only(fast_config, dataset):
    """A chain stage contributes its layers' shards; each shard averages over whoever sent it."""
    full, split = GlobalModel(fast_config), GlobalModel(fast_config)
    payloads = _round_of(fast_config, dataset, ["peer-a"], full)["peer-a"]
    front = {s: p for s, p in payloads.items() if s in ("embed", "0", "1")}
    back = {s: p for s, p in payloads.items() if s not in front}
    full.apply(0, [("peer-a", payloads)])
    # the same payload bytes, re-labelled per stage, give the same θ shard by shard
    with pytest.raises(WireError, match="header"):
        split.apply(0, [("stage-0", front), ("stage-1", back)])  # the payloads still name peer-a
    split.apply(0, [("peer-a", front)])
    assert {s: d for s, d in split.digests().items() if s in front} == {
        s: d for s, d in full.digests().items() if s in front
    }
    untouched = GlobalModel(fast_config).digests()
    assert {s: d for s, d in split.digests().items() if s in back} == {s: untouched[s] for s in back}
    with pytest.raises(WireError, match="subset"):
        GlobalModel(fast_config).decode_contribution("peer-a", 0, {"nonsense": b""})


def test_a_stage_holds_applies_and_loads_only_its_slice(fast_config, dataset):
    """A chain stage's θ is its layers alone: the same values, the same round result, a smaller download."""
    from hetnode.model.shards import ModelPart

    n = fast_config.model.n_layers
    splits = (range(0, n // 2), range(n // 2, n))
    whole = GlobalModel(fast_config)
    front = GlobalModel(fast_config, part=ModelPart.of_stage(splits, 0))
    back = GlobalModel(fast_config, part=ModelPart.of_stage(splits, 1))
    assert set(front.shards) == {"embed", *(str(i) for i in splits[0])}
    assert set(back.shards) == {*(str(i) for i in splits[1]), "head"}
    assert sum(t.numel() for t in front.params.values()) + sum(
        t.numel() for t in back.params.values()
    ) == sum(t.numel() for t in whole.params.values())  # the slices partition θ: memory scales with them
    for part in (front, back):  # seeded per name: a slice built alone holds the whole model's values
        assert part.digests() == {s: d for s, d in whole.digests().items() if s in part.shards}

    payloads = _round_of(fast_config, dataset, ["peer-a", "peer-b"], whole)
    whole.apply(0, sorted(payloads.items()))
    for part in (front, back):  # given only its shards of each sealed payload, a stage ends where all do
        part.apply(
            0,
            [
                (peer, {s: p for s, p in shards.items() if s in part.shards})
                for peer, shards in sorted(payloads.items())
            ],
        )
        assert part.digests() == {s: d for s, d in whole.digests().items() if s in part.shards}

    # catching up: only the slice's shards are downloaded, checked against the whole model's digests
    joiner = GlobalModel(fast_config, part=ModelPart.of_stage(splits, 1))
    state = {shard: whole.state_payload(shard) for shard in joiner.shards}
    assert sum(map(len, state.values())) < sum(len(whole.state_payload(s)) for s in whole.shards) * 0.75
    joiner.load_state(0, state, expect_digests=whole.digests())
    assert joiner.digests() == back.digests()
    corrupted = GlobalModel(fast_config).digests()  # round −1's digests are not round 0's
    with pytest.raises(WireError, match="published digests"):
        GlobalModel(fast_config, part=ModelPart.of_stage(splits, 1)).load_state(0, state, corrupted)
