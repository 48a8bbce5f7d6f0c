"""An experiment YAML: a target, a prompt suite, sampling and the pipelines to compare, validated
before anything loads (``specflow run``, ``sweep``, the app)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specflow.config import ConfigError, load_yaml, validate
from specflow.pipeline import EngineConfig, Pipeline, check_runtime, resolve_device
from specflow.sampling import SamplingParams


@dataclass
class PromptsConfig:
    suite: str = "builtin"                 # "builtin" or a path to a question.jsonl
    categories: list[str] | None = None
    per_category: int | None = None
    chat_template: bool = False            # wrap prompts with the tokenizer's chat template
    # turns of each question (Spec-Bench runs MT-bench's 2): turn t is the chat so far, with this
    # pipeline's own answers, then the question's next user turn; beyond 1 it needs chat_template
    turns: int = 1


@dataclass
class PipelineConfig:
    name: str = "???"
    drafter: Any = None
    tree: Any = field(default_factory=lambda: {"type": "chain"})
    verifier: Any = field(default_factory=lambda: {"type": "rejection"})


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    seed: int = 0
    ignore_eos: bool = False
    frequency_penalty: float = 0.0   # these four: SamplingParams' (specflow.penalties)
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0


@dataclass
class ExperimentConfig:
    """An experiment: a target, a prompt suite, sampling, and the pipelines to compare."""

    name: str = "experiment"
    engine: EngineConfig = field(default_factory=EngineConfig)
    pipelines: list[Any] = field(default_factory=list)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    batch_size: int = 1                    # requests in flight together
    # untimed rounds before each pipeline, on seeded random token ids as long as the longest prompt
    # (same sampling and max_tokens), each round a batch of batch_size (with CUDA graphs, a batch per
    # graph batch size up to batch_size): never a suite prompt, which a drafter that learns across
    # requests (ngram scope: global) would then have seen before it is timed
    warmup: int = 1
    # timed runs of the suite per pipeline (baseline included), each on a fresh engine: a batch's
    # time is its fastest run's (best of n, as timing noise only ever adds); outputs are the last's
    repeats: int = 1
    output_dir: str = "runs"


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> tuple[ExperimentConfig, list[PipelineConfig]]:
    """Validate an experiment YAML (+ overrides); pipelines are validated node by node."""
    raw = load_yaml(path, overrides)
    cfg = validate(ExperimentConfig, raw, "experiment")
    if isinstance(cfg.engine, dict):
        cfg.engine = validate(EngineConfig, cfg.engine, "engine")
    for key in ("drafter", "tree", "verifier"):
        if key in raw.get("engine", {}):
            raise ConfigError(f"engine.{key}: an experiment sets it per pipeline (pipelines[].{key})")
    pipelines = [validate(PipelineConfig, p, f"pipelines[{i}]") for i, p in enumerate(cfg.pipelines)]
    for p in pipelines:  # fail on a bad node now, not after the target has loaded and the baseline run
        defaults = PipelineConfig()  # (a null tree or verifier runs the default: results name it)
        p.tree = defaults.tree if p.tree is None else p.tree
        p.verifier = defaults.verifier if p.verifier is None else p.verifier
        Pipeline.check(p.drafter, p.tree, p.verifier, f"pipelines[{p.name}].")
    names = [p.name for p in pipelines]
    if len(set(names)) != len(names) or "baseline" in names:
        raise ConfigError(f"pipelines: names must be unique and not 'baseline', got {names}")
    if cfg.prompts.per_category is not None and cfg.prompts.per_category < 1:  # (0 would select every question)
        raise ConfigError(f"prompts.per_category: {cfg.prompts.per_category}; at least 1, or null for every "
                          "question of each category")
    if cfg.prompts.categories is not None and not cfg.prompts.categories:
        raise ConfigError("prompts.categories: an empty list; name the categories to run, or null for all")
    if cfg.prompts.turns < 1 or (cfg.prompts.turns > 1 and not cfg.prompts.chat_template):
        raise ConfigError(f"prompts.turns: {cfg.prompts.turns}; at least 1, and a later turn continues a chat, "
                          "so more than 1 needs prompts.chat_template=true")
    if cfg.batch_size < 1 or cfg.warmup < 0 or cfg.repeats < 1:
        raise ConfigError(f"batch_size and repeats must be >= 1 and warmup >= 0, got {cfg.batch_size}, "
                          f"{cfg.repeats} and {cfg.warmup}")
    e = cfg.engine
    check_runtime(e.backend, e.page_size, e.kv_cache_tokens, cfg.batch_size, e.spec_max_batch_size,
                  e.max_prefill_tokens)
    resolve_device(e.device, e.dtype)
    try:
        sampling_params(cfg.sampling, 0)
    except ValueError as e:
        raise ConfigError(f"sampling: {e}") from None
    return cfg, pipelines


def sampling_params(sampling: SamplingConfig, i: int) -> SamplingParams:
    """Prompt ``i``'s SamplingParams (seed ``sampling.seed + i``)."""
    return SamplingParams(**dict(dataclasses.asdict(sampling), seed=sampling.seed + i))
