"""A real speculative server subprocess on loopback for the whole package (API key on), serving
the tiny random target with a chat template added.

Server tests carry ``xdist_group("serve")``: under ``pytest -n N --dist loadgroup`` they share
one worker, hence one server."""

import json
import shutil

import pytest

# the whole package skips without the serve extra (the GPU machine's image has none of it)
REASON = "the serve extra is not installed: pip install 'specflow[serve]'"
pytest.importorskip("fastapi", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)

from tests.serve.server import ServerProcess, write_serve_config  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny-chat"
# renders tool calls (arguments a mapping, as transformers has them) and refuses two in one turn,
# as some real templates do
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}{% if m['name'] is defined %}:{{ m['name'] }}{% endif %}|>"
                 "{% if m['tool_call_id'] is defined %}[{{ m['tool_call_id'] }}]{% endif %}{{ m['content'] }}"
                 "{% if m['tool_calls'] is defined %}{% if m['tool_calls'] | length > 1 %}"
                 "{{ raise_exception('this model makes one tool call per turn') }}{% endif %}"
                 "{% for c in m['tool_calls'] %}[{{ c['id'] }}]{{ c['function']['name'] }}"
                 "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Small on purpose: 32 requests of ~10 prompt + 24 new + 6 draft tokens need ~1300 slots at once,
# so most of them wait in the queue for pages.
KV_CACHE_TOKENS = 512
NUM_DRAFT_TOKENS = 6
MAX_SEQUENCES = 8
MAX_REQUEST_BYTES = 2**21


@pytest.fixture(scope="package")
def chat_target(tiny_target, tmp_path_factory):
    """A copy of ``tiny_target`` whose tokenizer has a (tiny) chat template."""
    path = tmp_path_factory.mktemp("tiny-chat") / "target"
    shutil.copytree(tiny_target, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="package")
def server(chat_target, tmp_path_factory):
    """The target drafts for itself (a draft model that always agrees at temperature 0), so
    speculative steps commit several tokens; API key on; a small KV cache; small request limits;
    prefix caching on, as configs/serve.yaml has it."""
    config = write_serve_config(
        tmp_path_factory.mktemp("serve") / "speculative.yaml", MODEL,
        limits={"max_sequences": MAX_SEQUENCES, "max_request_bytes": MAX_REQUEST_BYTES}, target=str(chat_target),
        drafter={"type": "draft_model", "path": str(chat_target)},
        tree={"type": "eagle2", "topk": 2, "depth": 3, "num_draft_tokens": NUM_DRAFT_TOKENS},
        verifier={"type": "rejection"}, kv_cache_tokens=KV_CACHE_TOKENS, spec_max_batch_size=8, prefix_caching=True)
    proc = ServerProcess(config, "--api-key", API_KEY).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
