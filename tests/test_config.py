"""Registries, typed configs and experiment YAML validation (every shipped config included)."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from specflow.bench.experiment_config import PipelineConfig, load_experiment
from specflow.config import ConfigError, build_component, component_config, dump_yaml, load_yaml, validate
from specflow.engine import SpecEngine
from specflow.pipeline import EngineConfig
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS, Registry, RegistryError

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


def test_builtins_register_through_entry_points():
    assert {"ngram", "draft_model", "union", "fallback"} <= set(DRAFTERS.names())
    assert {"chain", "static", "eagle2", "bfs"} <= set(TREE_BUILDERS.names())
    assert {"greedy", "rejection", "threshold", "typical"} <= set(VERIFIERS.names())


def test_unknown_type_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown tree type 'chian'; known: bfs, chain, eagle2, static"):
        component_config(TREE_BUILDERS, {"type": "chian"}, "tree")


def test_wrong_parameter_names_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'dept'; valid keys: .*depth"):
        build_component(TREE_BUILDERS, {"type": "chain", "dept": 3}, "tree")
    with pytest.raises(ConfigError, match=r"unknown key 'tau'; valid keys: \(none\)$"):  # (greedy has none)
        build_component(VERIFIERS, {"type": "greedy", "tau": 3}, "verifier")


def test_wrong_value_type_names_key():
    with pytest.raises(ConfigError, match="depth"):
        build_component(TREE_BUILDERS, {"type": "chain", "depth": "deep"}, "tree")


def test_num_draft_tokens_must_be_positive():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_component(TREE_BUILDERS, {"type": "eagle2", "num_draft_tokens": 0}, "tree")


def test_duplicate_registration_fails():
    reg = Registry("thing", "a test registry")

    @dataclass
    class Cfg:
        x: int = 1

    @reg.register("a", config=Cfg)
    class A:
        pass

    with pytest.raises(RegistryError, match="already registered"):
        @reg.register("a", config=Cfg)
        class B:
            pass


def test_redefined_class_replaces_its_registration():
    """Re-running a notebook cell defines a new class object with the same module and name."""
    reg = Registry("thing", "a test registry")

    @dataclass
    class Cfg:
        x: int = 1

    versions = []
    for _ in range(2):
        @reg.register("a", config=Cfg)
        class A:
            pass
        versions.append(A)
    assert versions[0] is not versions[1]
    assert reg.get("a") == (versions[1], Cfg)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    """Every experiment / serve YAML validates, builds its trees and verifiers, and names
    checkpoints that exist in the repository."""
    root = path.parents[1]
    raw = load_yaml(path)
    engine = validate(EngineConfig, raw.engine, "engine")
    if "pipelines" in raw:
        _, pipelines = load_experiment(path)
    else:
        pipelines = [PipelineConfig(name=raw.name, drafter=engine.drafter, tree=engine.tree, verifier=engine.verifier)]
    assert pipelines
    if not engine.target.startswith(".."):  # data outside the repo (../shared) is the user's to give
        assert (root / engine.target / "config.json").exists(), engine.target
    for p in pipelines:
        assert build_component(VERIFIERS, p.verifier, f"{p.name}.verifier").type_name == p.verifier["type"]
        if p.drafter is not None:
            _, drafter_cfg = component_config(DRAFTERS, p.drafter, f"{p.name}.drafter")
            if getattr(drafter_cfg, "path", None):
                assert (root / drafter_cfg.path / "config.json").exists(), drafter_cfg.path
            assert build_component(TREE_BUILDERS, p.tree, f"{p.name}.tree").num_draft_tokens >= 1


def test_experiment_typo_and_override(tmp_path):
    path = CONFIGS[0]
    with pytest.raises(ConfigError, match="unknown key 'max_tokenz'"):
        load_experiment(path, ["sampling.max_tokenz=3"])
    cfg, _ = load_experiment(path, ["sampling.max_tokens=3"])
    assert cfg.sampling.max_tokens == 3
    # (the last one silently won: refused, as sweep refuses a key given twice)
    with pytest.raises(ConfigError, match="override sampling.max_tokens is given twice; give it once"):
        load_experiment(path, ["sampling.max_tokens=3", "batch_size=2", "sampling.max_tokens=4"])


def test_a_component_node_without_a_type_is_an_error_not_the_default_type():
    cfg = validate(PipelineConfig, {"name": "p", "tree": {"depth": 2}}, "pipelines[0]")
    with pytest.raises(ConfigError, match=r"pipelines\[0\].tree: a tree node needs a 'type' key"):
        component_config(TREE_BUILDERS, cfg.tree, "pipelines[0].tree")


BAD_PIPELINES = [  # (a pipeline's nodes, what the error names): all found before the target loads
    ({"tree": {"type": "chain", "depth": -1}}, r"pipelines\[p\].tree: .*depth must be >= 1"),
    ({"tree": {"type": "eagle2", "topk": 0}}, r"pipelines\[p\].tree: .*topk"),
    ({"verifier": {"type": "threshold", "threshold_single": 2.0}}, r"pipelines\[p\].verifier: .*threshold_single"),
    ({"drafter": {"type": "eagle", "path": "no/such/head"}},
     r"pipelines\[p\].drafter.path: no/such/head does not exist"),
    ({"tree": {"type": "eagle2", "num_draft_tokens": 1}}, r"pipelines\[p\].tree: .*num_draft_tokens must be >= 2"),
    ({"drafter": {"type": "union", "drafters": [{"type": "ngram"}, {"type": "eagel"}]}},
     r"pipelines\[p\].drafter.drafters\[1\].type: unknown drafter type 'eagel'"),
    ({"drafter": {"type": "fallback", "drafters": [{"type": "medusa", "path": "no/such/heads"}]}},
     r"pipelines\[p\].drafter.drafters\[0\].path: no/such/heads does not exist"),
    ({"drafter": {"type": "ngram", "min_window": 0}}, r"pipelines\[p\].drafter \(drafter 'ngram'\): .*min_window must be >= 1"),
    ({"drafter": {"type": "union", "drafters": [{"type": "ngram", "scope": "globl"}]}},
     r"pipelines\[p\].drafter.drafters\[0\] \(drafter 'ngram'\): .*scope must be one of request, global"),
    ({"drafter": {"type": "draft_model", "path": "no/such/model", "kv_cache_tokens": 0}},
     r"pipelines\[p\].drafter \(drafter 'draft_model'\): kv_cache_tokens must be >= 1, got 0"),
    ({"drafter": {"type": "eagle", "path": "no/such/head", "page_size": 0}},
     r"pipelines\[p\].drafter \(drafter 'eagle'\): page_size must be >= 1, got 0"),
    ({"drafter": {"type": "eagle3", "path": "no/such/head", "kv_cache_tokens": -1}},
     r"pipelines\[p\].drafter \(drafter 'eagle3'\): kv_cache_tokens must be >= 1, got -1"),
    ({"drafter": {"type": "fallback", "drafters": []}},
     r"pipelines\[p\].drafter \(drafter 'fallback'\): fallback drafter needs at least one drafter"),
]


@pytest.mark.parametrize("nodes,message", BAD_PIPELINES)
def test_bad_values_fail_before_the_target_loads(tmp_path, nodes, message):
    experiment = {"engine": {"target": "no/such/target"}, "pipelines": [{"name": "p", **nodes}]}
    path = tmp_path / "x.yaml"
    dump_yaml(experiment, path)
    with pytest.raises(ConfigError, match=message):
        load_experiment(path)
    with pytest.raises(ConfigError, match=message.replace(r"pipelines\[p\].", "")):
        SpecEngine("no/such/target", **{"drafter": {"type": "ngram"}, **nodes})


@pytest.mark.parametrize("override,message", [
    ("sampling.temperature=-1", "sampling: temperature must be >= 0"), ("batch_size=0", "batch_size and repeats must be >= 1"), ("repeats=0", "got 1, 0 and 1"),
    ("engine.drafter.type=ngram", "engine.drafter: an experiment sets it per pipeline"),
    ("engine.page_size=0", "page_size must be >= 1, got 0"), ("engine.kv_cache_tokens=-5", "kv_cache_tokens must be"),
    ("engine.max_prefill_tokens=0", r"max_prefill_tokens must be >= 1 or null \(no bound\), got 0"),
    ("engine.backend=triton", "backend: 'triton' is not one of torch, flashinfer, auto"),
    ("engine.device=gpu", "device: 'gpu' is not a torch device"),
    ("engine.device=cuda:7", "device: 'cuda:7', but torch sees"),
    ("pipelines.0.tree.depth=x", r"pipelines\[.*\].tree .*'x'"),
    ("pipelines.9.tree.depth=3", "override 'pipelines.9.tree.depth=3': pipelines has 3 item\\(s\\) \\(indices 0 to 2, or -3 to -1\\)"),
    ("pipelines.x.tree=3", "override 'pipelines.x.tree=3'"), ("sampling=[1", "override 'sampling=\\[1'"),
    ("name=*.rs", "override 'name=\\*.rs': the value is not valid YAML \\(while scanning an alias\\); "
                  "quote it: 'name=\"\\*.rs\"'"),
    ("pipelines={a: {name: a}}", "override 'pipelines={a: {name: a}}': Cannot merge incompatible container"),
    ("pipelines=[3]", r"pipelines\[0\]: expected a mapping, got '3'")])
def test_bad_experiment_settings_fail_before_the_target_loads(override, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(CONFIGS[0], [override, "engine.target=no/such/target"])


def test_containers_of_the_wrong_kind_name_the_key(tmp_path):
    dump_yaml({"engine": {"target": "t"}, "pipelines": {"a": {"name": "a"}}}, tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="experiment.pipelines: expected a list, got '{a: {name: a}}'"):
        load_experiment(tmp_path / "x.yaml")
    dump_yaml({"engine": [1]}, tmp_path / "y.yaml")
    with pytest.raises(ConfigError, match=r"experiment.engine: expected a mapping, got '\[1\]'"):
        load_experiment(tmp_path / "y.yaml")


def test_overrides_index_lists():
    cfg, pipelines = load_experiment(CONFIGS[0], ["pipelines.1.tree.depth=2", "pipelines.0.name=first"])
    assert pipelines[1].tree["depth"] == 2 and pipelines[0].name == "first"
    assert [p.name for p in pipelines[1:]] == [p.name for p in load_experiment(CONFIGS[0])[1][1:]]


def test_an_override_that_switches_a_component_type_replaces_its_node(tmp_path):
    """The old type's keys do not carry over (eagle2's topk is no static tree key); the same
    type's keys merge as before."""
    dump_yaml({"engine": {"target": "t"}, "pipelines": [
        {"name": "p", "drafter": "ngram", "tree": {"type": "eagle2", "topk": 2, "depth": 3}}]}, tmp_path / "x.yaml")
    for override, tree in [
        ("pipelines.0.tree={type: static, preset: medusa_63}", {"type": "static", "preset": "medusa_63"}),
        ("pipelines.0.tree.type=chain", {"type": "chain"}),
        ("pipelines.0.tree={type: eagle2, depth: 5}", {"type": "eagle2", "topk": 2, "depth": 5}),
        ("pipelines.0.tree.type=eagle2", {"type": "eagle2", "topk": 2, "depth": 3}),
    ]:
        assert load_experiment(tmp_path / "x.yaml", [override])[1][0].tree == tree, override


def test_a_mapping_override_replaces_the_components_inside_it_whose_type_switches(tmp_path):
    """A whole pipeline (or engine) given as a mapping: a drafter of another type inside it gets
    none of the old drafter's keys (fallback's ``drafters`` are no ngram key); same-type nodes merge."""
    dump_yaml({"engine": {"target": "t"}, "pipelines": [
        {"name": "p", "drafter": {"type": "fallback", "drafters": [{"type": "ngram"}]},
         "tree": {"type": "eagle2", "topk": 2, "depth": 3}}]}, tmp_path / "x.yaml")
    pipeline = load_experiment(tmp_path / "x.yaml", ["pipelines.0={name: q, drafter: {type: ngram, max_window: 2}, "
                                                     "tree: {type: eagle2, depth: 5}}"])[1][0]
    assert (pipeline.name, pipeline.drafter, pipeline.tree) == (
        "q", {"type": "ngram", "max_window": 2}, {"type": "eagle2", "topk": 2, "depth": 5})


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("pipelines: [1, 2\nname: x\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: .* line 1, column"):
        load_yaml(tmp_path / "bad.yaml")
