"""Components from outside specflow's packages: a module loaded by path or name registers its
drafters, and a module that shadows a built-in package is named rather than used."""

import subprocess
import sys
import textwrap

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
        def from_config(cls, cfg, vocab_size=None, **_):
            return cls(vocab_size=vocab_size)
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
