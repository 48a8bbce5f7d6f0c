"""Components from outside specflow's packages: a module loaded by path or name registers its
drafters, and a module that shadows a built-in package is named rather than used."""

import subprocess
import sys
import textwrap

import pytest

SUFFIX_DRAFTER = textwrap.dedent('''
    from dataclasses import dataclass

    from drafters.ngram import NgramDrafter
    from specflow.registry import DRAFTERS


    @dataclass
    class EchoConfig:
        pass


    @DRAFTERS.register("echo", config=EchoConfig)
    class EchoDrafter(NgramDrafter):
        @classmethod
        def from_config(cls, cfg, vocab_size=None, tokenizer=None, **_):
            drafter = cls(vocab_size=vocab_size)
            drafter.tokenizer = tokenizer  # (what a drafter that works on text, as REST's store, reads)
            return drafter
''')


def python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_a_plugin_module_registers_by_path_or_by_name(tmp_path):
    (tmp_path / "my_drafters.py").write_text(SUFFIX_DRAFTER)
    for spec in (str(tmp_path / "my_drafters.py"), "my_drafters"):
        run = python(f"""
            from specflow.config import build_component
            from specflow.registry import DRAFTERS, load_module
            load_module({spec!r})
            print(type(build_component(DRAFTERS, {{"type": "echo"}}, vocab_size=8)).__name__)
            """, cwd=tmp_path)
        assert run.stdout.strip() == "EchoDrafter", run.stderr


def test_a_module_shadowing_a_builtin_package_is_named(tmp_path):
    (tmp_path / "drafters.py").write_text("ECHO = 1\n")
    run = python("""
        import sys
        sys.path.insert(0, "")   # as when a script in this folder runs
        from specflow.registry import DRAFTERS
        DRAFTERS.names()
        """, cwd=tmp_path)
    assert run.returncode != 0
    assert f"'drafters' was imported from {tmp_path / 'drafters.py'}" in run.stderr and "rename it" in run.stderr
    # through a config node: the node is not at fault, so its key does not prefix the message
    run = python("""
        import sys
        sys.path.insert(0, "")
        from specflow.config import build_component
        from specflow.registry import TREE_BUILDERS
        build_component(TREE_BUILDERS, {"type": "chain"}, where="tree")
        """, cwd=tmp_path)
    assert "ConfigError: 'drafters' was imported from" in run.stderr, run.stderr


def test_the_cli_loads_plugins_before_the_command(tmp_path):
    (tmp_path / "my_drafters.py").write_text(SUFFIX_DRAFTER)
    run = python("""
        from specflow.cli import main
        main(["list", "--plugin", "my_drafters.py"])
        """, cwd=tmp_path)
    assert "  echo " in run.stdout, run.stderr
    run = python("""
        import sys
        from specflow.cli import main
        sys.exit(main(["list", "--plugin", "no_such_module"]))
        """, cwd=tmp_path)
    assert run.returncode == 2 and "No module named 'no_such_module'" in run.stderr


def test_an_unknown_type_says_how_a_type_of_one_s_own_registers():
    from specflow.registry import DRAFTERS, RegistryError

    with pytest.raises(RegistryError, match=r"unknown drafter type 'echo'; known: draft_model, .* --plugin FILE.py "
                                            r"on the command line, or an entry point of the 'specflow.components'"):
        DRAFTERS.get("echo")


@pytest.mark.parametrize("source,error", [
    ("import no_such_dependency_xyz\n", "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    ("def f(:\n    pass\n", "SyntaxError: "),
    ("raise RuntimeError('not configured')\n", "RuntimeError: not configured")])
def test_a_plugin_that_fails_to_import_is_named_without_a_traceback(tmp_path, capsys, source, error):
    """A plugin whose own import fails said only "No module named 'X'" (as if X were the plugin),
    or printed a bare traceback (a syntax error, an exception at import)."""
    from specflow.cli import main

    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text(source)
    assert main(["list", "--plugin", str(plugin)]) == 2
    err = capsys.readouterr().err
    assert f"plugin {plugin}: " in err and error in err and "broken_plugin.py, line " in err, err
    assert "Traceback" not in err and "broken_plugin" not in sys.modules


def test_a_plugin_file_named_like_another_module_is_refused_naming_both(tmp_path):
    """Loading ``random.py`` by path would put it in sys.modules as 'random': every later
    ``import random`` (sympy's, under torch) would get the plugin. It is refused, as is a
    ``drafters.py`` (specflow's own package), in ``specflow list`` too, with no traceback."""
    plugins = tmp_path / "plugins"   # (not the working directory, where it would shadow 'random' for torch itself)
    plugins.mkdir()
    for name in ("random", "drafters"):
        (plugins / f"{name}.py").write_text(SUFFIX_DRAFTER)
        run = python(f"""
            import sys
            from specflow.cli import main
            sys.exit(main(["list", "--plugin", {str(plugins / f"{name}.py")!r}]))
            """, cwd=tmp_path)
        assert run.returncode == 2, run.stderr
        assert f"its module name '{name}' is taken by" in run.stderr and "rename the file" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    run = python(f"""
        from specflow.registry import DRAFTERS, load_module
        load_module({str(plugins / "random.py")!r})
        """, cwd=tmp_path)
    assert "RegistryError: plugin" in run.stderr and "random.py" in run.stderr
    (tmp_path / "my_drafters.py").write_text(SUFFIX_DRAFTER)   # its own file, loaded twice (a re-run cell): fine
    run = python(f"""
        from specflow.registry import DRAFTERS, load_module
        load_module({str(tmp_path / "my_drafters.py")!r})
        load_module({str(tmp_path / "my_drafters.py")!r})
        print("echo" in DRAFTERS)
        """, cwd=tmp_path)
    assert run.stdout.strip() == "True", run.stderr


HALF_DRAFTER = textwrap.dedent('''
    from dataclasses import dataclass

    from specflow.protocols import TargetNeeds
    from specflow.registry import DRAFTERS


    @dataclass
    class HalfConfig:
        pass


    @DRAFTERS.register("half", config=HalfConfig)
    class HalfDrafter:
        needs = TargetNeeds()

        @classmethod
        def from_config(cls, cfg, **_):
            return cls()

        def begin(self, features): pass
        def expand(self, frontier): pass
        def commit(self, verdict, features): pass
''')


def test_a_class_without_a_method_of_its_contract_fails_when_it_registers(tmp_path):
    """A drafter without release() loaded, listed and ran through the baseline and its own warm-up,
    then failed at its first finished request (AttributeError)."""
    (tmp_path / "half_drafters.py").write_text(HALF_DRAFTER)
    run = python("""
        import sys
        from specflow.cli import main
        sys.exit(main(["list", "--plugin", "half_drafters.py"]))
        """, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "drafter 'half': HalfDrafter has no release, which the drafter contract asks for" in run.stderr


NO_LOSSLESS_VERIFIER = textwrap.dedent('''
    from dataclasses import dataclass

    from specflow.registry import VERIFIERS
    from verifiers.walk import exact_match


    @dataclass
    class NoLosslessConfig:
        pass


    @VERIFIERS.register("no_lossless", config=NoLosslessConfig)
    class NoLossless:   # (forgot: lossless = True)
        @classmethod
        def from_config(cls, cfg, **_):
            return cls()

        def verify(self, tree, target_logits, sampling):
            return exact_match(tree, target_logits, sampling)
''')


def test_a_component_without_an_attribute_of_its_contract_is_refused_before_the_run(tmp_path, tiny_target):
    """A verifier without ``lossless`` ran its whole pipeline, then the report's read of it stopped
    ``specflow run`` (AttributeError): the pipelines after it never ran and its own results were lost.
    Verifiers and trees are built when the config is checked, before the target loads: it fails there."""
    (tmp_path / "no_lossless.py").write_text(NO_LOSSLESS_VERIFIER)
    (tmp_path / "exp.yaml").write_text(f"""
name: tiny
output_dir: {tmp_path / 'runs'}
engine: {{target: {tiny_target}, device: cpu, dtype: float32, kv_cache_tokens: 4096}}
prompts: {{suite: builtin, categories: [code], per_category: 1}}
sampling: {{temperature: 0.0, max_tokens: 4, ignore_eos: true}}
pipelines:
  - {{name: forgetful, drafter: {{type: ngram}}, tree: {{type: chain, depth: 2}}, verifier: {{type: no_lossless}}}}
  - {{name: after, drafter: {{type: ngram}}, tree: {{type: chain, depth: 2}}, verifier: {{type: greedy}}}}
""")
    run = python("""
        import sys
        from specflow.cli import main
        sys.exit(main(["run", "exp.yaml", "--plugin", "no_lossless.py"]))
        """, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("specflow run: error: pipelines[forgetful].verifier: the NoLossless verifier "
                                 "has no lossless, which the verifier contract asks for"), run.stderr
    assert not (tmp_path / "runs" / "tiny" / "results.json").exists()   # (refused before the baseline ran)


def test_a_drafter_object_without_needs_is_named(tiny_target):
    """(an AttributeError from the feature feed before)"""
    import pytest

    from specflow import SpecEngine
    from specflow.config import ConfigError

    class Needless:
        def begin(self, features): pass
        def expand(self, frontier): pass
        def commit(self, verdict, features): pass
        def release(self, request_ids): pass

    with pytest.raises(ConfigError, match="drafter: the Needless drafter has no needs, which the drafter contract"):
        SpecEngine(tiny_target, Needless(), {"type": "chain"}, {"type": "greedy"}, device="cpu", dtype="float32")


def test_a_drafter_is_built_with_the_target_s_tokenizer(tmp_path, tiny_target):
    """A drafter that works on text (REST's retrieval store, a lookup in documents) gets the
    target's tokenizer from the engine, as it gets the vocabulary size."""
    (tmp_path / "my_drafters.py").write_text(SUFFIX_DRAFTER)
    run = python(f"""
        from specflow import SpecEngine
        from specflow.registry import load_module
        load_module("my_drafters.py")
        engine = SpecEngine({str(tiny_target)!r}, {{"type": "echo"}}, device="cpu", dtype="float32")
        print(engine.drafter.tokenizer is engine.tokenizer, engine.drafter.tokenizer.encode("def") == engine.encode("def"))
        """, cwd=tmp_path)
    assert run.stdout.split() == ["True", "True"], run.stderr


def test_an_entry_point_that_fails_to_load_is_tried_again_not_skipped(monkeypatch):
    """An entry point whose import raised left the plugins marked loaded: every later lookup then
    ran without the entry points after it (built-ins included), naming them unknown."""
    from specflow import registry

    loads = []

    class BrokenOnce:
        dist, value = None, "my_plugin"

        def load(self):
            loads.append(self)
            if len(loads) == 1:
                raise ImportError("a dependency of my_plugin is missing")
            return registry

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [BrokenOnce()])
    with pytest.raises(ImportError, match="my_plugin"):
        registry.load_plugins()
    registry.load_plugins()   # (the dependency installed meanwhile)
    assert len(loads) == 2


def test_a_verifier_whose_from_config_requires_the_context_is_checked_then_built_with_it(tmp_path, tiny_target):
    """The config check, before the target loads, has no context to give: a verifier that requires
    one (``vocab_size``) got a TypeError there; its keys are checked alone, and the engine builds it."""
    (tmp_path / "ctx_verifier.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from specflow.registry import VERIFIERS
        from verifiers.walk import exact_match

        @dataclass
        class CtxConfig:
            pass

        @VERIFIERS.register("needs_vocab", config=CtxConfig)
        class NeedsVocab:
            lossless = True

            def __init__(self, vocab_size):
                self.vocab_size = vocab_size

            @classmethod
            def from_config(cls, cfg, *, vocab_size, **_):
                return cls(vocab_size)

            def verify(self, tree, target_logits, sampling):
                return exact_match(tree, target_logits, sampling)
        '''))
    run = python(f"""
        from specflow import SpecEngine
        from specflow.config import ConfigError
        from specflow.registry import load_module
        load_module("ctx_verifier.py")
        engine = SpecEngine({str(tiny_target)!r}, {{"type": "ngram"}}, {{"type": "chain"}}, {{"type": "needs_vocab"}},
                            device="cpu", dtype="float32")
        print(engine.verifier.vocab_size)
        try:
            SpecEngine({str(tiny_target)!r}, {{"type": "ngram"}}, {{"type": "chain"}},
                       {{"type": "needs_vocab", "nope": 1}}, device="cpu", dtype="float32")
        except ConfigError as e:
            print("ConfigError", "nope" in str(e))
        """, cwd=tmp_path)
    assert run.stdout.split() == ["320", "ConfigError", "True"], run.stderr
