"""Fixtures of the coordinator's tests."""

import pytest

from hetnode.config import replace
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import build_model
from hetnode.replica.global_model import base_fixed_embedding


@pytest.fixture(scope="module")
def verifier_parts(tiny_config):
    """tiny at H = 4, its data and the model a verifier scores with: (config, dataset, model)."""
    config = replace(tiny_config, "outer", inner_steps=4)
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)
    model = build_model(config.model, seed=config.run.seed)
    model.fixed_embedding = base_fixed_embedding(config)
    return config, dataset, model
