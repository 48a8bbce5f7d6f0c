"""``specflow sweep``: a grid over pipeline parameters (like SGLang's bench_speculative), and over
the run's own settings (batch size, sampling, engine), each of those points with its own baseline."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path

from omegaconf import OmegaConf

from specflow.bench.experiment import RESULT_FILES, execute
from specflow.bench.experiment_config import PipelineConfig, load_experiment
from specflow.bench.report import BROKEN_CLAIM_MARK, lossless_cell, matches_cell
from specflow.config import ConfigError
from specflow.pipeline import Pipeline

SECTIONS = ("drafter", "tree", "verifier", "sampling", "engine")  # a grid key is one of these's keys,
RUN_KEYS = ("batch_size", "sampling", "engine")                   # or batch_size; a point of these
                                                                  # runs its own baseline


def parse_grid(grid: list[str]) -> dict[str, list]:
    """``["tree.topk=2,4", "batch_size=1,4"]`` -> ``{"tree.topk": [2, 4], "batch_size": [1, 4]}``."""
    axes = {}
    for item in grid:
        key, _, values = item.partition("=")
        section, _, param = key.partition(".")
        if not values or not (key == "batch_size" or section in SECTIONS and param):
            raise ConfigError(f"--grid '{item}' must look like tree.topk=2,4 (drafter., tree., verifier., "
                              f"sampling. or engine. keys, or batch_size)")
        if key in axes:
            raise ConfigError(f"--grid {key} is given twice; list its values once: {key}=v1,v2,...")
        axes[key] = [_value(v) for v in values.split(",")]
        if len(set(axes[key])) != len(axes[key]):
            raise ConfigError(f"--grid {key}: a value is repeated in '{values}'; each point is run once")
    return axes


def _value(v: str):
    """A grid value read as an override's is (YAML: 4, 0.5, 1e-3, true, null, text)."""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={v}"]))["v"]


def point_name(keys, values) -> str:
    """A grid point's name: ``tree.topk=4``, ``batch_size=8`` -> ``topk=4,batch_size=8`` (a key
    keeps its section where another key ends alike: ``tree.type=static,verifier.type=greedy``)."""
    keys = list(keys)
    short = [k.split(".", 1)[-1] for k in keys]
    return ",".join(f"{s if short.count(s) == 1 else k}={v}" for k, s, v in zip(keys, short, values))


def grid_pipelines(base: PipelineConfig, axes: dict[str, list]) -> list[PipelineConfig]:
    """One pipeline per point of the grid, named by its parameter values."""
    out = []
    for values in itertools.product(*axes.values()):
        p = copy.deepcopy(base)
        # a component's type first: a point of another type gets a node of its own, as an override
        # that switches the type does (config.load_yaml), and the other keys of the grid then go into it
        for key, value in sorted(zip(axes, values), key=lambda kv: kv[0].rsplit(".", 1)[-1] != "type"):
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
            if param == "type" and node.get("type") not in (None, value):
                node.clear()
            node[param] = value
        p.name = point_name(axes, values)
        Pipeline.check(p.drafter, p.tree, p.verifier, f"--grid point {p.name}: ")
        out.append(p)
    return out


def run_sweep(path: str | Path, grid: list[str], overrides: list[str] | None = None) -> dict[str, dict]:
    """Sweep the first pipeline of an experiment over ``grid``; the fastest point that finished is
    ``best`` in results.json and results.md, and printed.

    Keys of the run itself (``batch_size``, ``sampling.*``, ``engine.*``) make an outer grid: each
    of its points runs its own baseline and the pipeline points into runs/<name>-sweep/<point>/,
    and sweep.json / sweep.md in runs/<name>-sweep/ set the points side by side. Returns each run
    point's results by its name ('' without run keys). Every point is checked before the target loads."""
    axes = parse_grid(grid)
    if not axes:
        raise ConfigError("sweep: give at least one --grid key=v1,v2,...")
    run_axes = {k: v for k, v in axes.items() if k.partition(".")[0] in RUN_KEYS}
    pipe_axes = {k: v for k, v in axes.items() if k not in run_axes}
    swept = {*run_axes, *(f"pipelines.0.{k}" for k in pipe_axes)}
    for override in overrides or []:  # (the grid's value would silently win)
        if (key := override.partition("=")[0].strip()) in swept:
            raise ConfigError(f"sweep: {key} is both an override and a --grid key; give it once")
    load_experiment(path, overrides)  # the command line's overrides alone: their errors are not a grid point's
    plan = {}
    for values in itertools.product(*run_axes.values()):
        name = point_name(run_axes, values)
        point = [f"{k}={json.dumps(v)}" for k, v in zip(run_axes, values)]  # overrides after the command line's
        try:
            cfg, pipelines = load_experiment(path, [*(overrides or []), *point])
        except ConfigError as e:
            raise ConfigError(f"--grid point {name}: {e}") from None
        if not pipelines:
            raise ConfigError("sweep: the experiment has no pipelines to sweep")
        points = grid_pipelines(pipelines[0], pipe_axes) if pipe_axes else pipelines[:1]
        sweep_dir = f"{cfg.name}-sweep"
        if run_axes:  # (a value may be a path: keep the point one directory)
            cfg = dataclasses.replace(cfg, name=name.replace("/", "_"), output_dir=str(Path(cfg.output_dir) / sweep_dir))
        else:
            cfg = dataclasses.replace(cfg, name=sweep_dir)
        plan[name] = (cfg, points, dict(zip(run_axes, values)))
    # a previous sweep of the other shape left its files in runs/<name>-sweep/: the summary of run
    # points, or a single run's results
    out = Path(cfg.output_dir) if run_axes else Path(cfg.output_dir) / cfg.name
    for stale in RESULT_FILES if run_axes else ("sweep.json", "sweep.md"):
        (out / stale).unlink(missing_ok=True)
    results = {}
    for name, (cfg, points, _) in plan.items():
        results[name] = execute(cfg, points, rank=True)
        if (best := results[name]["best"]) is not None:
            stats = results[name]["pipelines"][best]
            again = results[name].get("best_confirmed")
            fresh = f"; {again['speedup']:.2f}x in fresh rounds" if again else ""
            print(f"best{' at ' + name if name else ''}: {best}  (speedup {stats['speedup']:.2f}x, "
                  f"accept length {stats['accept_length']:.2f}{fresh})")
        if run_axes:
            write_summary(results, {name: setting for name, (_, _, setting) in plan.items()}, Path(cfg.output_dir))
    return results


def confirmed_cell(results: dict, pipeline: str) -> str:
    """" (1.18x fresh)" after the best pipeline's speedup where it was measured again, else ""."""
    again = results.get("best_confirmed")
    return f" ({again['speedup']:.2f}x fresh)" if again and again["pipeline"] == pipeline else ""


def write_summary(results: dict[str, dict], settings: dict[str, dict], out_dir: Path) -> None:
    """sweep.json (each run point's settings and results) and sweep.md: one row per run point and
    pipeline point, each speedup against its own run point's baseline, the best point of each
    marked, with the lossless claim and the share of prompts matching the baseline as in results.md."""
    points = {name: {"settings": settings[name], "results": res} for name, res in results.items()}
    (out_dir / "sweep.json").write_text(json.dumps({"points": points}, indent=2, default=str))
    keys = list(next(iter(settings.values())))
    lines = [f"# {out_dir.name}", "", "Each run point has its own baseline, in its own directory (results.md "
             "there has the categories and what the columns mean); `*` marks the run point's best pipeline, "
             "and its speedup in fresh rounds of its baseline and that pipeline alone follows in brackets "
             "(the best of several noisy speedups overstates its own).", "",
             "| " + " | ".join(keys) + " | pipeline | lossless | accept length | tokens/s | speedup | matches baseline "
             "| baseline tokens/s |", "|---" * (len(keys) + 7) + "|"]
    contradicted = False
    for name, res in results.items():
        base = res["pipelines"]["baseline"]["tokens_per_s"]
        for pipe, s in res["pipelines"].items():
            if pipe == "baseline":
                continue
            lossless = lossless_cell(s, res["sampling"].get("temperature") == 0)
            contradicted |= lossless.endswith(BROKEN_CLAIM_MARK)
            cells = ([pipe, lossless, "failed", "", "", "", ""] if "error" in s else
                     [pipe + (" *" if pipe == res["best"] else ""), lossless, f"{s['accept_length']:.2f}",
                      f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x" + confirmed_cell(res, pipe), matches_cell(s),
                      f"{base:.1f}"])
            lines.append("| " + " | ".join([*map(str, settings[name].values()), *cells]) + " |")
    if contradicted:
        lines += ["", f"{BROKEN_CLAIM_MARK} declared lossless, yet at temperature 0 some prompts part from the "
                      "baseline: see that run point's results.md."]
    (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
