"""Pipeline graphs: drafter -> tree builder -> verifier, built from config nodes."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specflow.config import ConfigError, build_component, component_config, load_yaml, validate
from specflow.protocols import Drafter, TreeBuilder, Verifier
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS
from specflow.runtime.attention import BACKENDS
from specflow.tree import DraftTree, Roots, Verdict


@dataclass
class EngineConfig:
    """Everything ``SpecEngine`` needs; the top level of an engine YAML.

    ``drafter: null`` is plain autoregressive decoding. ``spec_max_batch_size`` turns
    speculation off for steps whose batch is larger (None: never). ``max_prefill_tokens`` bounds
    the prompt tokens one step prefills (a longer prompt is prefilled in chunks over several
    steps; None: no bound).
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
    prefix_caching: bool = False   # share the KV of common prompt prefixes between requests (serving)
    cuda_graphs: bool | None = None
    record_steps: bool = False
    check_drafts: bool = False     # check every drafted tree (structure, token ids, q) and verdict: for new components


def engine_config_from_yaml(path: str | Path, overrides: list[str] | None = None,
                            pipeline: str | None = None) -> EngineConfig:
    """The EngineConfig of a YAML (``SpecEngine.from_yaml``): a bare engine file, a serve file's
    ``engine:`` section, or an experiment's with its pipeline named ``pipeline`` ("baseline":
    plain decoding), whose drafter, tree and verifier replace the engine's."""
    cfg = load_yaml(path, overrides)
    names = [str(p.get("name")) for p in cfg.get("pipelines") or []]
    if pipeline is not None and not names:
        raise ConfigError(f"pipeline: '{pipeline}', but {path} has no pipelines (it is no experiment)")
    if "engine" not in cfg:
        return validate(EngineConfig, cfg, "engine")
    # an experiment or serve file: overrides must reach what is built from it
    stray = [o for o in overrides or [] if not o.startswith(("engine.", "pipelines."))]
    if stray:
        raise ConfigError(f"override '{stray[0]}' does not reach the engine; write engine.{stray[0]}")
    if names and pipeline is None:
        raise ConfigError(f"{path} is an experiment: pass pipeline= one of {', '.join(names)}, baseline "
                          f"(its drafter, tree and verifier join the engine section)")
    node = OmegaConf.to_container(cfg.engine, resolve=True)
    if pipeline == "baseline":  # (whatever drafter an override gave the engine section)
        node["drafter"] = None
    elif pipeline is not None:
        if pipeline not in names:
            raise ConfigError(f"pipeline: '{pipeline}' is not one of {', '.join(names)}, baseline")
        chosen = OmegaConf.to_container(cfg.pipelines[names.index(pipeline)], resolve=True)
        node |= {key: chosen.get(key) for key in ("drafter", "tree", "verifier")}
    return validate(EngineConfig, node, "engine")


def resolve_device(device: str, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """``"auto"`` picks cuda + bfloat16 when a GPU is present, else cpu + float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device: '{device}' is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ConfigError(f"device: '{device}', but torch sees {torch.cuda.device_count()} CUDA device(s) "
                          f"(torch {torch.__version__}); use device: cpu or auto")
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: '{dtype}' is not one of auto, float32, bfloat16, float16")
        dtype = getattr(torch, dtype)
    return device, dtype


def check_runtime(backend: str, page_size: int, kv_cache_tokens: int, max_batch_size: int,
                  spec_max_batch_size: int | None, max_prefill_tokens: int | None) -> None:
    """Fail on a bad runtime setting before the target loads."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: '{backend}' is not one of {', '.join(BACKENDS)}")
    for key, value in (("page_size", page_size), ("kv_cache_tokens", kv_cache_tokens),
                       ("max_batch_size", max_batch_size)):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if spec_max_batch_size is not None and spec_max_batch_size < 0:
        raise ConfigError(f"spec_max_batch_size must be >= 0 or null, got {spec_max_batch_size}")
    if max_prefill_tokens is not None and max_prefill_tokens < 1:
        raise ConfigError(f"max_prefill_tokens must be >= 1 or null (no bound), got {max_prefill_tokens}")


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
    def check(drafter: Any, tree: Any, verifier: Any, where: str = "") -> None:
        """Fail on a bad config node before anything loads: every key and type, the tree's and the
        verifier's values (built with no context and dropped: it costs nothing; ``from_config``
        builds them again with the engine's; one whose ``from_config`` requires a context
        argument gets its keys and types checked alone), and the drafter's files. Components
        already built are checked against their contract alone."""
        for registry, node, key in ((TREE_BUILDERS, tree, "tree"), (VERIFIERS, verifier, "verifier")):
            if node is None:
                continue
            if not isinstance(node, (str, dict, DictConfig)):  # already built
                registry.check_built(node, where + key)
                continue
            try:
                cls, cfg = component_config(registry, node, where + key)
                if not _needs_context(cls):
                    registry.check_built(cls.from_config(cfg), where + key)
            except ConfigError:
                raise
            except ValueError as e:  # a value the component refuses
                raise ConfigError(f"{where}{key}: {e}") from None
        _check_drafter(drafter, where + "drafter")

    def check_tree(self, tree: DraftTree, roots: Roots, vocab_size: int, full: bool = False) -> None:
        """Refuse a drafted tree, naming the drafter and tree builder: a tree without its mask, of
        another node count than the builder's ``num_draft_tokens`` (what the KV cache, the
        scheduler and CUDA graphs reserve), or with q over another vocabulary; where the tree lies
        on the host (a CPU run), also a broken structure (DraftTree.check), token ids outside the
        vocabulary, or another root than the request's last committed token at its position
        (always: no wait; a wrong root, depth, position or mask silently changes the output). With
        ``full`` (``check_drafts``), those wherever the tree lies, its drafts' q (finite,
        non-negative, and with mass on every sampled node's token at its parent), and a
        ``max_tries`` below the children a walk can try, each read back from the device (a wait
        per step: for developing drafters, not for timing them)."""
        where = f"the {type(self.drafter).__name__} drafter with the {type(self.tree).__name__}"
        if tree.mask is None:
            raise ValueError(f"{where} returned a tree without its mask (DraftTree.mask, the ancestor-or-self "
                             f"mask the target attends with): fill it with tree.with_mask(), as "
                             f"GrowingTree.finish does")
        if tree.num_nodes != self.tree.num_draft_tokens:
            raise ValueError(f"{where} built trees of {tree.num_nodes} nodes, but its num_draft_tokens is "
                             f"{self.tree.num_draft_tokens} (N, root included: what the KV cache and CUDA graphs "
                             f"reserve per tree); pad them to N (DraftTree.pad_to) or say N")
        q = tree.draft_probs
        if q is not None and q.shape[-1] != vocab_size:
            raise ValueError(f"{where} returned draft probabilities q over {q.shape[-1]} tokens; the target's "
                             f"vocabulary has {vocab_size}")
        if full or tree.tokens.device.type == "cpu":  # (an accelerator's: only with check_drafts, a wait)
            try:
                tree.check()
            except ValueError as e:
                raise ValueError(f"{where} built an invalid draft tree: {e}") from None
            tokens = tree.tokens[tree.valid]
            if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
                raise ValueError(f"{where} drafted token ids outside [0, {vocab_size}) (the target's vocabulary): "
                                 f"min {int(tokens.min())}, max {int(tokens.max())}")
            for name, built, want in (("token", tree.tokens[:, 0], roots.tokens),
                                      ("position", tree.positions[:, 0], roots.positions)):
                built, want = built.cpu().long(), want.cpu().long()
                if not torch.equal(built, want):
                    raise ValueError(f"{where} built a tree whose root {name}s are {built.tolist()}; the requests' "
                                     f"roots (Roots.{name}s: the last committed token, at seq_len - 1) are "
                                     f"{want.tolist()}")
        if not full:
            return
        if tree.max_tries is not None and (most := int(tree.walk_tries().max())) > tree.max_tries:
            raise ValueError(f"{where} built a tree whose walk from the root can try {most} children, but its "
                             f"max_tries is {tree.max_tries}: the rejection walk would stop short of drafts it "
                             f"holds (still lossless, but they are never tried)")
        n = tree.num_nodes
        if q is not None and not bool((torch.isfinite(q) & (q >= 0)).all()):
            raise ValueError(f"{where} returned draft probabilities q with NaN, infinite or negative entries")
        if q is not None and n > 1:
            drawn = (tree.sampled & tree.valid)[:, 1:]                                   # [B, N - 1]
            b, v = q.shape[0], q.shape[-1]
            at_parent = q.reshape(b, -1).gather(1, tree.parents[:, 1:].clamp(min=0) * v
                                                + tree.tokens[:, 1:].clamp(0, v - 1))  # [B, N - 1]
            if bool((drawn & (at_parent <= 0)).any()):
                raise ValueError(f"{where} marked nodes sampled (drawn from q at their parent) whose tokens "
                                 f"have q = 0 there: the rejection rule would accept them whatever the target")

    def check_verdict(self, tree: DraftTree, verdict: Verdict, vocab_size: int, full: bool = False) -> None:
        """Refuse a verdict, naming the verifier: of other shapes than [B, D + 1], [B], [B] or not
        of integer ids (host-known: always, no wait); with ``full`` (``check_drafts``), also one
        that is not a path of the tree: ``accepted[b]`` starts at the root and each next node is
        a valid child of the one before, ``accept_len[b]`` counts that path's drafts, and the
        bonus token is in the vocabulary (each read back from the device)."""
        where = f"the {type(self.verifier).__name__} verifier"
        accepted, accept_len, bonus = verdict.accepted, verdict.accept_len, verdict.bonus_tokens
        b, n = tree.batch_size, tree.num_nodes
        if accepted.dim() != 2 or accepted.shape[0] != b or accept_len.shape != (b,) or bonus.shape != (b,):
            raise ValueError(f"{where} returned a verdict of shapes accepted {tuple(accepted.shape)}, accept_len "
                             f"{tuple(accept_len.shape)}, bonus_tokens {tuple(bonus.shape)}; the tree has B = {b} "
                             f"requests: [B, D + 1], [B] and [B]")
        dtypes = [t.dtype for t in (accepted, accept_len, bonus)]
        if any(d.is_floating_point or d.is_complex or d == torch.bool for d in dtypes):
            raise ValueError(f"{where} returned a verdict of dtypes accepted {dtypes[0]}, accept_len {dtypes[1]}, "
                             f"bonus_tokens {dtypes[2]}; they are node indices, counts and token ids: torch.long")
        if not full:
            return
        accepted, accept_len, bonus = accepted.cpu(), accept_len.cpu(), bonus.cpu()
        parents, valid = tree.parents.cpu().tolist(), tree.valid.cpu().tolist()
        for r, (path, length, token) in enumerate(zip(accepted.tolist(), accept_len.tolist(), bonus.tolist())):
            if not 0 <= length < len(path):
                raise ValueError(f"{where} returned accept_len {length} for request row {r}, whose accepted path "
                                 f"holds {len(path)} entries (root included)")
            if path[0] != 0:
                raise ValueError(f"{where} returned an accepted path {path} for request row {r}: it must start "
                                 f"at the root, node 0")
            for i in range(1, length + 1):
                node = path[i]
                if not (0 < node < n and valid[r][node] and parents[r][node] == path[i - 1]):
                    raise ValueError(f"{where} returned an accepted path {path[:length + 1]} (accept_len {length}) "
                                     f"for request row {r}: node {node} is not a valid child of node {path[i - 1]}")
            if not 0 <= token < vocab_size:
                raise ValueError(f"{where} returned bonus token {token} for request row {r}, outside [0, "
                                 f"{vocab_size}) (the target's vocabulary)")

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


def _needs_context(cls: type) -> bool:
    """Whether ``cls.from_config`` requires an argument past its config (one of the context's)."""
    params = list(inspect.signature(cls.from_config).parameters.values())[1:]
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _build(registry, node: Any, where: str, ctx: dict) -> Any:
    """A config node (mapping, DictConfig or type name) is built; a component object passes through."""
    if isinstance(node, (str, dict, DictConfig)):
        component = build_component(registry, node, where, **ctx)
    else:
        component = node
    registry.check_built(component, where)
    return component
