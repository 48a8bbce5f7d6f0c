"""`specflow run` / `specflow sweep` end to end on a tiny model, and the prompt-suite loaders."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from specflow.bench import experiment
from specflow.bench.experiment import context_cuts, run_pipeline, warmup_batch_sizes
from specflow.bench.summary import acceptance_by_depth, summarize
from specflow.bench.experiment_config import (ExperimentConfig, PipelineConfig, SamplingConfig, load_experiment,
                                              sampling_params)
from specflow.bench.prompts import load_suite
from specflow.bench.provenance import device_name
from specflow.bench.sweep import grid_pipelines, parse_grid, run_sweep
from specflow.cli import main
from specflow.config import ConfigError
from specflow.engine import SpecEngine
from specflow.sampling import SamplingParams
from specflow.spec_step import tried_depth
from specflow.tree import DraftTree, Verdict
from specflow.models.random import make_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def ngram_chain(name: str = "chain", verifier: str = "greedy") -> str:
    """The pipelines of an experiment (write_config's): one n-gram drafter over a chain of 2."""
    return f"""
  - name: {name}
    drafter: {{type: ngram}}
    tree: {{type: chain, depth: 2}}
    verifier: {{type: {verifier}}}"""


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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_results_against_the_same_run_baseline(tmp_path, tiny_target):
    path = write_config(tmp_path, tiny_target, """
  - name: pld
    drafter: {type: ngram, max_window: 3}
    tree: {type: chain, depth: 3}
    verifier: {type: typical}
  - name: self-eagle2
    drafter: {type: draft_model, path: %s, kv_cache_tokens: 4096}
    tree: {type: eagle2, topk: 2, depth: 3, num_draft_tokens: 64}
    verifier: {type: rejection}""" % tiny_target)
    assert main(["run", str(path), "sampling.max_tokens=6", "engine.record_steps=true"]) == 0
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
    assert [results["pipelines"][p]["lossless"] for p in ("pld", "self-eagle2")] == [False, True]
    # the nodes the trees have: eagle2 caps 64 at what topk 2, depth 3 drafts (1 + 2 + 2 * 4)
    assert [results["pipelines"][p]["num_draft_tokens"] for p in ("pld", "self-eagle2")] == [4, 11]
    assert results["sampling"]["max_tokens"] == 6 and results["torch_version"] == torch.__version__
    # the CPU's model, not only "cpu": the times are of that hardware
    assert results["device"] == "cpu" and results["device_name"] == device_name(torch.device("cpu")) != ""
    assert f"on cpu ({results['device_name']}, float32)" in (out / "results.md").read_text()
    if (ROOT / ".git").exists():  # a commit of this checkout (HEAD may have moved on since)
        commit = results["git_commit"]
        assert re.fullmatch("[0-9a-f]{40}", commit)
        assert subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"]).returncode == 0
    else:
        assert results["git_commit"] is None
    assert "sampling:\n  temperature: 0.0\n  top_k: -1" in (out / "config.yaml").read_text()
    assert "max_tokens: 6" in (out / "config.yaml").read_text()
    assert "| self-eagle2 | yes |" in (out / "results.md").read_text()
    per_prompt = {p: results["pipelines"][p]["speedup_mean_per_prompt"] for p in ("pld", "self-eagle2")}
    assert (f"Spec-Bench's speedup (the mean of per-prompt tokens/s over the baseline's; the table's is total tokens "
            f"over total time, each side): pld {per_prompt['pld']:.2f}x, self-eagle2 {per_prompt['self-eagle2']:.2f}x."
            in (out / "results.md").read_text())
    assert (out / "speedup.png").stat().st_size > 0

    # every prompt's row, and with engine.record_steps every step of every request
    rows = read_jsonl(out / "rows.jsonl")
    assert [(r["pipeline"], r["batch"]) for r in rows] == [(p, b) for p in ("baseline", "pld", "self-eagle2")
                                                          for b in (0, 1)]
    assert set(rows[0]) == {"pipeline", "id", "category", "turn", "prompt_tokens", "tokens", "token_ids", "max_tokens",
                            "steps", "accept_lengths", "tried_depths", "seconds", "batch"}
    # each prompt's output ids, so a reader can check a lossless pipeline prompt by prompt
    outputs = {(r["pipeline"], r["id"]): r["token_ids"] for r in rows}
    assert all(len(r["token_ids"]) == r["tokens"] for r in rows)
    assert all(outputs["self-eagle2", r["id"]] == r["token_ids"] for r in rows if r["pipeline"] == "baseline")
    steps = read_jsonl(out / "steps.jsonl")
    for r in rows:
        mine = [s for s in steps if (s["pipeline"], s["id"]) == (r["pipeline"], r["id"])]
        assert len(mine) == r["steps"] and all(len(s["accepted"]) >= 1 for s in mine)
        # each step's tried depth: its accepted drafts, + 1 where the last accepted node has children
        assert r["tried_depths"] == [len(s["accepted"]) - 1 + any(ok and parent == s["accepted"][-1] for parent, ok
                                                                  in zip(s["tree"]["parents"], s["tree"]["valid"]))
                                     for s in mine]
    assert {d for r in rows if r["pipeline"] == "baseline" for d in r["tried_depths"]} == {0}
    assert max(d for r in rows if r["pipeline"] == "self-eagle2" for d in r["tried_depths"]) == 3
    assert {"tree", "bonus_token", "timings"} <= set(steps[-1])

    # a sampled run matches the seeded baseline where the verifier follows the target's draws
    # (rejection over the eagle2 tree's top-k drafts). Batched, tokens/s counts each batch's wall time once; its one batch holds both categories,
    # so they are not timed apart
    assert main(["run", str(path), "sampling.max_tokens=3", "sampling.temperature=0.8", "name=sampled",
                 "batch_size=2"]) == 0
    sampled = json.loads((tmp_path / "runs" / "sampled" / "results.json").read_text())["pipelines"]
    assert sampled["self-eagle2"]["matches_baseline"] == 1.0 and "matches_baseline" in sampled["pld"]
    rows = read_jsonl(tmp_path / "runs" / "sampled" / "rows.jsonl")
    assert {r["batch"] for r in rows} == {0} and not (tmp_path / "runs" / "sampled" / "steps.jsonl").exists()
    for name, stats in sampled.items():
        (seconds,) = {r["seconds"] for r in rows if r["pipeline"] == name}
        assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / seconds)
        assert all("tokens_per_s" not in c and "speedup" not in c and c["accept_length"] >= 1
                   for c in stats["categories"].values())
    report = (tmp_path / "runs" / "sampled" / "results.md").read_text()
    assert "Spec-Bench's speedup" not in report   # (two prompts a batch: no prompt's own time)
    assert re.search(r"\| pld \| \d\.\d\d / - \| \d\.\d\d / - \|", report)
    assert '"-": the category shares its batches with other categories' in report


def test_tokens_per_s_counts_each_batch_once():
    def rows(seconds: tuple[float, float]) -> list[dict]:  # batch 0 holds two code prompts, batch 1 two others
        return [{"id": str(i), "category": cat, "batch": i // 2, "seconds": seconds[i // 2], "tokens": 10,
                 "steps": 5, "step_tokens": 10, "accept_lengths": [2] * 5, "tried_depths": [2] * 5,
                 "token_ids": [i] * 10} for i, cat in enumerate(["code", "code", "math", "chat"])]

    summary = summarize(rows((1.0, 2.0)), rows((2.0, 4.0)))
    assert summary["tokens_per_s"] == pytest.approx(40 / 3) and summary["speedup"] == pytest.approx(2.0)
    code, math = summary["categories"]["code"], summary["categories"]["math"]
    assert code["tokens_per_s"] == pytest.approx(20 / 1) and code["speedup"] == pytest.approx(2.0)
    # math shares its batch with chat: accept length, but no time of its own
    assert math == {"prompts": 1, "tokens": 10, "accept_length": 2.0, "matches_baseline": 1.0}


def test_speedup_mean_per_prompt_is_spec_bench_s_ratio_of_mean_per_prompt_tokens_per_s():
    """``speedup`` is total tokens over total time, each side; Spec-Bench divides the mean of the
    per-prompt tokens/s instead, which weighs a short, fast prompt as much as a long one."""
    def rows(seconds: tuple[float, float]) -> list[dict]:  # one prompt a batch
        return [{"id": str(i), "category": "code", "batch": i, "seconds": seconds[i], "tokens": 10, "steps": 5,
                 "step_tokens": 10, "accept_lengths": [2] * 5, "tried_depths": [2] * 5, "token_ids": [i] * 10}
                for i in range(2)]

    summary = summarize(rows((1.0, 4.0)), rows((2.0, 5.0)))
    assert summary["speedup"] == pytest.approx((20 / 5) / (20 / 7))
    assert summary["speedup_mean_per_prompt"] == pytest.approx(((10 + 2.5) / 2) / ((5 + 2) / 2))
    assert summary["categories"]["code"]["speedup_mean_per_prompt"] == summary["speedup_mean_per_prompt"]
    batched = [dict(r, batch=0) for r in rows((4.0, 4.0))]  # a batch's prompts share its time: no per-prompt time
    assert "speedup_mean_per_prompt" not in summarize(batched, [dict(r, batch=0) for r in rows((5.0, 5.0))])


def test_acceptance_by_depth_leaves_out_each_prompt_s_last_step():
    """A prompt's last step keeps only the tokens up to max_tokens or a stop: its drafts cut
    there are no rejections (EAGLE's rates would read low at short max_tokens)."""
    rows = [{"id": str(i), "category": "code", "batch": i, "seconds": 1.0, "tokens": 10, "steps": 3,
             "step_tokens": 10, "accept_lengths": [4, 4, 2], "tried_depths": [3, 3, 2], "token_ids": [i] * 10}
            for i in range(2)]
    assert summarize(rows, None)["acceptance_by_depth"] == [1.0, 1.0, 1.0]


def test_warmup_never_shows_a_drafter_a_suite_prompt(tmp_path, tiny_target):
    """A drafter that learns across requests (a global n-gram trie) must not have seen a timed
    prompt's continuation in the warm-up: warming up changes no accept length."""
    path = write_config(tmp_path, tiny_target, """
  - name: global
    drafter: {type: ngram, scope: global, max_window: 4}
    tree: {type: chain, depth: 5}
    verifier: {type: greedy}""")
    accept = {}
    for warmup in (0, 1):
        assert main(["run", str(path), f"warmup={warmup}", f"name=w{warmup}", "prompts.categories=[code]",
                     "sampling.max_tokens=16"]) == 0
        results = json.loads((tmp_path / "runs" / f"w{warmup}" / "results.json").read_text())
        accept[warmup] = results["pipelines"]["global"]["accept_length"]
    assert accept[1] == accept[0]


def test_repeats_time_fresh_engines_in_rounds_and_keep_each_batch_fastest_run(tmp_path, tiny_target, monkeypatch):
    """Every run has its own engine (a drafter that learns across requests, which would speed
    up later runs, starts over); the runs go in rounds of the baseline then every pipeline (a
    drift of the machine's speed falls on all alike); every pipeline records each run's seconds,
    and tokens/s takes each batch's fastest run."""
    import specflow.bench.experiment as experiment

    engines, order = [], []

    class Counted(experiment.SpecEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    run_pipeline = experiment.run_pipeline
    monkeypatch.setattr(experiment, "SpecEngine", Counted)
    monkeypatch.setattr(experiment, "run_pipeline", lambda e, p, c, name: order.append(name) or run_pipeline(e, p, c, name))
    path = write_config(tmp_path, tiny_target, """
  - name: global
    drafter: {type: ngram, scope: global, max_window: 4}
    tree: {type: chain, depth: 5}
    verifier: {type: greedy}""")
    assert main(["run", str(path), "repeats=3", "prompts.categories=[code]", "sampling.max_tokens=16"]) == 0
    assert len(engines) == 2 * 3 and len(set(map(id, engines))) == 6   # baseline and pipeline, 3 runs each
    assert order == ["baseline", "global"] * 3
    results = json.loads((tmp_path / "runs" / "tiny" / "results.json").read_text())
    for s in results["pipelines"].values():
        assert len(s["run_seconds"]) == 3
        # each batch's fastest run: at most the fastest whole run
        assert s["tokens"] / s["tokens_per_s"] <= min(s["run_seconds"]) * (1 + 1e-9)
    assert "best of 3 runs" in (tmp_path / "runs" / "tiny" / "results.md").read_text()


def test_run_seconds_hold_each_run_s_own_time(tmp_path, tiny_target, monkeypatch):
    """``run_seconds`` lists every run's own wall time; tokens/s takes each batch's fastest run,
    a composite that must not replace the last run's entry."""
    import specflow.bench.experiment as experiment

    # batch seconds of the runs in order: baseline, pipeline (round 1), baseline, pipeline (round 2)
    times = iter([(1.0, 4.0), (2.0, 2.0), (3.0, 2.0), (1.0, 3.0)])

    def timed_rows(engine, prompts, cfg, name):
        t = next(times)
        return [{"id": p.id, "category": p.category, "turn": 1, "batch": i, "seconds": t[i], "prompt_tokens": 4,
                 "tokens": 4, "max_tokens": 8, "steps": 3, "step_tokens": 3, "accept_lengths": [1] * 3,
                 "tried_depths": [0] * 3, "token_ids": [0] * 4, "step_records": []}
                for i, p in enumerate(prompts)]

    monkeypatch.setattr(experiment, "run_pipeline", timed_rows)
    path = write_config(tmp_path, tiny_target, ngram_chain("p"))
    assert main(["run", str(path), "repeats=2"]) == 0
    results = json.loads((tmp_path / "runs" / "tiny" / "results.json").read_text())["pipelines"]
    assert results["baseline"]["run_seconds"] == [5.0, 5.0] and results["p"]["run_seconds"] == [4.0, 4.0]
    assert results["baseline"]["tokens_per_s"] == pytest.approx(8 / (1.0 + 2.0))   # each batch's fastest
    assert results["p"]["tokens_per_s"] == pytest.approx(8 / (1.0 + 2.0))


def test_repeats_hold_one_run_of_step_records_at_a_time(tmp_path, tiny_target, monkeypatch):
    """With engine.record_steps and repeats, a run's step records (the trees of a whole suite)
    are written and dropped before the next run starts: rounds of every pipeline do not hold
    each pipeline's trees until the last round; steps.jsonl holds one run's steps a pipeline."""
    import specflow.bench.experiment as experiment

    returned, held = [], []
    run_pipeline = experiment.run_pipeline

    def counted(e, p, c, name):
        held.append(sum("step_records" in rows[0] for rows in returned))  # runs whose trees are still held
        returned.append(run_pipeline(e, p, c, name))
        return returned[-1]

    monkeypatch.setattr(experiment, "run_pipeline", counted)
    path = write_config(tmp_path, tiny_target, """
  - name: a
    drafter: {type: ngram, max_window: 3}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}
  - name: b
    drafter: {type: ngram, max_window: 3}
    tree: {type: chain, depth: 3}
    verifier: {type: greedy}""")
    assert main(["run", str(path), "repeats=2", "prompts.categories=[code]", "sampling.max_tokens=6",
                 "engine.record_steps=true"]) == 0
    assert held == [0] * 6
    out = tmp_path / "runs" / "tiny"
    rows, steps = read_jsonl(out / "rows.jsonl"), read_jsonl(out / "steps.jsonl")
    assert [r["pipeline"] for r in rows] == ["baseline", "a", "b"]
    for r in rows:  # one run's steps each, those of the run whose rows are written
        assert len([s for s in steps if s["pipeline"] == r["pipeline"]]) == r["steps"]


def test_sweep_saves_the_best_finished_point(tmp_path, tiny_target, capsys, monkeypatch):
    ran = []   # the runs' progress labels
    monkeypatch.setattr(experiment, "run_pipeline", lambda engine, prompts, cfg, desc:
                        ran.append(desc) or run_pipeline(engine, prompts, cfg, desc))
    other_vocab = make_random_checkpoint(tmp_path / "other", hidden_size=32, num_layers=1, vocab_size=300)
    path = write_config(tmp_path, tiny_target, """
  - name: chain
    drafter: {type: draft_model, path: %s, kv_cache_tokens: 4096}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""" % tiny_target)
    # (override last); the other-vocabulary points fail, the sweep goes on and ranks the rest
    with pytest.raises(SystemExit, match=r"specflow sweep: error: 2 pipeline\(s\) failed: depth=1,path=\S+other "
                                         r"\(CheckpointError: draft model vocabulary \(300\) differs"):
        main(["sweep", str(path), "--grid", "tree.depth=1,3", "--grid", f"drafter.path={tiny_target},{other_vocab}",
              "sampling.max_tokens=5"])
    out = tmp_path / "runs" / "tiny-sweep"
    results = json.loads((out / "results.json").read_text())
    assert len(results["pipelines"]) == 5 and results["pipelines"][f"depth=3,path={tiny_target}"]["tokens"] == 2 * 5
    best = results["best"]
    assert best in (f"depth=1,path={tiny_target}", f"depth=3,path={tiny_target}")
    # measured again in rounds of its own, after the pick: the best of noisy speedups overstates its own
    assert ran == ["baseline", f"depth=1,path={tiny_target}", f"depth=3,path={tiny_target}",
                   "baseline (confirming)", f"{best} (confirming)"]
    again = results["best_confirmed"]
    assert again["pipeline"] == best and again["speedup"] > 0 and again["tokens_per_s"] > 0
    assert again["baseline_tokens_per_s"] == pytest.approx(again["tokens_per_s"] / again["speedup"])
    assert f"best: {best}  (speedup" in capsys.readouterr().out
    assert (f"## Best\n\n`{best}`: speedup {results['pipelines'][best]['speedup']:.2f}x, accept length "
            f"{results['pipelines'][best]['accept_length']:.2f}; {again['speedup']:.2f}x in fresh rounds"
            in (out / "results.md").read_text())


def test_sweep_over_batch_size_and_temperature_runs_a_baseline_per_point(tmp_path, tiny_target, capsys):
    path = write_config(tmp_path, tiny_target, ngram_chain(verifier="rejection"))
    out = tmp_path / "runs" / "tiny-sweep"
    out.mkdir(parents=True)
    (out / "results.md").write_text("a sweep without run points wrote this")
    main(["sweep", str(path), "--grid", "batch_size=1,2", "--grid", "sampling.temperature=0,0.8",
          "--grid", "tree.depth=1,3"])
    printed = capsys.readouterr().out
    assert not (out / "results.md").exists()   # (it would sit beside sweep.md as if it were this sweep's)
    names = ["batch_size=1,temperature=0", "batch_size=1,temperature=0.8",
             "batch_size=2,temperature=0", "batch_size=2,temperature=0.8"]
    points = json.loads((out / "sweep.json").read_text())["points"]
    assert list(points) == names
    for name, point in points.items():
        results = json.loads((out / name / "results.json").read_text())
        assert point["results"] == results and results["best"] in ("depth=1", "depth=3")
        assert point["settings"] == {"batch_size": results["batch_size"],
                                     "sampling.temperature": results["sampling"]["temperature"]}
        assert sorted(results["pipelines"]) == ["baseline", "depth=1", "depth=3"]
        rows = read_jsonl(out / name / "rows.jsonl")
        assert {r["batch"] for r in rows} == ({0, 1} if results["batch_size"] == 1 else {0})
        assert f"best at {name}: {results['best']}  (speedup" in printed
    table = (out / "sweep.md").read_text().splitlines()
    assert sum(line.startswith("| 2 | 0.8 | depth=") for line in table) == 2
    assert "| pipeline | lossless | accept length | tokens/s | speedup | matches baseline |" in table[4]
    greedy = [line.split(" | ") for line in table if line.startswith("| 1 | 0 | depth=")]  # rejection at T = 0
    assert len(greedy) == 2 and all(cells[3] == "yes" and cells[7] == "100%" for cells in greedy), greedy
    assert sum(re.search(r" \* \|.*\| \d+\.\d\dx \(\d+\.\d\dx fresh\) \|", line) is not None
               for line in table) == 4  # one best per run point, measured again
    main(["sweep", str(path), "--grid", "tree.depth=1,3", "sampling.max_tokens=3"])   # and back: one run
    assert (out / "results.md").exists() and not (out / "sweep.md").exists()


def test_a_run_point_of_null_reaches_the_engine_as_null(tmp_path, tiny_target):
    """(a run point became the override text ``engine.spec_max_batch_size=None``: the string 'None')"""
    path = write_config(tmp_path, tiny_target, ngram_chain())
    run_sweep(path, ["engine.spec_max_batch_size=null,0", "sampling.max_tokens=2"])
    out = tmp_path / "runs" / "tiny-sweep"
    configs = [yaml.safe_load((out / f"spec_max_batch_size={v},max_tokens=2" / "config.yaml").read_text()) for v in ("None", 0)]
    assert [c["engine"]["spec_max_batch_size"] for c in configs] == [None, 0]
    # one pipeline point: no pick, so no rounds to confirm it
    assert "best_confirmed" not in json.loads((out / "spec_max_batch_size=0,max_tokens=2" / "results.json").read_text())


def test_parse_grid_refuses_a_point_given_twice():
    assert parse_grid(["tree.depth=3,5", "drafter.max_window=2"]) == {"tree.depth": [3, 5], "drafter.max_window": [2]}
    with pytest.raises(ConfigError, match="--grid tree.depth: a value is repeated in '3,3.0'"):
        parse_grid(["tree.depth=3,3.0"])
    with pytest.raises(ConfigError, match="--grid tree.depth is given twice"):
        parse_grid(["tree.depth=3", "tree.depth=5"])
    # values read as overrides' are: booleans and null are not text
    assert parse_grid(["tree.sample=true,false", "engine.spec_max_batch_size=null,4", "sampling.min_p=1e-3,0.5"]) == {
        "tree.sample": [True, False], "engine.spec_max_batch_size": [None, 4], "sampling.min_p": [0.001, 0.5]}


@pytest.mark.parametrize("override, grid", [("pipelines.0.tree.depth=4", "tree.depth=3,5"),
                                            ("sampling.temperature=0.5", "sampling.temperature=0,0.7")])
def test_a_key_both_overridden_and_swept_is_refused(tmp_path, override, grid):
    """(the grid's values silently replaced the override's)"""
    path = write_config(tmp_path, "no/such/target", ngram_chain())
    with pytest.raises(ConfigError, match=f"sweep: {override.partition('=')[0]} is both an override and a --grid key"):
        run_sweep(path, [grid], [override])


def test_point_names_keep_the_section_of_keys_that_end_alike():
    base = PipelineConfig("p", {"type": "ngram"}, {"type": "chain", "depth": 3}, {"type": "greedy"})
    points = grid_pipelines(base, parse_grid(["tree.type=static", "verifier.type=greedy", "tree.preset=medusa_63"]))
    assert [p.name for p in points] == ["tree.type=static,verifier.type=greedy,preset=medusa_63"]


def test_grid_keys_reach_nested_nodes():
    base = PipelineConfig("u", {"type": "union", "drafters": [{"type": "ngram"}, {"type": "ngram", "scope": "global"}]},
                          {"type": "chain"}, {"type": "greedy"})
    points = grid_pipelines(base, parse_grid(["drafter.drafters.1.max_window=2,4"]))
    assert [p.drafter["drafters"][1] for p in points] == [{"type": "ngram", "scope": "global", "max_window": w}
                                                          for w in (2, 4)]
    assert base.drafter["drafters"][1] == {"type": "ngram", "scope": "global"}
    with pytest.raises(ConfigError, match="--grid drafter.drafters.5.max_window: the pipeline has no "
                                          "drafter.drafters.5 node"):
        grid_pipelines(base, parse_grid(["drafter.drafters.5.max_window=2"]))


@pytest.mark.parametrize("grid,message", [
    ("tree=2,3", "--grid 'tree=2,3' must look like tree.topk=2,4"),
    ("prompts.per_category=1,2", "--grid 'prompts.per_category=1,2' must look like tree.topk=2,4"),
    ("batch_size=0,1", "--grid point batch_size=0: batch_size and repeats must be >= 1"),
    ("sampling.top_p=1,2", "--grid point top_p=2: sampling: .*top_p"),
    ("tree.depth=3,3", "--grid tree.depth: a value is repeated in '3,3'"),
    ("tree.depth=2,0", "--grid point depth=0: tree: .*depth must be >= 1"),
    ("verifier.type=greedy,exact", "--grid point type=exact: verifier.type: unknown verifier type 'exact'")])
def test_sweep_checks_every_grid_point_before_the_target_loads(tmp_path, capsys, grid, message):
    path = write_config(tmp_path, "no/such/target", ngram_chain())
    assert main(["sweep", str(path), "--grid", grid]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_sweep_blames_a_bad_override_on_the_override_not_a_grid_point(tmp_path, capsys):
    path = write_config(tmp_path, "no/such/target", ngram_chain())
    assert main(["sweep", str(path), "--grid", "tree.depth=2,3", "sampling.max_tokns=4"]) == 2
    err = capsys.readouterr().err
    assert "experiment.sampling: unknown key 'max_tokns'" in err and "--grid point" not in err


def test_bad_config_exits_with_a_clear_message(tmp_path, tiny_target, capsys):
    path = write_config(tmp_path, tiny_target, """
  - name: typo
    drafter: {type: ngram, max_windw: 3}
    tree: {type: chain}
    verifier: {type: greedy}""")
    assert main(["run", str(path)]) == 2
    assert "unknown key 'max_windw'; valid keys: min_window, max_window" in capsys.readouterr().err
    path = write_config(tmp_path, tmp_path / "nowhere", """
  - name: pld
    drafter: {type: ngram}""")
    assert main(["run", str(path)]) == 2
    assert f"engine.target: {tmp_path / 'nowhere'} is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("repeats", [1, 2])  # (2: it fails in the first round and runs no more)
def test_a_failing_pipeline_is_recorded_and_the_others_still_run(tmp_path, tiny_target, capsys, repeats):
    other_vocab = make_random_checkpoint(tmp_path / "other", hidden_size=32, num_layers=1, vocab_size=300)
    path = write_config(tmp_path, tiny_target, """
  - name: pld
    drafter: {type: ngram}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}
  - name: wrong-vocab
    drafter: {type: draft_model, path: %s}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}
  - name: after
    drafter: {type: ngram, max_window: 2}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""" % other_vocab)
    out = tmp_path / "runs" / "tiny"
    out.mkdir(parents=True)
    (out / "results.md").write_text("| old-pipeline | ... |\n")  # a previous run's report
    with pytest.raises(SystemExit, match="specflow run: error: 1 pipeline\\(s\\) failed: wrong-vocab "
                                         "\\(CheckpointError: draft model vocabulary \\(300\\) differs"):
        main(["run", str(path), "sampling.max_tokens=4", f"repeats={repeats}"])
    assert capsys.readouterr().err.count("Traceback") == 1
    pipelines = json.loads((out / "results.json").read_text())["pipelines"]
    assert list(pipelines) == ["baseline", "pld", "wrong-vocab", "after"] and pipelines["after"]["tokens"] == 2 * 4
    assert len(pipelines["after"]["run_seconds"]) == repeats
    assert pipelines["wrong-vocab"] == {"error": "CheckpointError: draft model vocabulary (300) differs from the "
                                                 "target's (320); a draft model must share the tokenizer"}
    report = (out / "results.md").read_text()
    assert "old-pipeline" not in report and "| after | " in report
    failed = report.index("## Failed pipelines")
    assert report.count("wrong-vocab") == 1 and report.index("`wrong-vocab`: CheckpointError") > failed


@pytest.mark.parametrize("override,message", [
    ("prompts.per_category=0", "prompts.per_category: 0; at least 1"),     # (ran every question of the suite)
    ("prompts.per_category=-1", "prompts.per_category: -1; at least 1"),   # (ran none: max() of an empty list)
    ("prompts.categories=[]", "prompts.categories: an empty list")])        # (ran every category)
def test_a_prompt_subset_that_selects_nothing_fails_naming_its_key_before_the_target_loads(tmp_path, capsys,
                                                                                         override, message):
    path = write_config(tmp_path, "no/such/target", ngram_chain())
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(path, [override])
    assert main(["run", str(path), override]) == 2
    assert message in capsys.readouterr().err


def test_a_null_tree_or_verifier_is_recorded_as_the_default_it_runs(tmp_path):
    path = write_config(tmp_path, "no/such/target", ngram_chain())
    _, (p,) = load_experiment(path, ["pipelines.0.verifier=null", "pipelines.0.tree=null"])
    assert (p.tree, p.verifier) == ({"type": "chain"}, {"type": "rejection"})


def test_a_plain_decoding_pipeline_runs_beside_the_baseline(tmp_path, tiny_target):
    """A pipeline of drafter null decodes plainly, as the baseline does (an A/A check of the timing:
    its speedup is the run's noise); the run recorded its tree's nodes and raised outside the
    pipeline's guard, losing every pipeline after it."""
    path = write_config(tmp_path, tiny_target, "\n  - {name: plain, drafter: null}" + ngram_chain())
    assert main(["run", str(path), "sampling.max_tokens=4"]) == 0
    results = json.loads((tmp_path / "runs" / "tiny" / "results.json").read_text())["pipelines"]
    assert results["plain"]["num_draft_tokens"] is None and results["plain"]["matches_baseline"] == 1.0
    assert results["plain"]["accept_length"] == 1.0 and results["chain"]["num_draft_tokens"] == 3


def test_a_grid_over_a_component_s_type_replaces_the_node_as_an_override_does():
    """``--grid verifier.type=threshold,rejection`` over a threshold verifier with its own keys, or
    ``--grid tree.type=chain,static`` over a chain with a depth: the other type's point gets a node
    of its own type, as the override ``pipelines.0.verifier.type=rejection`` gives it, instead of
    the old type's keys (``unknown key 'threshold_acc'``)."""
    base = PipelineConfig("p", {"type": "ngram"}, {"type": "chain", "depth": 3},
                          {"type": "threshold", "threshold_acc": 0.5})
    points = grid_pipelines(base, parse_grid(["verifier.type=threshold,rejection"]))
    assert [p.verifier for p in points] == [{"type": "threshold", "threshold_acc": 0.5}, {"type": "rejection"}]
    points = grid_pipelines(base, parse_grid(["tree.preset=medusa_63", "tree.type=static"]))  # (type first)
    assert [p.tree for p in points] == [{"type": "static", "preset": "medusa_63"}]
    assert base.tree == {"type": "chain", "depth": 3} and base.verifier["threshold_acc"] == 0.5


def test_question_jsonl_loader():
    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH} not present")
    prompts = load_suite(str(SPEC_BENCH))
    assert len(prompts) == 480
    some = load_suite(str(SPEC_BENCH), categories=["math_reasoning", "translation"], per_category=3)
    assert sorted(p.category for p in some) == ["math_reasoning"] * 3 + ["translation"] * 3
    with pytest.raises(ValueError, match="unknown category 'poetry'; known: "):
        load_suite(str(SPEC_BENCH), categories=["poetry"])


def test_acceptance_by_depth_is_conditional_on_the_depth_before():
    # chains of depth 3 accepting 0, 0, 1, 2, 3 drafts (each tested one more, but the full chain)
    # -> depth 1: 3 of 5 steps, depth 2: 2 of those 3, depth 3: 1 of 2
    assert acceptance_by_depth([1, 1, 2, 3, 4], [1, 1, 2, 3, 3]) == [3 / 5, 2 / 3, 1 / 2]
    # chains of depth 4: the step that accepted depth 3 tested depth 4 too, and missed
    assert acceptance_by_depth([1, 1, 2, 3, 4], [1, 1, 2, 3, 4]) == [3 / 5, 2 / 3, 1 / 2, 0.0]
    assert acceptance_by_depth([1, 1], [1, 1]) == [0.0] and acceptance_by_depth([], []) == []
    with pytest.raises(AssertionError, match="tests at most one draft past"):
        acceptance_by_depth([2], [3])


def test_acceptance_by_depth_counts_no_rejection_where_the_path_ended_at_a_leaf():
    """A step that drafted nothing (root only: plain decoding, an n-gram miss, a tree the pool
    cut) or whose accepted path ended at a leaf tested no draft deeper: no rejection there,
    however deep the tree's other branches went (EAGLE-2 trees: their depth-3 rate read 0.54
    where it is 0.95)."""
    # the steps above, and root-only steps that committed their bonus token only
    assert acceptance_by_depth([1, 1, 2, 3, 4] + [1] * 5, [1, 1, 2, 3, 3] + [0] * 5) == [3 / 5, 2 / 3, 1 / 2]
    assert acceptance_by_depth([1, 1, 1], [0, 0, 0]) == []
    # accepted depth 1 at a leaf (another branch reaching depth 2), then depth 1 with a child missed
    assert acceptance_by_depth([2, 2], [1, 2]) == [1.0, 0.0]
    assert acceptance_by_depth([2, 2, 3], [1, 1, 2]) == [1.0, 1.0]


def test_a_step_s_tried_depth_follows_its_accepted_path_not_the_tree_s_depth():
    """Root 0 with children 1 (a leaf) and 2, and 3 under 2: the tree reaches depth 2, but a path
    that accepted node 1 tested nothing past it."""
    depth = torch.tensor([[0, 1, 1, 2]] * 5)
    valid = torch.ones(5, 4, dtype=torch.bool)
    valid[4, 3] = False  # row 4: node 3 is padding, so node 2 is a leaf there
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7, 8]] * 5), parents=torch.tensor([[-1, 0, 0, 2]] * 5), depth=depth,
                     positions=depth + 10, scores=torch.ones(5, 4), valid=valid,
                     sampled=torch.zeros(5, 4, dtype=torch.bool))
    paths = torch.tensor([[0, 1, -1], [0, -1, -1], [0, 2, 3], [0, 2, -1], [0, 2, -1]])  # [B, D + 1]
    accept_len = torch.tensor([1, 0, 2, 1, 1])
    assert tried_depth(tree, Verdict(paths, accept_len, torch.zeros(5, dtype=torch.long))).tolist() == [1, 1, 2, 2, 1]


def test_results_name_the_plugin_files_and_a_dirty_checkout(tmp_path, tiny_target):
    """A pipeline whose drafter comes from a --plugin file: results.json and results.md name the
    file with its sha256 (the numbers' code, which git_commit does not cover), and say whether
    specflow's own checkout had uncommitted changes."""
    import hashlib

    plugin = tmp_path / "provenance_drafters.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from drafters.ngram import NgramDrafter\n"
        "from specflow.registry import DRAFTERS\n\n\n"
        "@dataclass\nclass ProvenanceConfig:\n    pass\n\n\n"
        "@DRAFTERS.register('provenance_echo', config=ProvenanceConfig)\n"
        "class ProvenanceEcho(NgramDrafter):\n"
        "    @classmethod\n"
        "    def from_config(cls, cfg, vocab_size=None, **_):\n"
        "        return cls(vocab_size=vocab_size)\n")
    path = write_config(tmp_path, tiny_target, """
  - name: echo
    drafter: {type: provenance_echo}
    tree: {type: chain, depth: 2}
    verifier: {type: greedy}""")
    assert main(["run", str(path), "sampling.max_tokens=3", "--plugin", str(plugin)]) == 0
    out = tmp_path / "runs" / "tiny"
    results = json.loads((out / "results.json").read_text())
    digest = hashlib.sha256(plugin.read_bytes()).hexdigest()
    assert results["plugins"][str(plugin.resolve())] == digest
    assert not any("/drafters/" in f or "/specflow/" in f for f in results["plugins"])  # (built-ins: git_commit's)
    assert f"plugin `{plugin.resolve()}` (sha256 {digest[:12]})" in (out / "results.md").read_text()
    if (ROOT / ".git").exists():  # (a changed file of its packages, or a module there git does not track)
        packages = ["--", "specflow", "drafters", "trees", "verifiers"]
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", *packages],
                               capture_output=True, text=True).stdout.strip() != "" or any(
            f.endswith(".py") for f in subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others",
                                                       "--exclude-standard", *packages],
                                                      capture_output=True, text=True).stdout.splitlines())
        assert results["git_dirty"] is dirty
        assert ("with uncommitted changes" in (out / "results.md").read_text()) is dirty
    else:
        assert results["git_dirty"] is None


def test_an_untracked_module_in_specflow_s_packages_makes_the_checkout_dirty(tmp_path):
    """``--plugin drafters/mine.py``, a file git does not track: plugin_sources counts the packages'
    modules as the commit's (no sha256), and git_dirty, counting tracked files only, said False, so
    results.json named a clean commit that does not hold the code that ran."""
    from specflow.bench.provenance import git_dirty

    root = tmp_path.resolve()
    (root / "drafters").mkdir()
    (root / "drafters" / "__init__.py").write_text("")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "packages"]):
        subprocess.run(git + args, check=True)
    assert git_dirty(root) is False
    (root / "mine.py").write_text("")  # outside the packages: a --plugin there is hashed into results.json
    (root / "drafters" / "notes.txt").write_text("")
    assert git_dirty(root) is False
    (root / "drafters" / "mine.py").write_text("")
    assert git_dirty(root) is True
    (root / "drafters" / "mine.py").unlink()
    (root / "results.json").write_text("{}")   # a tracked file that is not code: a bench's committed results
    subprocess.run(git + ["add", "results.json"], check=True)
    subprocess.run(git + ["commit", "-qm", "results"], check=True)
    (root / "results.json").write_text('{"new": 1}')
    assert git_dirty(root) is False
    (root / "drafters" / "__init__.py").write_text("x = 1")
    assert git_dirty(root) is True


def test_a_git_that_times_out_leaves_git_dirty_unknown(monkeypatch):
    """git_dirty runs once the baseline has run: a git status past its timeout (a cold index on a
    network disk) must not raise and lose the run."""
    from specflow.bench import provenance

    run = subprocess.run

    def slow_status(args, **kwargs):
        if "status" in args:
            raise subprocess.TimeoutExpired(args, kwargs.get("timeout"))
        return run(args, **kwargs)

    monkeypatch.setattr(provenance.subprocess, "run", slow_status)
    assert provenance.git_dirty() is None


@pytest.mark.parametrize("drafter", [None, "ngram", "self"])
def test_warmup_meets_every_graph_shape_of_the_timed_batches(tiny_target, monkeypatch, drafter):
    """CUDA graphs are captured lazily, the first time a shape is met, and every run has a fresh
    engine: a shape that only the timed batches meet puts its capture inside the timed wall time
    (more shapes, so more captures, for a speculative engine than for the baseline). The warm-up
    must meet every batch size the timed batches run at (here a batch of 3, padded to 4, and 1)."""
    from specflow.runtime import beam, cuda_graph
    from tests.runtime import graph_emulator

    graph_emulator.install(monkeypatch)
    timed, captures = [False], []
    record = cuda_graph.record

    def counting(run, pool):
        captures.append(timed[0])
        return record(run, pool)

    monkeypatch.setattr(cuda_graph, "record", counting)
    monkeypatch.setattr(beam, "record", counting)
    node = {None: None, "ngram": {"type": "ngram", "max_window": 3},
            "self": {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 4096}}[drafter]
    tree = {"type": "chain", "depth": 3} if drafter else None
    engine = SpecEngine(tiny_target, node, tree, {"type": "greedy"} if drafter else None, device="cpu",
                        dtype="float32", cuda_graphs=True, max_batch_size=3, kv_cache_tokens=4096)
    generate = engine.generate

    def marked(prompts, params):
        timed[0] = isinstance(prompts[0], str)  # the warm-up sends token ids, the suite text
        return generate(prompts, params)

    engine.generate = marked
    cfg = ExperimentConfig(batch_size=3, sampling=SamplingConfig(max_tokens=6, ignore_eos=True))
    prompts = load_suite("builtin", ["code"])  # 4 prompts: a batch of 3 (graphs of 4), then 1
    rows = run_pipeline(engine, prompts, cfg, "x")
    assert [r["batch"] for r in rows] == [0, 0, 0, 1]
    assert captures and not any(captures), f"{sum(captures)} of {len(captures)} captures fell in the timed batches"


def test_warmup_batch_sizes_climb_the_graph_ladder_to_the_largest_batch():
    assert warmup_batch_sizes(1, 10) == [1]
    assert warmup_batch_sizes(8, 100) == [1, 2, 4, 8]
    assert warmup_batch_sizes(8, 3) == [1, 2, 3]            # (a batch of 3 replays the graphs of 4)
    assert warmup_batch_sizes(40, 100) == [1, 2, 4, 8, 16, 32, 40]


ZOO_TARGET = ROOT / "zoo" / "tiny-code" / "target"  # (its tokenizer has a chat template)


def test_later_turns_continue_each_engine_s_own_chat(tmp_path):
    """MT-bench's second turns (Spec-Bench runs both): a later turn's prompt is the chat so far in
    the target's chat template, with the answer this engine gave, then the question's next turn;
    a question with fewer turns runs what it has. Rows are per prompt and turn."""
    suite = tmp_path / "question.jsonl"
    suite.write_text(json.dumps({"question_id": 7, "category": "writing", "turns": ["def add(a, b):", "Now in C."]})
                     + "\n" + json.dumps({"question_id": 8, "category": "qa", "turns": ["import os"]}) + "\n")
    prompts = load_suite(str(suite))
    assert [p.later_turns for p in prompts] == [("Now in C.",), ()]
    cfg = ExperimentConfig(batch_size=2, sampling=SamplingConfig(max_tokens=6, ignore_eos=True))
    cfg.prompts.chat_template, cfg.prompts.turns = True, 2
    ngram = {"type": "ngram", "max_window": 3}
    engines = [SpecEngine(ZOO_TARGET, drafter, {"type": "chain", "depth": 3} if drafter else None,
                          {"type": "greedy"} if drafter else None, device="cpu", dtype="float32", max_batch_size=2)
               for drafter in (None, ngram)]
    sent = []  # the baseline's timed prompts (the warm-up sends token ids)
    generate = engines[0].generate
    engines[0].generate = lambda ps, params: sent.extend(p for p in ps if isinstance(p, str)) or generate(ps, params)
    baseline, pld = (run_pipeline(e, prompts, cfg, "x") for e in engines)
    assert [(r["id"], r["turn"], r["batch"]) for r in baseline] == [("7", 1, 0), ("8", 1, 0), ("7/2", 2, 1)]
    assert [r["token_ids"] for r in pld] == [r["token_ids"] for r in baseline]  # greedy: lossless in both turns
    plain = engines[0]
    answer = plain.decode(baseline[0]["token_ids"])
    chat = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "Now in C."}]
    second = plain.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert answer and sent[2] == second
    seed_of_turn_2 = sampling_params(cfg.sampling, 0 + 1 * len(prompts))  # prompt 0, after a turn of 2 prompts
    assert plain.generate([second], seed_of_turn_2)[0].token_ids == baseline[2]["token_ids"]


def test_later_turns_need_the_chat_template(tmp_path, tiny_target):
    path = write_config(tmp_path, tiny_target, ngram_chain("pld"))
    with pytest.raises(ConfigError, match="prompts.turns.*chat_template=true"):
        load_experiment(path, ["prompts.turns=2"])
    with pytest.raises(ConfigError, match="prompts.turns: 0"):
        load_experiment(path, ["prompts.turns=0"])
    assert load_experiment(path, ["prompts.turns=2", "prompts.chat_template=true"])[0].prompts.turns == 2


def test_a_later_turn_s_warmup_bound_never_fails_a_run_that_fits(tmp_path):
    """The warm-up's widest prompt bounds a later turn by answers of max_tokens; where an answer
    ended at EOS the real turn fits in the KV pool (or the model's context) although that bound
    does not: the warm-up must stay within what a request may hold, not fail the run."""
    suite = tmp_path / "question.jsonl"
    suite.write_text(json.dumps({"question_id": 1, "category": "writing",
                                 "turns": ["def add(a, b):", "Now in C."]}) + "\n")
    prompts = load_suite(str(suite))
    cfg = ExperimentConfig(batch_size=1, sampling=SamplingConfig(max_tokens=190))
    cfg.prompts.chat_template, cfg.prompts.turns = True, 2
    engine = SpecEngine(ZOO_TARGET, device="cpu", dtype="float32", max_batch_size=1, kv_cache_tokens=200)
    first = engine.tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert len(engine.encode(first)) + 190 > 200  # (the bound passes the pool: turn 1 and an answer of 190)
    # a chat target's answer ending at its stop token: here the first token the answer draws
    engine.eos_token_ids = engine.generate([first], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids
    sent = []
    generate = engine.generate
    engine.generate = lambda ps, params: sent.extend(len(p) for p in ps if not isinstance(p, str)) or generate(ps, params)
    rows = run_pipeline(engine, prompts, cfg, "x")
    assert [(r["id"], r["turn"]) for r in rows] == [("1", 1), ("1/2", 2)]
    assert sent == [engine.scheduler.max_request_tokens() - 1]  # the warm-up's one request, as long as fits


def test_the_warmup_is_as_wide_as_a_later_turn_s_prompt(tmp_path):
    """A later turn's prompt holds the chat template's tokens around each message too: the
    warm-up's prompt is at least as long as every timed one (answers of max_tokens, no EOS)."""
    suite = tmp_path / "question.jsonl"
    suite.write_text(json.dumps({"question_id": 1, "category": "writing",
                                 "turns": ["def add(a, b):", "Now in C."]}) + "\n")
    cfg = ExperimentConfig(batch_size=1, sampling=SamplingConfig(max_tokens=6, ignore_eos=True))
    cfg.prompts.chat_template, cfg.prompts.turns = True, 2
    engine = SpecEngine(ZOO_TARGET, device="cpu", dtype="float32", max_batch_size=1)
    warm, timed = [], []
    generate = engine.generate
    engine.generate = lambda ps, params: ((timed if isinstance(ps[0], str) else warm)
                                          .extend(len(engine.encode(p)) for p in ps) or generate(ps, params))
    run_pipeline(engine, load_suite(str(suite)), cfg, "x")
    assert len(timed) == 2 and min(warm) >= max(timed)


def test_a_chat_that_outgrows_the_context_is_cut_and_the_run_goes_on(tmp_path):
    """A later turn's chat grows with the answers: a turn gets the new tokens the model's context
    leaves it (the row's max_tokens), and a chat with no room for one more ends there, its turn
    without a row, while the other questions run on (Spec-Bench's 2 turns of 1024 new tokens pass
    a 2048-token context)."""
    suite = tmp_path / "question.jsonl"
    rows_in = [{"question_id": "a", "category": "writing", "turns": ["def add(a, b):", "Now in C."]},
               {"question_id": "b", "category": "code", "turns": ["import os\n" * 6 + "def walk(path):", "Tests?"]}]
    suite.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    prompts = load_suite(str(suite))
    cfg = ExperimentConfig(batch_size=2, sampling=SamplingConfig(max_tokens=12, ignore_eos=True))
    cfg.prompts.chat_template, cfg.prompts.turns = True, 2
    engine = SpecEngine(ZOO_TARGET, device="cpu", dtype="float32", max_batch_size=2)
    sent = []
    generate = engine.generate
    engine.generate = lambda ps, params: sent.extend(len(engine.encode(p)) for p in ps if isinstance(p, str)) \
        or generate(ps, params)
    full = run_pipeline(engine, prompts, cfg, "x")
    _, b1, a2, b2 = sent
    context = a2 + 5  # turn 2 of "a" gets 5 new tokens; "b"'s chat outgrows it
    assert b1 + 12 <= context < b2 and [r["max_tokens"] for r in full] == [12] * 4
    engine.model.config.max_position_embeddings = context
    rows = run_pipeline(engine, prompts, cfg, "x")
    assert [(r["id"], r["max_tokens"], r["tokens"]) for r in rows] == [("a", 12, 12), ("b", 12, 12), ("a/2", 5, 5)]
    assert context_cuts(rows, prompts, cfg) == {"turns_shortened": ["a/2"], "turns_left_out": ["b/2"]}
    assert context_cuts(full, prompts, cfg) == {"turns_shortened": [], "turns_left_out": []}
    # the baseline's rows are matched by id: a turn left out on one side is no mismatch on the other
    assert summarize(rows[:2], full)["matches_baseline"] == 1.0


def test_a_suite_whose_every_prompt_outgrows_the_context_says_so(tmp_path):
    """(summarize failed on the empty rows: "quantile() input tensor must be non-empty")"""
    suite = tmp_path / "question.jsonl"
    suite.write_text(json.dumps({"question_id": "a", "category": "code", "turns": ["import os\n" * 40]}) + "\n")
    cfg = ExperimentConfig(batch_size=1, warmup=0, sampling=SamplingConfig(max_tokens=4, ignore_eos=True))
    engine = SpecEngine(ZOO_TARGET, device="cpu", dtype="float32")
    engine.model.config.max_position_embeddings = 16
    with pytest.raises(ValueError, match="no prompt fits the model's context"):
        run_pipeline(engine, load_suite(str(suite)), cfg, "x")
