"""`specflow run` / `specflow sweep` end to end on a tiny model, and the prompt-suite loaders."""

import json
import re
from pathlib import Path

import pytest

from specflow.bench.prompts import load_suite
from specflow.cli import main
from specflow.models.random import make_random_checkpoint

SPEC_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def write_config(tmp_path, target, pipelines: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(f"""
name: tiny
output_dir: {tmp_path / 'runs'}
engine: {{target: {target}, device: cpu, dtype: float32, kv_cache_tokens: 4096}}
prompts: {{suite: builtin, categories: [code, repetition], per_category: 1}}
sampling: {{temperature: 0.0, max_tokens: 8, ignore_eos: true}}
pipelines:
{pipelines}
""")
    return path


def test_run_writes_results_against_the_same_run_baseline(tmp_path, tiny_target):
    path = write_config(tmp_path, tiny_target, """
  - name: pld
    drafter: {type: ngram, max_window: 3}
    tree: {type: chain, depth: 3}
    verifier: {type: greedy}
  - name: self-eagle2
    drafter: {type: draft_model, path: %s, kv_cache_tokens: 4096}
    tree: {type: eagle2, topk: 2, depth: 3, num_draft_tokens: 6}
    verifier: {type: rejection}""" % tiny_target)
    assert main(["run", str(path), "sampling.max_tokens=6"]) == 0
    out = tmp_path / "runs" / "tiny"
    results = json.loads((out / "results.json").read_text())
    assert set(results["pipelines"]) == {"baseline", "pld", "self-eagle2"}
    for name, stats in results["pipelines"].items():
        assert stats["tokens"] == 2 * 6 and stats["prompts"] == 2
        assert set(stats["categories"]) == {"code", "repetition"}
        assert {"p50", "p90", "p99"} <= set(stats["latency_s"])
        if name != "baseline":
            assert stats["matches_baseline"] == 1.0 and stats["speedup"] > 0
    assert results["pipelines"]["self-eagle2"]["accept_length"] > 1.5  # the target drafting itself
    assert [results["pipelines"][p]["lossless"] for p in ("pld", "self-eagle2")] == [False, True]  # (greedy verifier)
    assert "sampling:\n  temperature: 0.0\n  top_k: -1" in (out / "config.yaml").read_text()
    assert "max_tokens: 6" in (out / "config.yaml").read_text()
    assert "| self-eagle2 | yes |" in (out / "results.md").read_text()
    assert (out / "speedup.png").stat().st_size > 0

    # a sampled run is exact in distribution, not token for token: no token comparison is made
    assert main(["run", str(path), "sampling.max_tokens=3", "sampling.temperature=0.8", "name=sampled"]) == 0
    sampled = json.loads((tmp_path / "runs" / "sampled" / "results.json").read_text())["pipelines"]
    assert not any("matches_baseline" in stats for stats in sampled.values())


def test_sweep_prints_the_best_configuration(tmp_path, tiny_target, capsys):
    path = write_config(tmp_path, tiny_target, """
  - name: chain
    drafter: {type: draft_model, path: %s, kv_cache_tokens: 4096}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""" % tiny_target)
    assert main(["sweep", str(path), "--grid", "tree.depth=1,3", "sampling.max_tokens=5"]) == 0  # (override last)
    printed = capsys.readouterr().out
    assert "best: depth=" in printed
    results = json.loads((tmp_path / "runs" / "tiny-sweep" / "results.json").read_text())
    assert set(results["pipelines"]) == {"baseline", "depth=1", "depth=3"}
    assert results["pipelines"]["depth=3"]["tokens"] == 2 * 5


@pytest.mark.parametrize("grid,message", [
    ("tree=2,3", "--grid 'tree=2,3' must look like tree.topk=2,4"),
    ("tree.depth=2,0", "--grid point depth=0: tree: .*depth must be >= 1"),
    ("verifier.type=greedy,exact", "--grid point type=exact: verifier.type: unknown verifier type 'exact'")])
def test_sweep_checks_every_grid_point_before_the_target_loads(tmp_path, capsys, grid, message):
    path = write_config(tmp_path, "no/such/target", """
  - name: chain
    drafter: {type: ngram}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""")
    assert main(["sweep", str(path), "--grid", grid]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_config_exits_with_a_clear_message(tmp_path, tiny_target, capsys):
    path = write_config(tmp_path, tiny_target, """
  - name: typo
    drafter: {type: ngram, max_windw: 3}
    tree: {type: chain}
    verifier: {type: greedy}""")
    assert main(["run", str(path)]) == 2
    assert "unknown key 'max_windw'; valid keys: min_window, max_window" in capsys.readouterr().err


def test_a_failing_pipeline_keeps_the_finished_ones(tmp_path, tiny_target, capsys):
    other_vocab = make_random_checkpoint(tmp_path / "other", hidden_size=32, num_layers=1, vocab_size=300)
    path = write_config(tmp_path, tiny_target, """
  - name: pld
    drafter: {type: ngram}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}
  - name: wrong-vocab
    drafter: {type: draft_model, path: %s}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""" % other_vocab)
    assert main(["run", str(path)]) == 2
    assert "vocabulary (300) differs" in capsys.readouterr().err
    results = json.loads((tmp_path / "runs" / "tiny" / "results.json").read_text())
    assert set(results["pipelines"]) == {"baseline", "pld"} and results["pipelines"]["pld"]["tokens"] == 2 * 8


def test_question_jsonl_loader():
    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH} not present")
    prompts = load_suite(str(SPEC_BENCH))
    assert len(prompts) == 480
    some = load_suite(str(SPEC_BENCH), categories=["math_reasoning", "translation"], per_category=3)
    assert sorted(p.category for p in some) == ["math_reasoning"] * 3 + ["translation"] * 3
    with pytest.raises(ValueError, match="unknown category 'poetry'; known: "):
        load_suite(str(SPEC_BENCH), categories=["poetry"])
