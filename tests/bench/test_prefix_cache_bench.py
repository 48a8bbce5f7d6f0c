"""bench/prefix_cache.py runs end to end and counts the prompt tokens each engine prefilled; no
speed is asserted."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cached_engine_prefills_the_shared_prompt_once(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", ROOT / "bench" / "prefix_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "prefix.json"
    results = module.main(["--drafter", "none", "--system-tokens", "64", "--max-tokens", "4", "--out", str(out)])
    base, cached = results["baseline"]["prefilled_tokens"], results["prefix_caching"]["prefilled_tokens"]
    # 12 requests of >= 64 system tokens each, against the system prompt once plus what follows it
    assert base >= 12 * 64 and cached < base - 10 * 64
    assert json.loads(out.read_text())["ratios"]["prefilled_tokens"] == cached / base
