"""`hetnode bootstrap --device`: the verifier's forwards on a device decide as on CPU.

DEVICE is cuda where this torch can run it, else cpu: on a CPU machine these tests check the CPU path and
that the device is threaded through; the same tests on a GPU machine check the CUDA path (bf16 autocast)
against CPU fp32. bf16's effect on the decisions is also checked on CPU, under CPU bf16 autocast (the
rounding of weights and activations to bf16 is what moves a score, whichever kernels run it)."""

from __future__ import annotations

import pytest
import torch

from bootstrap.device_forwards import dense_on, forward_model, model_device
from bootstrap.verifier import Replica, Verifier
from hetnode.algo.scoring import dense_update
from hetnode.config import replace
from hetnode.daemon.faults.factory import faults_named
from hetnode.daemon.rounds import AnchorTraining
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.planning.rounds import data_slot
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HONEST = ["honest-a", "honest-b", "honest-c"]
FAULTS = {"noise-x": "noise", "signflip-x": "signflip", "freerider-x": "freerider"}
SECRET = bytes(16)  # both verifiers draw the same replicas and batches
# How far a score may move with the precision of the forwards: CPU bf16 autocast against fp32 moved tiny's
# scores by at most 0.0045 over four secrets' draws, the nearest to 0 being 0.074 (a noise payload's)
SCORE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def round_(tiny_config):
    config = replace(tiny_config, "outer", inner_steps=4)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    model.requires_grad_(False)
    theta = GlobalModel(config)
    peers = {p: None for p in HONEST} | FAULTS
    trainers = {p: AnchorTraining(config, dataset, p, faults=faults_named(f)) for p, f in peers.items()}
    payloads = {p: training.run_round(0, theta) for p, training in trainers.items()}
    contributions = [(p, theta.decode_contribution(p, 0, payloads[p])) for p in peers]
    replicas = {p: Replica(p, data_slot(p)) for p in peers}
    return config, dataset, model, theta, contributions, replicas


def scores_of(verifier: Verifier, theta: GlobalModel, contributions, replicas) -> dict[str, float]:
    return verifier.score(0, theta.params, contributions, replicas)


def assert_same_decisions(scores: dict[str, float], reference: dict[str, float]) -> None:
    assert set(scores) == set(reference)
    for peer in HONEST:
        assert scores[peer] > 0 and reference[peer] > 0, (scores, reference)
    for peer in FAULTS:
        assert scores[peer] < 0 and reference[peer] < 0, (scores, reference)
    worst = max(abs(scores[p] - reference[p]) for p in reference)
    assert worst <= SCORE_TOLERANCE, (worst, scores, reference)


def test_scores_on_the_device_decide_as_on_cpu(round_):
    config, dataset, model, theta, contributions, replicas = round_
    on_device = forward_model(model, DEVICE)
    assert model_device(on_device) == DEVICE and model_device(model).type == "cpu"
    device_verifier = Verifier(config, dataset, on_device, secret=SECRET)
    assert device_verifier.device == DEVICE
    cpu_verifier = Verifier(config, dataset, model, secret=SECRET)
    reference = scores_of(cpu_verifier, theta, contributions, replicas)
    scores = scores_of(device_verifier, theta, contributions, replicas)
    if DEVICE.type == "cpu":
        assert scores == reference  # the CPU path is the reference, bit for bit
    assert_same_decisions(scores, reference)
    # θ is read, never written: its digests are the seal's still
    assert theta.digests() == GlobalModel(config).digests()
    # the rescue at seal time runs on the device too, and passes the same replicas (against the yardstick
    # of the round each scored)
    alone = [(p, d) for p, d in contributions if p in ("honest-b", "noise-x", "signflip-x")]
    assert device_verifier.helps(0, theta.params, alone, replicas) == {"honest-b"}
    assert cpu_verifier.helps(0, theta.params, alone, replicas) == {"honest-b"}


def test_bf16_forwards_move_scores_by_float_noise_only(round_):
    """What CUDA's autocast does to a score, measured where every machine can: CPU bf16 autocast."""
    config, dataset, model, theta, contributions, replicas = round_
    reference = scores_of(Verifier(config, dataset, model, secret=SECRET), theta, contributions, replicas)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = scores_of(Verifier(config, dataset, model, secret=SECRET), theta, contributions, replicas)
    assert lowered != reference  # the forwards did run in bf16
    assert_same_decisions(lowered, reference)


def test_a_dense_update_made_on_the_device_holds_the_same_values(round_):
    _, _, model, theta, contributions, _ = round_
    shapes = {name: tuple(t.shape) for name, t in theta.params.items()}
    update = {name: values for message in contributions[0][1] for name, values in message.sparse.items()}
    expected = dense_update(update, shapes)
    made = dense_on(update, shapes, DEVICE)
    assert set(made) == set(expected)
    for name, tensor in made.items():
        assert tensor.device.type == DEVICE.type and torch.equal(tensor.cpu(), expected[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU this torch can run")
def test_the_model_on_cuda_holds_every_tensor_there_and_shares_none_with_the_cpu_one(round_):
    _, _, model, _, _, _ = round_
    copy = forward_model(model, "cuda")
    assert copy is not model and copy.fixed_embedding.is_cuda
    assert all(t.is_cuda for t in [*copy.parameters(), *copy.buffers()])
    for (name, p), q in zip(model.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(p, q.cpu()), name
    assert forward_model(model, "cpu") is model
