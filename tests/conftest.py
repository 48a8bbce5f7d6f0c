"""Shared fixtures: tiny random-weight targets written to disk as real HF checkpoints."""

import pytest

from specflow.models.random import make_random_checkpoint


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 2-layer Llama with a BPE tokenizer; large init so greedy argmaxes are far from ties."""
    path = tmp_path_factory.mktemp("tiny-target")
    return make_random_checkpoint(path, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                  vocab_size=320, initializer_range=0.3, seed=0)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread per test process: on small shared CPUs, thread contention makes tiny
    kernels many times slower (pytest -n 2 already uses both cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target):
    """A differently seeded random model with the target's vocabulary (a poor but valid drafter)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    return make_random_checkpoint(path, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  vocab_size=320, initializer_range=0.3, seed=1, tokenizer=False)
