"""``specflow run``: pipelines over a prompt suite against the autoregressive baseline of the same run."""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specflow.bench.experiment_config import ExperimentConfig, PipelineConfig, load_experiment, sampling_params
from specflow.bench.prompts import Prompt, load_suite
from specflow.bench.provenance import device_name, git_commit, git_dirty
from specflow.bench.report import best_pipeline, write_report
from specflow.bench.summary import batch_seconds, summarize
from specflow.config import ConfigError, dump_yaml
from specflow.engine import SpecEngine
from specflow.models import load_model, load_tokenizer
from specflow.pipeline import resolve_device
from specflow.registry import plugin_sources
from specflow.runtime.cuda_graph import capture_sizes


ROW_KEYS = ("id", "category", "turn", "prompt_tokens", "tokens", "token_ids", "max_tokens", "steps",
            "accept_lengths", "tried_depths", "seconds", "batch")  # rows.jsonl
RESULT_FILES = ("results.json", "results.md", "speedup.png", "rows.jsonl", "steps.jsonl", "config.yaml")  # a run's


def run_pipeline(engine: SpecEngine, prompts: list[Prompt], cfg: ExperimentConfig, desc: str) -> list[dict]:
    """Warm up, then generate every prompt (``cfg.batch_size`` at a time), turn by turn; one row per
    prompt and turn with its batch's index and wall time (and its StepRecords when the engine
    records them). A later turn's prompt is the chat so far, with this engine's own answers. A turn
    gets at most the new tokens the model's context leaves (its row's ``max_tokens``); a chat that
    fills the context ends there, its turns left without rows (``context_cuts``)."""
    sampling, batch_size = cfg.sampling, cfg.batch_size
    turns = [[p.text, *p.later_turns][: cfg.prompts.turns] for p in prompts]
    chats = [[{"role": "user", "content": t[0]}] for t in turns]  # each question's messages so far

    def render(chat: list[dict]) -> str:
        if not cfg.prompts.chat_template:  # (one turn)
            return chat[-1]["content"]
        return engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    def widest(t: list[str]) -> int:
        """The longest prompt question ``t``'s turns can send: its whole chat, in the template,
        with answers of max_tokens (each given here as an empty message: its template tokens)."""
        chat = [{"role": "user", "content": t[0]}]
        for text in t[1:]:
            chat += [{"role": "assistant", "content": ""}, {"role": "user", "content": text}]
        return len(engine.encode(render(chat))) + (len(t) - 1) * sampling.max_tokens

    # CUDA graphs are captured the first time a shape is met, on this fresh engine: the warm-up
    # meets the timed batches' batch sizes (with graphs, every padded size up to the largest
    # batch, which requests finishing at different steps pass through) and their widest KV (the
    # longest prompt; a later turn's, with the answers before it, is as long as its chat and
    # their max_tokens at most), so no capture falls inside the timed wall time. That bound can
    # pass what one request may hold (the model's context, the KV pool) where the real later turns
    # do not, their answers having ended at EOS: the warm-up stops at what a request may be
    fits = min(engine.model.config.max_position_embeddings - sampling.max_tokens,
               engine.scheduler.max_request_tokens() - 1)
    warm_len = max(1, min(max(map(widest, turns)), fits))
    vocab = min(engine.model.config.vocab_size, len(engine.tokenizer))  # ids the tokenizer can decode
    most = min(batch_size, len(prompts))
    sizes = warmup_batch_sizes(batch_size, len(prompts)) if engine.runner.graphs is not None else [most]
    first = sampling_params(sampling, 0)
    n = 0  # warm-up requests so far
    for _ in range(cfg.warmup):
        for size in sizes:
            ids = [torch.randint(vocab, (warm_len,), generator=torch.Generator().manual_seed(n + j)).tolist()
                   for j in range(size)]
            # (seeds no prompt has: requests sharing a seed share their uniforms, see the README)
            engine.generate(ids, [dataclasses.replace(first, ignore_eos=True, seed=sampling.seed - 1 - n - j)
                                  for j in range(size)])
            n += size
    rows, batch, context = [], 0, engine.model.config.max_position_embeddings
    with tqdm(total=sum(map(len, turns)), desc=desc, unit="prompt", leave=False, disable=None) as bar:  # (off in logs)
        for turn in range(cfg.prompts.turns):
            live, texts, params = [], [], []  # questions with this turn, their chats, their SamplingParams
            for i, t in enumerate(turns):
                if len(t) <= turn:
                    continue
                text = render(chats[i])
                sent = len(engine.encode(text))
                room = context - sent  # the new tokens the context leaves this turn
                # the chat fills the context (or a prompt the KV pool cannot hold, which add_request
                # refuses): no row, nor for its later turns (it stays as it is); the run goes on
                if room < 1 or sent + 1 > engine.scheduler.max_request_tokens():
                    bar.update()
                    continue
                live.append(i)
                texts.append(text)
                # prompt i's seed in the first turn, then seeds no earlier turn had; max_tokens cut
                # to what the context leaves (a later turn's chat grows with the answers)
                params.append(dataclasses.replace(sampling_params(sampling, i + turn * len(prompts)),
                                                  max_tokens=min(sampling.max_tokens, room)))
            for start in range(0, len(live), batch_size):
                chunk = slice(start, start + batch_size)
                t0 = time.perf_counter()
                outs = engine.generate(texts[chunk], params[chunk])
                engine.synchronize()  # (plain decoding may leave a forward queued)
                seconds = time.perf_counter() - t0
                for i, out, param in zip(live[chunk], outs, params[chunk]):
                    p = prompts[i]
                    rows.append({"id": turn_id(p, turn), "category": p.category,
                                 "turn": turn + 1, "batch": batch, "seconds": seconds,
                                 "prompt_tokens": len(out.prompt_token_ids),
                                 "tokens": len(out.token_ids), "steps": len(out.accept_lengths),
                                 "step_tokens": sum(out.accept_lengths), "accept_lengths": out.accept_lengths,
                                 "tried_depths": out.tried_depths, "max_tokens": param.max_tokens,
                                 "token_ids": out.token_ids, "step_records": out.steps})
                    if turn + 1 < len(turns[i]):
                        chats[i] += [{"role": "assistant", "content": out.text},
                                     {"role": "user", "content": turns[i][turn + 1]}]
                batch += 1
                bar.update(len(outs))
    if not rows:  # (summarize has nothing to average: say why rather than fail on an empty list)
        raise ValueError(f"no prompt fits the model's context ({context} tokens) or the KV cache "
                         f"({engine.scheduler.max_request_tokens()} tokens): every turn was left out")
    return rows


def turn_id(prompt: Prompt, turn: int) -> str:
    """A row's id: the question's for its first turn, ``<id>/<turn number>`` for a later one."""
    return prompt.id if turn == 0 else f"{prompt.id}/{turn + 1}"


def context_cuts(rows: list[dict], prompts: list[Prompt], cfg: ExperimentConfig) -> dict:
    """The turns the model's context cut, by id: ``turns_shortened``, sent with fewer new tokens
    than ``max_tokens``, and ``turns_left_out``, whose chat had no room for one (``run_pipeline``)."""
    got = {r["id"] for r in rows}
    asked = [turn_id(p, t) for p in prompts for t in range(min(cfg.prompts.turns, 1 + len(p.later_turns)))]
    return {"turns_shortened": [r["id"] for r in rows if r["max_tokens"] < cfg.sampling.max_tokens],
            "turns_left_out": [i for i in asked if i not in got]}


def warmup_batch_sizes(batch_size: int, num_prompts: int) -> list[int]:
    """The warm-up's batches: one per CUDA-graph batch size (``capture_sizes``) that a timed batch
    of at most ``min(batch_size, num_prompts)`` requests can be padded to, smallest first."""
    most, sizes = min(batch_size, num_prompts), []
    for size in capture_sizes(batch_size):
        sizes.append(min(size, most))
        if size >= most:
            return sizes
    return sizes


def failed_pipelines(results: dict) -> str:
    """'' when every pipeline finished, else a line naming those that raised and their errors."""
    failed = {n: s["error"] for n, s in results["pipelines"].items() if "error" in s}
    if not failed:
        return ""
    return (f"{len(failed)} pipeline(s) failed: " + "; ".join(f"{n} ({e})" for n, e in failed.items())
            + " (tracebacks above; the others' results are written)")


def run_experiment(path: str | Path, overrides: list[str] | None = None) -> dict:
    """Run an experiment YAML; writes runs/<name>/{results.json, results.md, config.yaml, speedup.png,
    rows.jsonl} (and steps.jsonl with ``engine.record_steps``)."""
    cfg, pipelines = load_experiment(path, overrides)
    return execute(cfg, pipelines)


def execute(cfg: ExperimentConfig, pipelines: list[PipelineConfig], rank: bool = False) -> dict:
    """Run the baseline and every pipeline over the prompt suite, write the results directory.

    A pipeline that raises is recorded as ``{"error": ...}`` (traceback on stderr) and the others
    still run. ``rank`` (sweep) names the fastest finished pipeline ``best`` and, when there was a
    choice, measures it again in fresh rounds (``best_confirmed``)."""
    if not Path(cfg.engine.target).is_dir():
        raise ConfigError(f"engine.target: {cfg.engine.target} is not a directory; point it to a Hugging Face "
                          "checkpoint")
    out_dir = Path(cfg.output_dir) / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in RESULT_FILES:  # a previous run's
        (out_dir / stale).unlink(missing_ok=True)
    dump_yaml(dataclasses.asdict(cfg) | {"pipelines": [dataclasses.asdict(p) for p in pipelines]},
              out_dir / "config.yaml")
    e = cfg.engine
    device, dtype = resolve_device(e.device, e.dtype)
    model = load_model(e.target, device=device, dtype=dtype)
    tokenizer = load_tokenizer(e.target)
    prompts = load_suite(cfg.prompts.suite, cfg.prompts.categories, cfg.prompts.per_category)
    if cfg.prompts.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("prompts.chat_template: the target's tokenizer has no chat template")

    def engine_for(p: PipelineConfig | None) -> SpecEngine:
        node = dataclasses.asdict(e) | {"drafter": p.drafter if p else None, "tree": p.tree if p else None,
                                        "verifier": p.verifier if p else None, "max_batch_size": cfg.batch_size}
        del node["target"]
        return SpecEngine(model, tokenizer=tokenizer, **node)

    def fastest(runs: list[list[dict]]) -> list[dict]:
        """The last run's rows (the last round's, whose step records are kept) with each batch's
        fastest time over ``runs``."""
        rows = runs[-1]
        for i, row in enumerate(rows):  # (a batch's rows share its time)
            row["seconds"] = min(run[i]["seconds"] for run in runs)
        return rows

    all_rows = {}

    def confirm(p: PipelineConfig) -> dict:
        """The best point's speedup in fresh rounds of the baseline and that point alone: the best
        of several noisy speedups overstates its own (the winner's curse); these rounds took no
        part in the pick."""
        base_runs, best_runs = [], []
        for _ in range(cfg.repeats):
            base_runs.append(run_pipeline(engine_for(None), prompts, cfg, "baseline (confirming)"))
            best_runs.append(run_pipeline(engine_for(p), prompts, cfg, f"{p.name} (confirming)"))
        s = summarize(fastest(best_runs), fastest(base_runs))
        return {"pipeline": p.name, "speedup": s["speedup"], "tokens_per_s": s["tokens_per_s"],
                "baseline_tokens_per_s": s["tokens_per_s"] / s["speedup"]}

    def record(name: str, rows: list[dict]) -> None:
        all_rows[name] = rows
        with open(out_dir / "rows.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps({"pipeline": name} | {k: r[k] for k in ROW_KEYS}) + "\n")
        if e.record_steps:
            with open(out_dir / "steps.jsonl", "a") as f:
                for r in rows:
                    for step in r["step_records"]:
                        f.write(json.dumps({"pipeline": name, "id": r["id"]} | step.to_json()) + "\n")
        for r in rows:
            del r["step_records"]  # written, not kept: the trees of a whole suite add up

    def save() -> None:  # after every pipeline: the files agree, and one that fails later loses nothing
        if rank:
            results["best"] = best_pipeline(results)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        write_report(results, all_rows, out_dir)

    print(f"{cfg.name}: {len(prompts)} prompts, target {e.target} on {device}/{str(dtype).split('.')[-1]}")
    runs: dict[str, list[list[dict]]] = {"baseline": []} | {p.name: [] for p in pipelines}
    errors: dict[str, str] = {}   # pipeline -> the error of its run that raised

    def run(p: PipelineConfig | None, last: bool) -> SpecEngine | None:
        """One more run of ``p`` (None: the baseline) on a fresh engine (a drafter that learns
        across requests starts over); None when it raised: a component's bug costs its own
        pipeline only. Only the ``last`` round's run keeps its step records (it is written at
        once), so no round holds the trees of earlier runs."""
        name = p.name if p else "baseline"
        try:
            engine = engine_for(p)
            rows = run_pipeline(engine, prompts, cfg, name)
            if not last:  # only the last round's rows are written, step records and all
                for r in rows:
                    del r["step_records"]
            runs[name].append(rows)
            return engine
        except Exception as err:
            if p is None:
                raise
            traceback.print_exc()
            errors[name] = f"{type(err).__name__}: {err}"
            return None

    # ``repeats`` rounds of the baseline then every pipeline: a drift of the machine's speed (clocks,
    # heat, other load) falls on every pipeline alike, as it would not on repeats run back to back
    for _ in range(cfg.repeats - 1):
        for p in [None, *pipelines]:
            if p is None or p.name not in errors:
                run(p, last=False)
    run(None, last=True)  # the last round writes the results pipeline by pipeline
    baseline_seconds = [batch_seconds(r) for r in runs["baseline"]]  # (before fastest() sets the last run's)
    baseline = fastest(runs["baseline"])
    results = {"name": cfg.name, "target": e.target, "device": str(device), "device_name": device_name(device),
               "dtype": str(dtype).split(".")[-1], "torch_version": torch.__version__, "git_commit": git_commit(),
               "git_dirty": git_dirty(), "plugins": plugin_sources(),
               "torch_threads": torch.get_num_threads(), "batch_size": cfg.batch_size, "num_prompts": len(prompts),
               "turns": cfg.prompts.turns, "check_drafts": e.check_drafts,
               "repeats": cfg.repeats, "sampling": dataclasses.asdict(cfg.sampling),
               "pipelines": {"baseline": summarize(baseline, None)}}
    results["pipelines"]["baseline"] |= {"speedup": 1.0, "run_seconds": baseline_seconds,
                                         **context_cuts(baseline, prompts, cfg)}
    record("baseline", baseline)
    save()
    for p in pipelines:
        engine = run(p, last=True) if p.name not in errors else None
        if engine is None:
            results["pipelines"][p.name] = {"error": errors[p.name]}
        else:
            run_seconds = [batch_seconds(r) for r in runs[p.name]]  # (before fastest() sets the last run's)
            rows = fastest(runs[p.name])
            results["pipelines"][p.name] = summarize(rows, baseline) | {
                "lossless": engine.verifier.lossless,  # (drafter null: plain decoding, no tree to count)
                "num_draft_tokens": engine.tree_builder.num_draft_tokens if engine.tree_builder is not None else None,
                "run_seconds": run_seconds, **context_cuts(rows, prompts, cfg),
                "pipeline": {"drafter": p.drafter, "tree": p.tree, "verifier": p.verifier}}
            record(p.name, rows)
        save()
    if rank and results["best"] is not None and len(pipelines) > 1:
        results["best_confirmed"] = confirm(next(p for p in pipelines if p.name == results["best"]))
        save()
    print((out_dir / "results.md").read_text())
    print(f"wrote {out_dir}/")
    return results
