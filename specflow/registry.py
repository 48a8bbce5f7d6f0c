"""Registries: the one place where component names map to classes.

Built-in components live in the ``drafters``, ``trees`` and ``verifiers`` packages and register
through the ``specflow.components`` entry-point group, exactly as a third-party plugin would::

    [project.entry-points."specflow.components"]
    my_drafters = "my_package.drafters"      # importing the module runs its @register calls

Each registered class carries a dataclass config (``config_cls``); ``from_config`` builds the
component from a validated instance of it.
"""

from __future__ import annotations

import dataclasses
import traceback
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

ENTRY_POINT_GROUP = "specflow.components"


class RegistryError(KeyError):
    """An unknown or duplicate component name."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class Registry:
    """A name -> (class, config dataclass) table for one kind of component.

    ``contract`` is the documentation of what a registered class must do; ``specflow list`` and
    error messages show it. ``methods`` are the contract's methods, checked on the class when it
    registers (a module that loads, ``--plugin``, fails at once); ``attributes`` the members a
    built component must have (class attributes or set in ``__init__``), checked by ``check_built``
    when a pipeline builds it, before it runs.
    """

    def __init__(self, kind: str, contract: str, methods: tuple[str, ...] = (), attributes: tuple[str, ...] = ()):
        self.kind = kind
        self.contract = contract
        self.methods, self.attributes = methods, attributes
        self._entries: dict[str, tuple[type, type]] = {}

    def register(self, name: str, config: type) -> Callable[[type], type]:
        """Class decorator: ``@DRAFTERS.register("ngram", config=NgramConfig)``.

        A class redefined under the same module and name (a re-run notebook cell, a reloaded
        module) replaces its earlier version; any other class under a taken name is an error.
        """
        assert dataclasses.is_dataclass(config), f"{name}: config must be a dataclass"

        def wrap(cls: type) -> type:
            missing = [m for m in self.methods if not callable(getattr(cls, m, None))]
            if missing:
                raise RegistryError(f"{self.kind} '{name}': {cls.__qualname__} has no {', '.join(missing)}, which the "
                                    f"{self.kind} contract asks for (see `specflow list`):\n{self.contract}")
            old = self._entries.get(name, (cls,))[0]
            if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise RegistryError(f"{self.kind} '{name}' is already registered "
                                    f"(by {old.__module__}.{old.__qualname__})")
            self._entries[name] = (cls, config)
            cls.config_cls = config
            cls.type_name = name
            return cls

        return wrap

    def get(self, name: str) -> tuple[type, type]:
        """Return ``(cls, config_cls)``; unknown names fail listing the known ones."""
        load_plugins()
        if name not in self._entries:
            raise RegistryError(f"unknown {self.kind} type '{name}'; known: {', '.join(self.names())} (a type of "
                                f"your own registers when its module is imported: --plugin FILE.py on the command "
                                f"line, or an entry point of the '{ENTRY_POINT_GROUP}' group)")
        return self._entries[name]

    def check_built(self, component: Any, where: str) -> None:
        """Raise ConfigError, naming ``where``, when a built component lacks a member of the contract
        (``attributes``): otherwise the engine, or the report after the whole run, would fail on it."""
        from specflow.config import ConfigError

        missing = [a for a in self.attributes if not hasattr(component, a)]
        if missing:
            raise ConfigError(f"{where}: the {type(component).__name__} {self.kind} has no {', '.join(missing)}, which "
                             f"the {self.kind} contract asks for (a class attribute, or set in __init__; see "
                             f"`specflow list`)")

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._entries


DRAFTERS = Registry("drafter", """\
A drafter answers "what could follow these tree nodes, and how likely?" (specflow.protocols.Drafter).
  needs: TargetNeeds            - the target features it reads (none, last hidden, layer taps)
  begin(features)               - new requests after prefill (TargetFeatures): build per-request state
  expand(frontier) -> Expansion - k children of each frontier node [B, F]: token ids in [0, V),
                                  log-probs [B, F, k] (-inf: no child), and with frontier.want_probs
                                  the full q [B, F, V] they were drawn from (a row that does not
                                  sum to 1 is read as its normalised law)
  commit(verdict, features)     - the accepted path of each request (+ its target features)
  release(request_ids)          - forget finished, cancelled or preempted requests (a preempted
                                  one is begun again later under the same id)
  from_config(cfg, **ctx)       - ctx: target (ModelRunner), vocab_size, device, dtype, runtime,
                                  tokenizer (the target's; None when it has none)""",
                    methods=("from_config", "begin", "expand", "commit", "release"), attributes=("needs",))

TREE_BUILDERS = Registry("tree", """\
A tree builder decides which nodes to expand and which to keep (specflow.protocols.TreeBuilder).
  num_draft_tokens              - node budget N per request, root included
  build(drafter, roots) -> DraftTree: calls drafter.expand as often as its search needs
                                  (trees.growth.GrowingTree grows one: expand / add / finish,
                                  its logscores and valid [B, cols] say what it holds so far;
                                  a builder that knows a bound on the children a walk may try
                                  sets the tree's max_tries, as trees/static.py does); every tree
                                  has N nodes (pad with DraftTree.pad_to) and its mask filled
                                  (DraftTree.with_mask); sampled nodes' q in draft_probs
  from_config(cfg, **ctx)       - the builder from its validated config (ctx as for drafters)""",
                        methods=("from_config", "build"), attributes=("num_draft_tokens",))

VERIFIERS = Registry("verifier", """\
A verifier accepts a path of the draft tree against the target (specflow.protocols.Verifier).
  lossless: bool                - True when the output distribution equals the target's (declared,
                                  not checked: specflow.bench.distribution.check_lossless tests it)
  verify(tree, target_logits, sampling) -> Verdict: accepted [B, D + 1] node indices (root
                                  first; entries past accept_len + 1 are not read, the shipped
                                  walks put -1), accept_len [B], bonus token [B];
                                  target_logits [B, N, V] are every node's, penalties applied
                                  (target_probs processes them); a target draw at a node of
                                  depth d uses sampling.draws(D, device)[:, d] (next_tokens' default is
                                  the root's: one uniform at every depth is lossy), so seeded
                                  runs reproduce plain decoding;
                                  a walk that tests drafts with coins (sampling.coins) takes
                                  sampling = sampling.coin_walk() first, for its coins and bonus
                                  draws alike (else lossy with a drafter that learns across requests)
  from_config(cfg, **ctx)       - the verifier from its validated config (ctx as for drafters)""",
                    methods=("from_config", "verify"), attributes=("lossless",))

ALL = {"drafter": DRAFTERS, "tree": TREE_BUILDERS, "verifier": VERIFIERS}

_plugins_loaded = False


def load_plugins() -> None:
    """Import every module of the ``specflow.components`` entry-point group (once). specflow's
    own packages (``drafters``, ``trees``, ``verifiers``) must be the ones that load: a module of
    the same name found first on ``sys.path`` (a ``drafters.py`` beside a script) is an error."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True   # (first: a plugin's import may look a component up)
    home = Path(__file__).resolve().parent.parent   # where specflow's built-in packages live
    try:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            module = ep.load()
            where = Path(getattr(module, "__file__", None) or home).resolve()   # (a package: its __init__.py)
            if ep.dist is not None and ep.dist.name == "specflow" and where.parent != home / ep.value:
                raise RegistryError(f"'{ep.value}' was imported from {where}, which is not specflow's built-in "
                                    f"{ep.value} package (in {home}): a module of that name earlier on sys.path "
                                    f"(e.g. the script's folder or the working directory) shadows it; rename it")
    except BaseException:   # (a shadowed or failing entry point: the next lookup tries them all again)
        _plugins_loaded = False
        raise


def load_module(spec: str) -> None:
    """Import a module of components that registers itself (``@DRAFTERS.register(...)``), without
    packaging it: a ``.py`` file path, or a module name importable from the working directory."""
    import importlib
    import importlib.util
    import sys

    if spec.endswith(".py"):
        path = Path(spec).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"plugin {spec}: no such file")
        taken = _module_file(path.stem)
        if taken is not None and taken != path:   # (sys.modules would hand every later import of it this file)
            raise RegistryError(f"plugin {spec}: its module name '{path.stem}' is taken by {taken}, which "
                                f"every later 'import {path.stem}' would then get instead: rename the file")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # (its own import, a syntax error, a duplicate name: named, not a traceback)
            sys.modules.pop(path.stem, None)   # no half-imported module left to shadow a fixed copy
            raise RegistryError(f"plugin {spec}: {_import_error(e, path)}") from e
        return
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        importlib.import_module(spec)
    except Exception as e:
        raise RegistryError(f"plugin {spec}: {_import_error(e, None)}") from e


def _import_error(e: Exception, path: Path | None) -> str:
    """``Type: message`` of an exception raised importing a plugin, with the plugin's line that
    raised it (a syntax error names its own)."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, SyntaxError) or isinstance(e, RegistryError) and str(e).startswith("plugin "):
        return text
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if path is None or Path(f.filename).resolve() == path]
    if frames and not frames[-1].filename.startswith("<"):
        text += f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})"
    return text


def _module_file(name: str) -> Path | None:
    """The file of the module ``name`` already imported or importable (a built-in: its name), else None."""
    import importlib.util
    import sys

    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None) or f"<built-in module {name}>"
    else:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if found is None or found.origin is None:   # (nothing, or a namespace package: nothing to replace)
            return None
        origin = found.origin
    return Path(origin).resolve() if not origin.startswith("<") and origin not in ("built-in", "frozen") \
        else Path(f"<built-in module {name}>")


def plugin_sources() -> dict[str, str]:
    """``{file: sha256}`` of every module outside specflow's own packages that registered a
    component (``--plugin`` files, entry-point packages): what an experiment's numbers came from."""
    import hashlib
    import sys

    load_plugins()
    home = Path(__file__).resolve().parent.parent
    builtin = [home / package for package in ("specflow", "drafters", "trees", "verifiers")]
    sources = {}
    for registry in ALL.values():
        for cls, _ in registry._entries.values():
            file = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if file is None or any(Path(file).resolve().is_relative_to(b) for b in builtin):
                continue
            sources[str(Path(file).resolve())] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    return dict(sorted(sources.items()))


def describe(cls: type) -> list[tuple[str, str, Any]]:
    """``(name, type, default)`` of each parameter of a component's config dataclass."""
    rows = []
    for f in dataclasses.fields(cls.config_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "???"
        rows.append((f.name, getattr(f.type, "__name__", str(f.type)), default))
    return rows
