"""``specflow sweep``: a grid over pipeline parameters (like SGLang's bench_speculative)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from pathlib import Path

from specflow.bench.experiment import PipelineConfig, execute, load_experiment
from specflow.config import ConfigError
from specflow.pipeline import Pipeline


def parse_grid(grid: list[str]) -> dict[str, list]:
    """``["tree.topk=2,4", "tree.depth=3,5"]`` -> ``{"tree.topk": [2, 4], "tree.depth": [3, 5]}``."""
    axes = {}
    for item in grid:
        key, _, values = item.partition("=")
        section, _, param = key.partition(".")
        if not values or not param or section not in ("drafter", "tree", "verifier"):
            raise ConfigError(f"--grid '{item}' must look like tree.topk=2,4 (drafter., tree. or verifier. keys)")
        if key in axes:
            raise ConfigError(f"--grid {key} is given twice; list its values once: {key}=v1,v2,...")
        axes[key] = [_number(v) for v in values.split(",")]
        if len(set(axes[key])) != len(axes[key]):
            raise ConfigError(f"--grid {key}: a value is repeated in '{values}'; each point is run once")
    return axes


def _number(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def grid_pipelines(base: PipelineConfig, axes: dict[str, list]) -> list[PipelineConfig]:
    """One pipeline per point of the grid, named by its parameter values."""
    out = []
    for values in itertools.product(*axes.values()):
        p = copy.deepcopy(base)
        for key, value in zip(axes, values):
            section, *path, param = key.split(".")
            node = getattr(p, section)
            for part in path:  # nested keys: drafter.drafters.0.max_window
                try:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                except (KeyError, IndexError, ValueError, TypeError):
                    node = None
                    break
            if not isinstance(node, dict):
                raise ConfigError(f"--grid {key}: the pipeline has no {'.'.join([section, *path])} node")
            node[param] = value
        p.name = ",".join(f"{k.split('.', 1)[1]}={v}" for k, v in zip(axes, values))
        Pipeline.check(p.drafter, p.tree, p.verifier, f"--grid point {p.name}: ")
        out.append(p)
    return out


def run_sweep(path: str | Path, grid: list[str], overrides: list[str] | None = None) -> dict:
    """Sweep the first pipeline of an experiment over ``grid``; the fastest point that finished is
    ``best`` in results.json and results.md, and printed."""
    cfg, pipelines = load_experiment(path, overrides)
    if not pipelines:
        raise ConfigError("sweep: the experiment has no pipelines to sweep")
    points = grid_pipelines(pipelines[0], parse_grid(grid))  # every point checked before anything loads
    cfg = dataclasses.replace(cfg, name=f"{cfg.name}-sweep")
    results = execute(cfg, points, rank=True)
    if (best := results["best"]) is not None:
        stats = results["pipelines"][best]
        print(f"best: {best}  (speedup {stats['speedup']:.2f}x, accept length {stats['accept_length']:.2f})")
    return results
