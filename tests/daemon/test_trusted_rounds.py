"""The trust checks of a round on real encoded payloads (docs/security.md, "Who is trusted with what"–§2):
float32 value bounds, signed
envelopes, all-or-nothing steps, seal chains and the credit a round earns."""

import functools
import hashlib

import msgpack
import pytest
import torch

from hetnode.config import replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.errors import WireError
from hetnode.net.identity import ephemeral_identity
from hetnode.net.signing import open_payload, sign_payload
from hetnode.planning.rounds import replica_tokens
from hetnode.replica.global_model import ApplyError, GlobalModel
from hetnode.wire.seals import GENESIS, seal_digest, seal_verdict
from hetnode.wire.signed_payload import decode_envelope, encode_envelope

RUN = "tiny-test"
MAX = 1 << 24


@pytest.fixture(scope="module")
def dataset(tiny_config):
    return TokenDataset.build(tiny_config.data, tiny_config.model.vocab_size, tiny_config.run.seed)


@pytest.fixture
def fast_config(tiny_config):
    return replace(tiny_config, "outer", inner_steps=2)


@pytest.fixture(scope="module")
def authors():
    return [ephemeral_identity() for _ in range(2)]


def signed_round(config, dataset, identities, model):
    """One round of real payloads from each identity, signed as a daemon signs them."""
    payloads = {}
    for identity in identities:
        bodies = AnchorTraining(config, dataset, identity.peer_id).run_round(model.params_round + 1, model)
        payloads[identity.peer_id] = {s: sign_payload(identity, RUN, b) for s, b in bodies.items()}
    return payloads


def opener():
    return functools.partial(open_payload, RUN, max_bytes=MAX)


def with_shift(data: bytes, shift: float) -> bytes:
    message = msgpack.unpackb(data, raw=False)
    for entry in message["tensors"]:
        entry["q"][0] = shift
    return msgpack.packb(message, use_bin_type=True, use_single_float=False)


def test_signed_payloads_apply_and_forgeries_are_refused(fast_config, dataset, authors):
    model = GlobalModel(fast_config, opener=lambda data: open_payload(RUN, data, MAX))
    payloads = signed_round(fast_config, dataset, authors, model)
    a, b = (i.peer_id for i in authors)
    # a payload under another author's name: its signature names its real author
    with pytest.raises(WireError, match="signed by"):
        model.apply(0, [(b, payloads[a])])
    # altered after signing
    envelope = decode_envelope(payloads[a]["head"], MAX)
    tampered = encode_envelope(envelope.__class__(envelope.key, envelope.signature, envelope.body + b"\x00"))
    with pytest.raises(WireError, match="signature"):
        model.apply(0, [(a, {**payloads[a], "head": tampered})])
    # signed for another run
    other_run = sign_payload(authors[0], "another-run", decode_envelope(payloads[a]["head"], MAX).body)
    with pytest.raises(WireError, match="signature"):
        model.apply(0, [(a, {**payloads[a], "head": other_run})])
    assert model.params_round == -1
    model.apply(0, sorted(payloads.items()))
    assert model.params_round == 0


def test_a_shift_finite_in_float64_but_not_in_float32_is_refused(fast_config, dataset, authors):
    model = GlobalModel(fast_config)
    bodies = AnchorTraining(fast_config, dataset, "peer-a").run_round(0, model)
    before = model.digests()
    with pytest.raises(WireError, match="float32"):
        model.apply(0, [("peer-a", {**bodies, "head": with_shift(bodies["head"], 1e39)})])
    with pytest.raises(WireError, match="limit"):
        model.apply(0, [("peer-a", {**bodies, "head": with_shift(bodies["head"], 1e6)})])
    assert model.digests() == before and model.params_round == -1


def test_a_step_that_would_overflow_changes_nothing(fast_config, dataset):
    model = GlobalModel(fast_config)
    bodies = AnchorTraining(fast_config, dataset, "peer-a").run_round(0, model)
    decoded = model.decode_contribution("peer-a", 0, bodies)
    with torch.no_grad():
        model.params["head.weight"][0, 0] = torch.finfo(torch.float32).max  # θ at the edge: steps overflow
    before = {n: p.clone() for n, p in model.params.items()}
    with pytest.raises(ApplyError) as failure:
        model.prepare(0, [("peer-a", decoded)])
    assert failure.value.peers == ("peer-a",)
    assert all(torch.equal(before[n], p) for n, p in model.params.items()) and model.params_round == -1


def test_the_fetch_bound_covers_real_signed_payloads(fast_config, dataset, authors):
    model = GlobalModel(fast_config)
    payloads = signed_round(fast_config, dataset, authors[:1], model)
    for shard, data in next(iter(payloads.values())).items():
        bound = model.sparse_specs[shard].max_payload_bytes()
        assert len(data) <= bound < 2 * len(data) + 8192, (shard, len(data), bound)


def test_seal_verdicts_follow_the_chain():
    first = {"round": 0, "contributions": [], "excluded": [], "sealed_at": 1.0, "prev": GENESIS}
    second = {**first, "round": 1, "prev": seal_digest(first)}
    allowed = ["coord"]
    assert seal_verdict(first, "coord", allowed, -1, GENESIS) == "apply"
    assert seal_verdict(first, "mallory", allowed, -1, GENESIS) == "not_allowed"
    assert seal_verdict(second, "coord", allowed, 0, seal_digest(first)) == "apply"
    assert seal_verdict(second, "coord", allowed, 0, "f" * 64) == "fork"
    assert seal_verdict({**second, "round": 10**9}, "coord", allowed, 0, seal_digest(first)) == "behind"
    assert seal_verdict(first, "coord", allowed, 0, seal_digest(first)) == "old"
    assert seal_verdict(second, "coord", allowed, 0, None) == "apply"  # an old local state: unknown hash
    assert seal_digest(dict(reversed(list(second.items())))) == seal_digest(second)  # canonical
    assert (
        seal_digest(second)
        == hashlib.sha256(
            b'{"contributions":[],"excluded":[],"prev":"'
            + seal_digest(first).encode()
            + b'","round":1,"sealed_at":1.0}'
        ).hexdigest()
    )


def test_credit_is_the_schedule(fast_config):
    o, d = fast_config.outer, fast_config.data
    assert replica_tokens(fast_config) == o.inner_steps * d.batch_size * d.seq_len
