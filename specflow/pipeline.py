"""Pipeline graphs: drafter -> tree builder -> verifier, built from config nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specflow.config import ConfigError, build_component, component_config
from specflow.protocols import Drafter, TreeBuilder, Verifier
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS


@dataclass
class EngineConfig:
    """Everything ``SpecEngine`` needs; the top level of an engine YAML.

    ``drafter: null`` is plain autoregressive decoding. ``spec_max_batch_size`` turns
    speculation off for steps whose batch is larger (None: never). ``max_prefill_tokens`` bounds
    the prompt tokens one step prefills (a longer prompt runs alone; None: no bound).
    ``cuda_graphs`` replays decode and verification steps from CUDA graphs (None: on when the
    device is CUDA).
    """

    target: str = "???"
    drafter: Any = None
    tree: Any = field(default_factory=lambda: {"type": "chain"})
    verifier: Any = field(default_factory=lambda: {"type": "rejection"})
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"          # torch | flashinfer | auto (flashinfer on CUDA when it can serve the model)
    page_size: int = 1
    kv_cache_tokens: int = 65536
    max_batch_size: int = 32
    spec_max_batch_size: int | None = None
    max_prefill_tokens: int | None = 16384
    cuda_graphs: bool | None = None
    record_steps: bool = False
    check_drafts: bool = False     # check every drafted tree (structure, token ids, q): for new drafters


@dataclass
class Pipeline:
    """A speculative pipeline; ``drafter is None`` means plain decoding (the root-only tree)."""

    drafter: Drafter | None
    tree: TreeBuilder | None
    verifier: Verifier

    @staticmethod
    def from_config(drafter: Any, tree: Any, verifier: Any, **ctx: Any) -> "Pipeline":
        """Build the graph from config nodes (or already built components, used as they are);
        ``ctx`` (target runner, vocab size, ...) reaches every component's ``from_config``."""
        if verifier is None:
            raise ConfigError("verifier: a verifier node is required; known types: "
                              + ", ".join(VERIFIERS.names()))
        built_verifier = _build(VERIFIERS, verifier, "verifier", ctx)
        if drafter is None:
            return Pipeline(None, None, built_verifier)
        if tree is None:
            raise ConfigError("tree: a drafter needs a tree node; known types: "
                              + ", ".join(TREE_BUILDERS.names()))
        return Pipeline(_build(DRAFTERS, drafter, "drafter", ctx), _build(TREE_BUILDERS, tree, "tree", ctx),
                        built_verifier)

    @staticmethod
    def check(drafter: Any, tree: Any, verifier: Any, where: str = "") -> tuple[Any, Any]:
        """Fail on a bad config node before anything loads: every key and type, the tree's and the
        verifier's values (built with no context: it costs nothing), and the drafter's files. Returns the
        tree and verifier built (for ``from_config``); components already built pass unchecked."""
        built = []
        for registry, node, key in ((TREE_BUILDERS, tree, "tree"), (VERIFIERS, verifier, "verifier")):
            try:
                built.append(_build(registry, node, where + key, {}) if node is not None else None)
            except ConfigError:
                raise
            except ValueError as e:  # a value the component refuses
                raise ConfigError(f"{where}{key}: {e}") from None
        _check_drafter(drafter, where + "drafter")
        return built[0], built[1]

    def describe(self) -> str:
        if self.drafter is None:
            return "autoregressive"
        return f"{self.drafter.type_name} x {self.tree.type_name} x {self.verifier.type_name}"


def _check_drafter(node: Any, where: str) -> None:
    """A drafter node's keys, types and files, and those of a combinator's children."""
    if not isinstance(node, (str, dict, DictConfig)):
        return
    _, cfg = component_config(DRAFTERS, node, where)
    for name in ("path", "token_map"):  # (the drafters' files, read when the target has loaded)
        value = getattr(cfg, name, None)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{where}.{name}: {value} does not exist")
    for i, child in enumerate(getattr(cfg, "drafters", None) or []):  # union / fallback
        _check_drafter(child, f"{where}.drafters[{i}]")


def _build(registry, node: Any, where: str, ctx: dict) -> Any:
    """A config node (mapping, DictConfig or type name) is built; a component object passes through."""
    if isinstance(node, (str, dict, DictConfig)):
        return build_component(registry, node, where, **ctx)
    return node
