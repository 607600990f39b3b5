"""The coordinator's per-round samples: repeatable from (θ, round), drawn from the θ given whatever the shared
model last held, off when `samples.tokens` is 0, and kept in the round history so a restart shows them."""

import json
from pathlib import Path

import torch

from bootstrap.round_keeper import read_history
from bootstrap.samples import SAMPLES_KEPT, RoundSampler, newest_samples
from hetnode.config import Config, SamplesConfig, replace
from hetnode.data.tokenizer import ByteTokenizer
from hetnode.model.decoder import build_model

CONFIG = Config()  # tiny: byte tokens, 4 layers of 128


def sampler(**samples) -> RoundSampler:
    config = replace(CONFIG, "samples", **samples) if samples else CONFIG
    model = build_model(config.model, seed=config.run.seed)
    return RoundSampler(config.samples, config.run.seed, ByteTokenizer(), model)


def theta(seed: int) -> dict[str, torch.Tensor]:
    model = build_model(CONFIG.model, seed=seed)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_round_s_sample_is_repeatable_and_drawn_from_the_theta_given():
    s = sampler(tokens=24)
    first = s.sample(theta(1), round_=7)
    assert first is not None
    assert first["prompt"] == "The history of" and first["seed"] == CONFIG.run.seed + 7
    assert 0 < first["tokens"] <= 24 and first["temperature"] == 0.8 and first["seconds"] >= 0
    with torch.no_grad():  # what the verifier may leave in the shared model
        for p in s.model.parameters():
            p.add_(1.0)
    again = s.sample(theta(1), round_=7)
    assert again is not None and again | {"seconds": 0} == first | {"seconds": 0}
    assert s.sample(theta(1), round_=8)["text"] != first["text"]  # another round, another seed


def test_greedy_samples_do_not_depend_on_the_seed():
    s = sampler(tokens=16, temperature=0.0)
    assert s.sample(theta(2), 1)["text"] == s.sample(theta(2), 2)["text"]


def test_zero_tokens_turns_samples_off():
    s = sampler(tokens=0)
    assert not s.enabled and s.sample(theta(1), 3) is None


def test_newest_samples_survive_a_restart(tmp_path: Path):
    entries = [
        {"round": r, "eval_loss": 5.0 - r, "sample": None if r % 3 == 0 else {"prompt": "p", "text": f"t{r}"}}
        for r in range(40)
    ]
    entries.append({"round": 40, "eval_loss": 1.0})  # from before samples existed: no key at all
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    samples = newest_samples(read_history(tmp_path))
    assert len(samples) == SAMPLES_KEPT
    assert samples[0] == {"round": 38, "prompt": "p", "text": "t38"} and samples[1]["round"] == 37
    assert all(s["round"] % 3 for s in samples)
    assert [s["round"] for s in newest_samples(entries, 2)] == [38, 37]


def test_default_config_samples():
    assert SamplesConfig().tokens > 0 and sampler().enabled
