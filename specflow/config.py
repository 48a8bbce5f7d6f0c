"""Typed configuration: structured defaults <- YAML <- ``key=value`` overrides, in struct mode.

A component node is a mapping with a ``type`` key naming a registered component; the rest of
the node is validated against that component's config dataclass, so a misspelt key fails and
names the valid ones.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specflow.registry import Registry, RegistryError, load_plugins


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the valid choices."""


def _factory_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls``'s fields that have a default factory (nested dataclasses, lists, nodes)."""
    return {f.name: f.default_factory() for f in dataclasses.fields(cls)
            if f.default_factory is not dataclasses.MISSING}


def _check_keys(cls: type, node: DictConfig, where: str) -> None:
    """Fail on the first key that ``cls`` (or a nested dataclass field) does not declare, or whose
    value is a list where a mapping belongs (or the reverse)."""
    names, defaults = [f.name for f in dataclasses.fields(cls)], _factory_defaults(cls)
    for key in node.keys():
        if key not in names:
            raise ConfigError(f"{where}: unknown key '{key}'; valid keys: {', '.join(names) or '(none)'}")
        if key not in defaults:
            continue
        default, value = defaults[key], node[key]
        if value is not None and isinstance(default, list) != isinstance(value, ListConfig):
            kind = "a list" if isinstance(default, list) else "a mapping"
            raise ConfigError(f"{where}.{key}: expected {kind}, got {_show(value)}")
        if dataclasses.is_dataclass(default) and isinstance(value, DictConfig):
            _check_keys(type(default), value, f"{where}.{key}")


def _show(node: Any) -> str:
    """A config value as one line of YAML, for error messages."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node)
    return repr(yaml.safe_dump(node, default_flow_style=True, width=1 << 30).removesuffix("\n...\n").strip())


def validate(cls: type, node: Any, where: str) -> Any:
    """Merge ``node`` (mapping or DictConfig) over the defaults of dataclass ``cls`` in struct mode.

    Returns an instance of ``cls``. Unknown keys raise ConfigError naming the valid ones; nested
    component nodes (fields typed ``Any``) pass through untouched.
    """
    if node is None or isinstance(node, dict):
        node = OmegaConf.create(node or {})
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{where}: expected a mapping, got {_show(node)}")
    _check_keys(cls, node, where)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), node)
        for key in _component_fields(cls) & set(node.keys()):  # a node given replaces the default
            merged[key] = node[key]                            # whole: its own type, or none at all
        OmegaConf.set_struct(merged, True)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {e.msg if hasattr(e, 'msg') else e}") from None
    except ValueError as e:  # a value a dataclass's __post_init__ refuses: name the nested node that has it
        for key, default in _factory_defaults(cls).items():
            if key in node and dataclasses.is_dataclass(default):
                validate(type(default), node[key], f"{where}.{key}")
        raise ConfigError(f"{where}: {e}") from None
    return obj


def check_at_least(obj: Any, minimum: int, *names: str) -> None:
    """Raise ValueError naming the first of ``obj``'s fields ``names`` below ``minimum`` (None passes)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _component_fields(cls: type) -> set[str]:
    """The fields of ``cls`` that hold a component node (their default is a ``{type: ...}`` mapping)."""
    return {key for key, default in _factory_defaults(cls).items() if isinstance(default, dict) and "type" in default}


def component_config(registry: Registry, node: Any, where: str) -> tuple[type, Any]:
    """Resolve a ``{type: name, **params}`` node to ``(cls, validated config instance)``."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, str):
        node = {"type": node}
    if not isinstance(node, dict) or "type" not in node:
        raise ConfigError(f"{where}: a {registry.kind} node needs a 'type' key; "
                          f"known types: {', '.join(registry.names())}")
    params = dict(node)
    name = params.pop("type")
    try:
        load_plugins()   # a shadowed built-in package is not this node's fault: no '<where>.type' prefix
    except RegistryError as e:
        raise ConfigError(e.args[0]) from None
    try:
        cls, config_cls = registry.get(name)
    except KeyError as e:
        raise ConfigError(f"{where}.type: {e}") from None
    return cls, validate(config_cls, params, f"{where} ({registry.kind} '{name}')")


def build_component(registry: Registry, node: Any, where: str | None = None, **ctx: Any) -> Any:
    """Build a registered component from its config node; ``ctx`` is passed to ``from_config``."""
    where = where or registry.kind
    cls, cfg = component_config(registry, node, where)
    return cls.from_config(cfg, **ctx)


def load_yaml(path: str | Path, overrides: list[str] | None = None) -> DictConfig:
    """Read a YAML file and apply ``key=value`` dotlist overrides on top.

    An override merges into the node it names, except where it switches a component's type
    (``tree.type=chain``, or ``tree={type: static, preset: medusa_63}`` over another type, also
    inside a larger mapping: ``pipelines.0={drafter: {type: mine}}``): the node is then replaced,
    so the old type's keys do not carry over to the new one.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    given: set[str] = set()
    for override in overrides or []:
        key, eq, _ = override.partition("=")
        if not eq or not key:
            raise ConfigError(f"override '{override}' must look like key=value")
        if key in given:
            raise ConfigError(f"override {key} is given twice; give it once")
        given.add(key)
        _check_indices(cfg, key, override)
        try:  # (update, not merge: a key may index a list, as in pipelines.0.tree.depth=3)
            value = OmegaConf.select(OmegaConf.from_dotlist([override]), key)  # the value parsed as YAML
            parent, _, last = key.rpartition(".")
            if last == "type" and _switches_type(OmegaConf.select(cfg, parent) if parent else None, value):
                key, value = parent, {"type": value}
            old = OmegaConf.select(cfg, key)
            if isinstance(value, (dict, DictConfig)) and isinstance(old, DictConfig):
                value, merge = _merged(old, value), False  # (a component inside it whose type switches: replaced)
            else:
                merge = not (isinstance(value, (dict, DictConfig)) and "type" in value
                             and _switches_type(old, value["type"]))
            OmegaConf.update(cfg, key, value, merge=merge)
        except yaml.YAMLError as e:  # (a glob's * reads as a YAML alias, a leading % as a directive)
            raise ConfigError(f"override '{override}': the value is not valid YAML ({str(e).splitlines()[0]}); "
                              f"quote it: '{key}=\"{override.partition('=')[2]}\"'") from None
        except (OmegaConfBaseException, ValueError, TypeError) as e:
            raise ConfigError(f"override '{override}': {str(e).splitlines()[0]}") from None
    return cfg


def _check_indices(cfg: DictConfig, key: str, override: str) -> None:
    """An override's key that indexes past a list names the list and its indices."""
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig):
            node = node.get(part)
        elif isinstance(node, ListConfig) and part.lstrip("-").isdigit():
            if not -len(node) <= int(part) < len(node):
                raise ConfigError(f"override '{override}': {'.'.join(parts[:i])} has {len(node)} item(s) "
                                  f"(indices 0 to {len(node) - 1}, or -{len(node)} to -1)")
            node = node[int(part)]
        else:
            return


def _merged(old: Any, new: Any) -> Any:
    """``new`` merged into ``old`` as an override merges, but a mapping whose ``type`` switches a
    component's (at any depth: ``pipelines.0={drafter: {type: mine}}`` over another drafter)
    replaces that node, keys and all; lists and scalars replace."""
    if not isinstance(new, (dict, DictConfig)) or not isinstance(old, (dict, DictConfig)):
        return new
    if "type" in new and _switches_type(old, new["type"]):
        return new
    out = {k: old[k] for k in old.keys()} if isinstance(old, dict) else OmegaConf.to_container(old, resolve=False)
    for k, v in new.items():
        out[k] = _merged(out.get(k), v)
    return out


def _switches_type(node: Any, new_type: Any) -> bool:
    """Whether ``node`` is a component (a mapping with a ``type``, or a type name) of another type
    than ``new_type``."""
    old_type = node.get("type") if isinstance(node, (dict, DictConfig)) else node
    return isinstance(old_type, str) and old_type != new_type


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """Write a resolved config (dataclass, dict or DictConfig) as YAML."""
    if dataclasses.is_dataclass(cfg):
        cfg = dataclasses.asdict(cfg)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(cfg), resolve=True))
