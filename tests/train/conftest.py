"""A tiny *trained* target for the head recipes: a random target's next token is a chaotic
function of its context that no small head learns in seconds; a briefly trained one is not."""

import pytest

from specflow.train import train
from tests.train.runs import tiny_config


@pytest.fixture(scope="session")
def trained_target(tmp_path_factory, tiny_target):
    """A 2-layer Llama (vocab 320) trained for 60 steps on two stdlib files."""
    tmp = tmp_path_factory.mktemp("trained-target")
    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
    train(tiny_config(tmp, {"type": "lm", "tokenizer": str(tiny_target), "model": model}, steps=60, lr=1e-2))
    return tmp / "out"
