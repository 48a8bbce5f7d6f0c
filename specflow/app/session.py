"""What the app runs, without the UI: the pipeline catalog, editable pipeline forms, one engine per
pipeline over a shared target, and generation streamed one engine step at a time."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specflow.app.stats import RunStats
from specflow.bench.experiment_config import PipelineConfig, SamplingConfig, load_experiment
from specflow.config import ConfigError, component_config, load_yaml
from specflow.engine import SpecEngine
from specflow.models import CheckpointError, load_model, load_tokenizer
from specflow.pipeline import EngineConfig, resolve_device
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS, RegistryError, describe
from specflow.sampling import SamplingParams
from specflow.tree import StepRecord

log = logging.getLogger(__name__)

ZOO_TARGET = Path("zoo/tiny-code/target")     # the shipped target: the default without a CONFIG
CONFIG_DIR = Path("configs")
MAIN_TREE_PARAMS = ("depth", "topk", "num_draft_tokens")
NO_DRAFTER = "none"
# errors a user can cause by a config, a checkpoint path or a prompt; shown as messages
USER_ERRORS = (ConfigError, CheckpointError, RegistryError, ValueError, OSError)

PLAIN = PipelineConfig("plain decoding", None, {"type": "chain"}, {"type": "rejection"})


@dataclass
class Catalog:
    """The app's target, default sampling, and the pipelines its picker offers (label -> pipeline)."""

    engine: EngineConfig
    sampling: SamplingConfig
    pipelines: dict[str, PipelineConfig]
    notes: list[str] = field(default_factory=list)   # experiment YAMLs that could not be read, and why


def load_catalog(config: str | Path | None = None, config_dir: Path = CONFIG_DIR) -> Catalog:
    """Pipelines of ``config`` (an experiment YAML; it also names the target) first, then those of
    every experiment in ``config_dir``, then plain decoding. A broken ``config`` raises ConfigError;
    a broken file in ``config_dir`` becomes a note."""
    pipelines: dict[str, PipelineConfig] = {}
    notes = []
    if config is not None:
        cfg, own = load_experiment(config)
        engine, sampling = cfg.engine, cfg.sampling
        pipelines.update({f"{cfg.name} / {p.name}": p for p in own})
    else:
        engine, sampling = EngineConfig(target=str(ZOO_TARGET), kv_cache_tokens=8192), SamplingConfig()
    for path in sorted(config_dir.glob("*.yaml")) if config_dir.is_dir() else []:
        if config is not None and path.resolve() == Path(config).resolve():
            continue
        try:
            if "pipelines" not in load_yaml(path):
                continue                                  # a serve or train config
            cfg, own = load_experiment(path)
        except (ConfigError, yaml.YAMLError) as e:
            notes.append(f"{path}: {e}")
            continue
        pipelines.update({f"{cfg.name} / {p.name}": p for p in own})
    pipelines[PLAIN.name] = PLAIN
    engine = dataclasses.replace(engine, record_steps=True)
    return Catalog(engine, sampling, pipelines, notes)


def _params_text(params: dict) -> str:
    return yaml.safe_dump(params, default_flow_style=True, sort_keys=False, width=10_000).strip()


def _parse_params(text: str, where: str) -> dict:
    try:
        value = yaml.safe_load(text or "") or {}
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", e)
        raise ConfigError(f"{where}: not valid YAML ({problem}); write e.g. {{max_window: 3}}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping like {{max_window: 3}}, got {text!r}")
    return value


def tree_param_defaults(tree_type: str) -> dict[str, int]:
    """Defaults of the main tree parameters (depth, topk, num_draft_tokens) the tree type declares."""
    cls, _ = TREE_BUILDERS.get(tree_type)
    return {name: default for name, _, default in describe(cls) if name in MAIN_TREE_PARAMS}


@dataclass
class PipelineForm:
    """One pipeline as the app's fields show it: component types, the main tree parameters as
    numbers, everything else as a YAML mapping per component."""

    name: str
    drafter_type: str = NO_DRAFTER
    drafter_params: str = "{}"
    tree_type: str = "chain"
    depth: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    tree_params: str = "{}"
    verifier_type: str = "rejection"
    verifier_params: str = "{}"

    @classmethod
    def from_pipeline(cls, p: PipelineConfig) -> "PipelineForm":
        drafter = dict(p.drafter) if p.drafter else None
        tree = dict(p.tree or {"type": "chain"})
        verifier = dict(p.verifier or {"type": "rejection"})
        tree_type = tree.pop("type")
        numbers = tree_param_defaults(tree_type) | {k: tree.pop(k) for k in MAIN_TREE_PARAMS if k in tree}
        return cls(p.name, drafter.pop("type") if drafter else NO_DRAFTER, _params_text(drafter or {}),
                   tree_type, numbers.get("depth"), numbers.get("topk"), numbers.get("num_draft_tokens"),
                   _params_text(tree), verifier.pop("type"), _params_text(verifier))

    def to_pipeline(self) -> PipelineConfig:
        """The pipeline these fields describe; every node validated (ConfigError naming the field).
        Without a drafter it is plain decoding, whatever the (hidden) tree and verifier fields hold."""
        if self.drafter_type == NO_DRAFTER:
            return dataclasses.replace(PLAIN, name=self.name)
        drafter = {"type": self.drafter_type, **_parse_params(self.drafter_params, "drafter params")}
        component_config(DRAFTERS, drafter, "drafter")
        try:
            declared = tree_param_defaults(self.tree_type)
        except RegistryError as e:
            raise ConfigError(f"tree.type: {e}") from None
        numbers = {k: int(getattr(self, k)) for k in declared if getattr(self, k) is not None}
        tree = {"type": self.tree_type, **numbers, **_parse_params(self.tree_params, "tree params")}
        verifier = {"type": self.verifier_type, **_parse_params(self.verifier_params, "verifier params")}
        component_config(TREE_BUILDERS, tree, "tree")
        component_config(VERIFIERS, verifier, "verifier")
        return PipelineConfig(self.name, drafter, tree, verifier)


class EnginePool:
    """Engines over one target loaded once: one per pipeline (the last ``max_engines`` kept; a
    second for a pipeline that two lanes run at once), and plain decoding's tokens/s and tokens
    per prompt and sampling parameters, kept for the speedup."""

    def __init__(self, engine: EngineConfig, max_engines: int = 6):
        self.cfg = engine
        self.max_engines = max_engines
        self.device, self.dtype = resolve_device(engine.device, engine.dtype)
        self.model = load_model(engine.target, device=self.device, dtype=self.dtype)
        self.tokenizer = load_tokenizer(engine.target)
        self._engines: OrderedDict[str, SpecEngine] = OrderedDict()
        self._baselines: dict[tuple[str, str], tuple[float, list[int]]] = {}
        self._texts: dict[int, str] = {}

    def engine(self, p: PipelineConfig, busy: tuple[SpecEngine, ...] = ()) -> SpecEngine:
        """The warmed-up engine of pipeline ``p`` (built on first use), other than those ``busy``:
        two lanes on one engine would take each other's finished requests."""
        pipeline = json.dumps([p.drafter, p.tree, p.verifier], sort_keys=True, default=str)
        key = next(k for k in (f"{pipeline}#{copy}" for copy in itertools.count()) if self._engines.get(k) not in busy)
        if key not in self._engines:
            kwargs = dataclasses.asdict(self.cfg) | {"drafter": p.drafter, "tree": p.tree, "verifier": p.verifier}
            del kwargs["target"]
            engine = SpecEngine(self.model, tokenizer=self.tokenizer, **kwargs)
            # first steps pay one-time costs (allocations, kernel selection): keep them out of tokens/s
            engine.generate([list(range(8))], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            self._engines[key] = engine
            while len(self._engines) > self.max_engines:
                self._engines.popitem(last=False)
        self._engines.move_to_end(key)
        return self._engines[key]

    def token_text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer else f"<{token_id}>"
        return self._texts[token_id]

    def cached_baseline(self, prompt: str, params: SamplingParams) -> tuple[float, list[int]] | None:
        """``(tokens_per_s, token_ids)`` of plain decoding of ``prompt``, once a ``stream`` measured it."""
        return self._baselines.get((prompt, repr(params)))

    def keep_baseline(self, prompt: str, params: SamplingParams, lane: "Lane") -> tuple[float, list[int]]:
        self._baselines[(prompt, repr(params))] = (lane.stats.tokens_per_s, lane.token_ids)
        return self._baselines[(prompt, repr(params))]


@dataclass
class Lane:
    """One pipeline's generation: its request, the StepRecords so far and running statistics.

    ``state`` is running, done, stopped or error (then ``error`` says why).
    """

    name: str
    engine: SpecEngine | None = None
    request_id: int | None = None
    steps: list[StepRecord] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: RunStats = field(default_factory=RunStats)
    state: str = "running"
    error: str | None = None

    @classmethod
    def failed(cls, name: str, error: Exception | str) -> "Lane":
        return cls(name, state="error", error=str(error))

    def advance(self) -> None:
        """One engine step (timed); then refresh tokens, text and steps from the request."""
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
            self.engine.synchronize()  # plain decoding leaves its next forward queued: time it here
        except Exception as e:  # the UI must survive a component's bug; the console keeps the traceback
            log.exception("pipeline %s failed", self.name)
            self.close()
            self.state, self.error = "error", f"{type(e).__name__}: {e}"
            self.stats.baseline_tokens_per_s = None  # a crashed lane shows no speedup
            return
        self.stats.seconds += time.perf_counter() - t0
        out = next((o for o in finished if o.request_id == self.request_id), None)
        if out is not None:
            self.state = "done"
        else:
            (out,) = self.engine.snapshot([self.request_id])
        self.steps, self.token_ids, self.text = out.steps, out.token_ids, out.text or ""
        self.stats.accept_lengths, self.stats.tokens = out.accept_lengths, len(out.token_ids)

    def close(self) -> None:
        """Free the request's KV pages and drafter state if it is still running."""
        if self.engine is not None and self.request_id is not None:
            self.engine.abort(self.request_id)


def start_lane(pool: EnginePool, pipeline: PipelineConfig, prompt: str, params: SamplingParams,
               lanes: list[Lane] = ()) -> Lane:
    """Queue ``prompt`` on the pipeline's engine (one none of ``lanes`` runs on); a pipeline that
    cannot load gives a failed Lane."""
    try:
        engine = pool.engine(pipeline, busy=tuple(lane.engine for lane in lanes if lane.engine is not None))
        return Lane(pipeline.name, engine, engine.add_request(prompt, params))
    except USER_ERRORS as e:
        return Lane.failed(pipeline.name, e)


def stream(pool: EnginePool, lanes: list[Lane], prompt: str, params: SamplingParams,
           stop: threading.Event) -> Iterator[list[Lane]]:
    """Step running lanes in turn, yielding after each round; then add the speedup against plain
    decoding of the same prompt (not to a lane that failed). Plain decoding not measured yet for
    this prompt runs as a hidden lane stepped in the same rounds, so it is timed alongside
    whatever else the process does meanwhile (the UI's frames), as the lanes are; it stops when
    every lane has failed or stopped. ``stop`` ends the generation between steps."""
    def attach(baseline: tuple[float, list[int]]) -> None:
        for lane in lanes:
            if lane.state == "error":
                continue
            lane.stats.baseline_tokens_per_s = baseline[0]
            if params.greedy and lane.state == "done":
                lane.stats.matches_baseline = lane.token_ids == baseline[1]

    cached = pool.cached_baseline(prompt, params)
    plain: list[Lane] = []
    try:  # (from here on every lane is closed, whatever happens: the hidden one's start too)
        if cached is not None:
            attach(cached)
        else:
            plain.append(start_lane(pool, PLAIN, prompt, params, lanes))
        yield lanes
        # the hidden lane runs on only to give a lane that finished its speedup: not where all failed
        while any(lane.state == "running" for lane in lanes) or (
                any(lane.state == "done" for lane in lanes) and any(lane.state == "running" for lane in plain)):
            if stop.is_set():
                for lane in lanes + plain:
                    if lane.state == "running":
                        lane.close()
                        lane.state = "stopped"
                break
            for lane in lanes + plain:
                if lane.state == "running":
                    lane.advance()
            yield lanes
        baseline = cached
        if plain and plain[0].state == "done":
            baseline = pool.keep_baseline(prompt, params, plain[0])
        # (a cached baseline was attached while the lanes ran: again, for the lanes now done)
        if baseline is not None and any(lane.state == "done" for lane in lanes):
            attach(baseline)
            yield lanes
    finally:
        for lane in lanes + plain:
            lane.close()
