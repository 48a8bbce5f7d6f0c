"""Fixtures for the native model tests."""

import pytest

from tests.models.tiny_checkpoints import build_hf_model


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """``tiny_checkpoint(variant, **save_pretrained_kwargs) -> (hf_model, path)``."""

    def make(variant: str, **save_kwargs):
        model = build_hf_model(variant)
        path = tmp_path / variant
        model.save_pretrained(path, **save_kwargs)
        return model, path

    return make
