"""The app without its UI: the pipeline catalog, editable forms, engines, streamed generation."""

import threading

import pytest

from specflow.app.render import render_step
from specflow.app.session import (NO_DRAFTER, PLAIN, EnginePool, Lane, PipelineForm, load_catalog, start_lane,
                                  stream)
from specflow.bench.experiment_config import PipelineConfig
from specflow.cli import main
from specflow.config import ConfigError
from specflow.pipeline import EngineConfig
from specflow.sampling import SamplingParams

EXPERIMENT = """\
name: exp
engine: {{target: {target}, device: cpu, dtype: float32, kv_cache_tokens: 2048}}
sampling: {{temperature: 0.0, max_tokens: 12}}
pipelines:
  - {{name: ngram-chain, drafter: {{type: ngram}}, tree: {{type: chain, depth: 3}}, verifier: {{type: greedy}}}}
  - {{name: ngram-bfs, drafter: {{type: ngram}}, tree: {{type: bfs, depth: 3}}}}
"""
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "def add(a, b):\n    return a + b\n"


def self_draft(target, tree: dict, verifier: str) -> PipelineConfig:
    """The target drafting for itself: greedy drafts are always right, so paths are long."""
    return PipelineConfig(f"self-{tree['type']}", {"type": "draft_model", "path": str(target),
                                                   "kv_cache_tokens": 2048}, tree, {"type": verifier})


@pytest.fixture(scope="module")
def pool(tiny_target):
    return EnginePool(EngineConfig(target=str(tiny_target), device="cpu", dtype="float32", kv_cache_tokens=2048,
                                   record_steps=True))


def test_catalog_lists_experiment_pipelines_and_notes_broken_configs(tmp_path, tiny_target):
    (tmp_path / "exp.yaml").write_text(EXPERIMENT.format(target=tiny_target))
    (tmp_path / "broken.yaml").write_text(EXPERIMENT.format(target=tiny_target).replace("exp", "broken")
                                         .replace("type: ngram}", "type: ngram, windw: 3}"))
    (tmp_path / "serve.yaml").write_text("engine: {target: somewhere}\n")   # not an experiment: skipped
    catalog = load_catalog(tmp_path / "exp.yaml", config_dir=tmp_path)
    labels = list(catalog.pipelines)
    assert labels[:2] == ["exp / ngram-chain", "exp / ngram-bfs"]
    assert labels[-1] == "plain decoding" and len(labels) == 3
    assert catalog.engine.target == str(tiny_target) and catalog.engine.record_steps
    assert catalog.sampling.max_tokens == 12
    (note,) = catalog.notes
    assert "broken.yaml" in note and "pipelines[ngram-chain].drafter" in note and "unknown key 'windw'" in note


def test_a_config_that_cannot_load_is_a_config_error_and_a_clear_cli_message(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("name: bad\nengine: {target: x}\npipelines: [{name: a, tre: {}}]\n")
    with pytest.raises(ConfigError, match="unknown key 'tre'"):
        load_catalog(tmp_path / "bad.yaml", config_dir=tmp_path)
    pytest.importorskip("gradio", reason="the app extra is not installed: pip install 'specflow[app]'")
    assert main(["app", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "specflow app: error: config file not found" in err and "Traceback" not in err


def test_form_round_trips_a_pipeline_and_uses_only_the_tree_parameters_its_type_declares():
    p = PipelineConfig("e", {"type": "ngram", "max_window": 2}, {"type": "eagle2", "topk": 3, "depth": 4},
                       {"type": "typical", "epsilon": 0.1})
    form = PipelineForm.from_pipeline(p)
    assert (form.drafter_type, form.drafter_params) == ("ngram", "{max_window: 2}")
    assert (form.depth, form.topk, form.num_draft_tokens) == (4, 3, 32)   # 32: eagle2's default
    back = form.to_pipeline()
    assert back.tree == {"type": "eagle2", "depth": 4, "topk": 3, "num_draft_tokens": 32}
    assert (back.drafter, back.verifier) == (p.drafter, p.verifier)

    chain = PipelineForm.from_pipeline(PipelineConfig("c", {"type": "ngram"}, {"type": "chain"}, {"type": "greedy"}))
    assert (chain.depth, chain.topk) == (4, None)
    chain.topk = 5                                                         # chain has no topk: ignored
    assert chain.to_pipeline().tree == {"type": "chain", "depth": 4}
    plain = PipelineForm("p", drafter_type=NO_DRAFTER, tree_type="forest", tree_params="{x: [").to_pipeline()
    assert (plain.name, plain.drafter, plain.tree, plain.verifier) == ("p", None, PLAIN.tree, PLAIN.verifier)


@pytest.mark.parametrize("change, message", [
    ({"drafter_params": "{max_window: ["}, "drafter params: not valid YAML"),
    ({"drafter_params": "3"}, "drafter params: expected a mapping"),
    ({"drafter_params": "{windw: 3}"}, "unknown key 'windw'; valid keys: min_window"),
    ({"tree_type": "forest"}, "unknown tree type 'forest'; known: bfs, chain"),
    ({"verifier_type": "oracle"}, "unknown verifier type 'oracle'"),
])
def test_bad_form_fields_are_config_errors_naming_the_fix(change, message):
    form = PipelineForm("x", drafter_type="ngram", **change)
    with pytest.raises(ConfigError, match=message):
        form.to_pipeline()


def test_streamed_lanes_grow_step_by_step_and_end_with_speedup_against_plain(pool, tiny_target):
    pipelines = [self_draft(tiny_target, {"type": "chain", "depth": 3}, "greedy"),
                 self_draft(tiny_target, {"type": "eagle2", "topk": 2, "depth": 3, "num_draft_tokens": 6},
                            "rejection")]
    lanes = [start_lane(pool, p, PROMPT, PARAMS) for p in pipelines]
    seen = []
    for current in stream(pool, lanes, PROMPT, PARAMS, threading.Event()):
        seen.append([len(lane.steps) for lane in current])
    assert seen[0] == [0, 0] and seen == sorted(seen) and len(seen) > 3
    for lane in lanes:
        assert lane.state == "done" and lane.stats.tokens == 12
        assert lane.stats.tokens == 1 + sum(lane.stats.accept_lengths)       # + the prefill's token
        assert lane.stats.matches_baseline and lane.stats.speedup > 0
        assert max(len(r.accepted) for r in lane.steps) > 1                # drafts were accepted
        assert all(r.accepted[0] == 0 for r in lane.steps)
        for record in lane.steps:
            assert render_step(record, pool.token_text).count("class=\"node") == sum(record.tree["valid"]) + 1
    assert pool.engine(pipelines[0]) is lanes[0].engine                   # engines are reused


def test_a_pipeline_that_cannot_load_fails_its_lane_only(pool, tmp_path):
    broken = PipelineConfig("missing", {"type": "draft_model", "path": str(tmp_path / "nowhere")},
                            {"type": "chain"}, {"type": "greedy"})
    ok = PipelineConfig("ngram", {"type": "ngram"}, {"type": "chain", "depth": 2}, {"type": "greedy"})
    lanes = [start_lane(pool, broken, PROMPT, PARAMS), start_lane(pool, ok, PROMPT, PARAMS)]
    assert lanes[0].state == "error" and "drafter.path" in lanes[0].error and "does not exist" in lanes[0].error
    for _ in stream(pool, lanes, PROMPT, PARAMS, threading.Event()):
        pass
    assert lanes[0].state == "error" and lanes[1].state == "done"


def test_stop_ends_the_generation_and_frees_the_requests(pool):
    stop = threading.Event()
    ngram = PipelineConfig("ngram", {"type": "ngram"}, {"type": "bfs", "depth": 2}, {"type": "rejection"})
    lanes = [start_lane(pool, ngram, PROMPT, PARAMS), Lane.failed("form", "tree params: not valid YAML")]
    rounds = 0
    for _ in stream(pool, lanes, PROMPT, PARAMS, stop):
        rounds += 1
        if rounds == 2:
            stop.set()
    assert lanes[0].state == "stopped" and lanes[0].stats.tokens < PARAMS.max_tokens
    assert not lanes[0].engine.has_unfinished()


def test_a_lane_that_crashes_shows_no_speedup(pool, monkeypatch):
    prompt = "x = 1\ny = 2\nx = 1\ny = "  # its own baseline: measured after the first generation, then cached
    ok = PipelineConfig("ngram", {"type": "ngram"}, {"type": "chain", "depth": 2}, {"type": "greedy"})
    buggy = PipelineConfig("buggy", {"type": "ngram", "max_window": 2}, {"type": "chain", "depth": 3},
                           {"type": "greedy"})
    engine = pool.engine(buggy)
    first_step = engine.step

    def crash():
        raise RuntimeError("drafter bug")

    def prefill_then_crash():
        monkeypatch.setattr(engine, "step", crash)
        return first_step()

    for cached in (False, True):
        assert (pool.cached_baseline(prompt, PARAMS) is not None) == cached
        monkeypatch.setattr(engine, "step", prefill_then_crash)
        lanes = [start_lane(pool, ok, prompt, PARAMS), start_lane(pool, buggy, prompt, PARAMS)]
        for _ in stream(pool, lanes, prompt, PARAMS, threading.Event()):
            pass
        assert lanes[0].state == "done" and lanes[0].stats.speedup > 0
        assert lanes[1].state == "error" and lanes[1].error == "RuntimeError: drafter bug"
        assert lanes[1].stats.tokens > 0 and lanes[1].stats.speedup is None


def test_lanes_of_one_pipeline_and_the_baseline_each_get_their_own_engine(pool):
    """Two lanes on one engine took each other's finished requests (a crash); plain decoding as a
    lane beside its own hidden baseline lane is the same case. An engine serves one lane of a run."""
    prompt = "import os\nimport sys\n"   # (a prompt whose baseline is not cached yet)
    ngram = PipelineConfig("ngram", {"type": "ngram"}, {"type": "chain", "depth": 2}, {"type": "greedy"})
    lanes = [start_lane(pool, ngram, prompt, PARAMS)]
    lanes.append(start_lane(pool, ngram, prompt, PARAMS, lanes))
    lanes.append(start_lane(pool, PLAIN, prompt, PARAMS, lanes))
    assert len({id(lane.engine) for lane in lanes}) == 3
    assert pool.engine(ngram, busy=(lanes[0].engine,)) is lanes[1].engine   # (kept for the next run)
    for _ in stream(pool, lanes, prompt, PARAMS, threading.Event()):
        pass
    assert [lane.state for lane in lanes] == ["done"] * 3
    assert all(lane.stats.matches_baseline and lane.stats.speedup > 0 for lane in lanes)
    assert lanes[0].token_ids == lanes[1].token_ids == pool.cached_baseline(prompt, PARAMS)[1]


def panel_over(tmp_path, tiny_target, pipelines: str):
    """Pipeline panel A over an experiment of ``pipelines`` (YAML list items), its first picked."""
    gr = pytest.importorskip("gradio", reason="the app extra is not installed: pip install 'specflow[app]'")
    from specflow.app.panels import PipelinePanel

    (tmp_path / "exp.yaml").write_text(f"""\
name: exp
engine: {{target: {tiny_target}, device: cpu, dtype: float32}}
pipelines:
{pipelines}""")
    catalog = load_catalog(tmp_path / "exp.yaml", config_dir=tmp_path)
    with gr.Blocks():
        return PipelinePanel("A", catalog, "exp / a")


def test_a_component_type_change_brings_that_type_s_parameters(tmp_path, tiny_target):
    """(the old type's parameters stayed: ngram -> draft_model said "unknown key 'scope'")"""
    panel = panel_over(tmp_path, tiny_target, f"""\
  - {{name: a, drafter: {{type: ngram, max_window: 2}}, tree: {{type: chain}}, verifier: {{type: greedy}}}}
  - {{name: b, drafter: {{type: draft_model, path: {tiny_target}}}, tree: {{type: chain}},
     verifier: {{type: threshold, threshold_single: 0.4}}}}
  - {{name: c, drafter: {{type: ngram}}, tree: {{type: static, preset: medusa_63}}, verifier: {{type: greedy}}}}
""")
    assert panel.listed_params("drafter", "draft_model") == f"{{path: {tiny_target}}}"
    assert panel.listed_params("drafter", "ngram") == "{max_window: 2}"
    assert panel.listed_params("drafter", "eagle") == "{}"
    assert panel.listed_params("verifier", "threshold") == "{threshold_single: 0.4}"
    # (static's error said "give one of choices or preset")
    *numbers, tree_params = panel.tree_type_changed("ngram", "static")
    assert tree_params["value"] == "{preset: medusa_63}" and not any(n["visible"] for n in numbers)
    *numbers, tree_params = panel.tree_type_changed("ngram", "eagle2")
    assert tree_params["value"] == "{}" and [n["value"] for n in numbers] == [5, 8, 32]
    assert all(n["visible"] for n in numbers)


def test_plain_decoding_shows_only_the_drafter_field(tmp_path, tiny_target):
    """(plain decoding showed a tree and a verifier it does not use)"""
    panel = panel_over(tmp_path, tiny_target, """\
  - {name: a, drafter: {type: ngram, max_window: 2}, tree: {type: eagle2}, verifier: {type: greedy}}
""")
    from specflow.app.panels import FORM_FIELDS, form_values

    shown = [name for name, v in zip(FORM_FIELDS, form_values(PipelineForm.from_pipeline(PLAIN))) if v["visible"]]
    assert shown == ["drafter_type"]
    values = panel.drafter_type_changed(NO_DRAFTER, "{max_window: 2}", "eagle2", 5, 8, 32, "{}", "greedy", "{}")
    assert [v["visible"] for v in values] == [True] + [False] * 8
    values = panel.drafter_type_changed("ngram", "{}", "eagle2", 5, 8, 32, "{}", "greedy", "{}")
    assert all(v["visible"] for v in values) and values[1]["value"] == "{max_window: 2}"


def test_the_hidden_baseline_lane_is_closed_whatever_the_lanes_do(pool, monkeypatch):
    """The hidden plain lane starts inside the stream's try (an error starting it still closes the
    visible lanes), and stops at once where every lane failed: the user waited for plain decoding
    to run to max_tokens with nothing to show for it."""
    prompt = "def hidden(x):\n"
    lanes = [Lane.failed("broken", "no such drafter")]
    rounds = sum(1 for _ in stream(pool, lanes, prompt, PARAMS, threading.Event()))
    assert rounds == 1 and pool.cached_baseline(prompt, PARAMS) is None and lanes[0].stats.speedup is None
    assert not any(engine.has_unfinished() for engine in pool._engines.values())

    def cannot_start(*args, **kwargs):
        raise RuntimeError("out of memory warming up")

    closed = []
    lane = start_lane(pool, PLAIN, "def other(y):\n", PARAMS)
    monkeypatch.setattr(Lane, "close", lambda self: closed.append(self.name))
    monkeypatch.setattr("specflow.app.session.start_lane", cannot_start)
    with pytest.raises(RuntimeError):
        for _ in stream(pool, [lane], "def other(y):\n", PARAMS, threading.Event()):
            pass
    assert closed == [lane.name]
    monkeypatch.undo()
    lane.close()


def test_a_cached_baseline_still_says_whether_greedy_lanes_match_it(pool):
    """With plain decoding of the prompt cached, the baseline was attached while the lanes ran, so
    a greedy lane that finished never got its "same tokens as plain" (it stayed None)."""
    prompt = "def cached(z):\n"
    ngram = PipelineConfig("ngram", {"type": "ngram"}, {"type": "chain", "depth": 2}, {"type": "greedy"})
    for cached in (False, True):
        assert (pool.cached_baseline(prompt, PARAMS) is not None) == cached
        lanes = [start_lane(pool, ngram, prompt, PARAMS)]
        for _ in stream(pool, lanes, prompt, PARAMS, threading.Event()):
            pass
        assert lanes[0].state == "done" and lanes[0].stats.speedup > 0
        assert lanes[0].stats.matches_baseline is True, f"cached baseline: {cached}"
