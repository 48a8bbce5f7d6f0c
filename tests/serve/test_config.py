"""configs/serve.yaml and the serve config schema."""

from pathlib import Path

import pytest

from specflow.config import ConfigError, build_component, component_config
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS
from specflow.serve import RequestLimits, load_serve_config

SERVE_YAML = Path(__file__).resolve().parents[2] / "configs" / "serve.yaml"


def test_shipped_serve_config_validates():
    """Every node resolves to a registered component with valid parameters (the checkpoint
    itself, zoo/tiny-code/target, is only read when the server starts)."""
    cfg = load_serve_config(SERVE_YAML)
    assert cfg.name == "tiny-code" and cfg.engine.target == "zoo/tiny-code/target"
    assert cfg.engine.spec_max_batch_size is not None
    component_config(DRAFTERS, cfg.engine.drafter, "engine.drafter")
    build_component(TREE_BUILDERS, cfg.engine.tree, "engine.tree")
    build_component(VERIFIERS, cfg.engine.verifier, "engine.verifier")


def test_request_limits_default_and_override():
    cfg = load_serve_config(SERVE_YAML)
    assert cfg.limits == RequestLimits(max_request_bytes=16 * 2**20, max_sequences=64)
    cfg = load_serve_config(SERVE_YAML, ["limits.max_sequences=8", "limits.max_request_bytes=1024"])
    assert cfg.limits == RequestLimits(max_request_bytes=1024, max_sequences=8)
    with pytest.raises(ConfigError, match="unknown key 'max_body'"):
        load_serve_config(SERVE_YAML, ["limits.max_body=1"])
    with pytest.raises(ConfigError, match="serve.limits: max_request_bytes and max_sequences must be >= 1"):
        load_serve_config(SERVE_YAML, ["limits.max_sequences=0"])


def test_overrides_and_typos():
    cfg = load_serve_config(SERVE_YAML, ["engine.spec_max_batch_size=4", "name=other"])
    assert cfg.engine.spec_max_batch_size == 4 and cfg.name == "other"
    with pytest.raises(ConfigError, match="unknown key 'spec_max_batch'"):
        load_serve_config(SERVE_YAML, ["engine.spec_max_batch=4"])
    with pytest.raises(ConfigError, match="unknown key 'port'"):
        load_serve_config(SERVE_YAML, ["port=80"])
