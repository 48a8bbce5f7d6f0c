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


def test_the_shipped_model_renders_chats_and_tool_calls_the_server_parses():
    """zoo/tiny-code's tokenizer has a chat template (a chat as Python comments, for a code model)
    that renders tools, an assistant's tool call in the Hermes form the server parses, and the
    tool's result; the chat endpoint serves it."""
    from fastapi.testclient import TestClient

    from specflow import SpecEngine
    from specflow.serve import build_app
    from specflow.serve.tool_parser import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "Add 1 and 2."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    engine = SpecEngine(SERVE_YAML.parents[1] / "zoo" / "tiny-code" / "target", {"type": "ngram"}, {"type": "chain"},
                        device="cpu", dtype="float32", kv_cache_tokens=1024)
    with TestClient(build_app(engine, "tiny-code")) as client:
        response = client.post("/v1/chat/completions", json={
            "model": "tiny-code", "messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    # the server passes arguments to the template as a mapping, as transformers and vLLM do
    rendered = engine.tokenizer.apply_chat_template(
        [*messages[:1], {**messages[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
         messages[2]], tools=tools, tokenize=False, add_generation_prompt=True)
    lines = rendered.split("\n")
    assert lines[0] == '# tools: [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]'
    assert lines[1:] == ["# user: Add 1 and 2.", '# assistant: <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                         "</tool_call>", "# tool [call_1]: 3", "# assistant:", ""]
    parsed = parse_tool_calls(lines[2].removeprefix("# assistant: "))
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    assert response.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
    # in library use, messages the server would refuse still render (no id, no content)
    assert engine.tokenizer.apply_chat_template(
        [{"role": "assistant", "content": None, "tool_calls": None}, {"role": "tool", "content": None}],
        tokenize=False) == "# assistant: \n# tool []: \n"
