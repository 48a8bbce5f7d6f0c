"""results.md and plots for an experiment directory."""

from __future__ import annotations

from pathlib import Path

NOISE_MARK = "†"
BROKEN_CLAIM_MARK = "§"


def best_pipeline(results: dict) -> str | None:
    """The finished pipeline (not the baseline) with the highest speedup; None when none finished."""
    finished = {n: s for n, s in results["pipelines"].items() if n != "baseline" and "error" not in s}
    return max(finished, key=lambda n: finished[n]["speedup"], default=None)


def share(fraction: float) -> str:
    """A share in whole percent that reads as all or none only when it is: 479 of 480 prompts
    matching is ">99%", where ``:.0%`` wrote "100%", and 1 of 480 is "<1%", not "0%"."""
    text = f"{fraction:.0%}"
    if text == "100%" and fraction < 1:
        return ">99%"
    return "<1%" if text == "0%" and fraction > 0 else text


def lossless_cell(s: dict, greedy_run: bool) -> str:
    """A pipeline's lossless column: its verifier's declared claim ("yes", "no"; "-" for the
    baseline), marked ``BROKEN_CLAIM_MARK`` where a greedy run contradicts it (a declared-lossless
    pipeline must match the baseline at temperature 0)."""
    text = {True: "yes", False: "no", None: "-"}[s.get("lossless")]
    broken = greedy_run and s.get("lossless") and s.get("matches_baseline", 1.0) < 1.0
    return text + BROKEN_CLAIM_MARK if broken else text


def matches_cell(s: dict) -> str:
    """A pipeline's "matches baseline" column: the share of prompts with the baseline's tokens."""
    return share(s["matches_baseline"]) if "matches_baseline" in s else "-"


def write_report(results: dict, rows: dict[str, list[dict]], out_dir: Path) -> None:
    """A markdown table per pipeline and per category, failed pipelines apart with their errors,
    plus speedup and accepted-length plots of the finished ones."""
    finished = {n: s for n, s in results["pipelines"].items() if "error" not in s}
    noisy, untimed, contradicted = False, False, False
    greedy_run = results["sampling"].get("temperature") == 0

    def speedup(s: dict) -> str:
        nonlocal noisy, untimed
        if "tokens_per_s" not in s:
            untimed = True
            return "-"
        value = s.get("speedup", 1.0)  # (the baseline's categories: 1 by definition)
        # a step that verifies a tree costs at least a decode step: more than the accept length is noise
        mark = NOISE_MARK if value > s["accept_length"] else ""
        noisy |= bool(mark)
        return f"{value:.2f}x{mark}"

    commit = (results["git_commit"] or "not a git checkout")[:12] + (" with uncommitted changes"
                                                                     if results.get("git_dirty") else "")
    plugins = "".join(f", plugin `{file}` (sha256 {digest[:12]})"
                      for file, digest in results.get("plugins", {}).items())
    lines = [f"# {results['name']}", "",
             f"target `{results['target']}` on {results['device']} "
             f"({', '.join(filter(None, [results.get('device_name'), results['dtype']]))}), "
             f"batch size {results['batch_size']}, {results['num_prompts']} prompts"
             f"{' of up to ' + str(results['turns']) + ' turns (a row each)' if results.get('turns', 1) > 1 else ''}, "
             f"{'best of ' + str(results['repeats']) + ' runs, ' if results['repeats'] > 1 else ''}temperature "
             f"{results['sampling']['temperature']}, max_tokens {results['sampling']['max_tokens']}; torch "
             f"{results['torch_version']}, specflow {commit}{plugins}. Speedup is against the autoregressive baseline "
             f"measured in the same run. Lossless: the verifier declares (its `lossless`) that it keeps the "
             f"target's distribution at any temperature, so at temperature 0 such a pipeline is exact. Matches "
             f"baseline: prompts with the baseline's exact tokens; prompts are seeded, so at temperature > 0 "
             f"the verifiers that follow the target's draws (greedy; rejection over top-k drafts) match too and "
             f"the other lossless ones are exact in distribution only.", "",
             *(["**engine.check_drafts is on**: each step of a pipeline waits to check its tree and verdict, "
                "so its times and speedup are a developer's check, not a benchmark.", ""]
               if results.get("check_drafts") else []),
             "| pipeline | lossless | accept length | tokens/s | speedup | matches baseline | p50 s | p99 s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in finished.items():
        match = matches_cell(s)
        lossless = lossless_cell(s, greedy_run)
        contradicted |= lossless.endswith(BROKEN_CLAIM_MARK)
        lines.append(f"| {name} | {lossless} | {s['accept_length']:.2f} | {s['tokens_per_s']:.1f} | {speedup(s)} "
                     f"| {match} | {s['latency_s']['p50']:.3f} | {s['latency_s']['p99']:.3f} |")
    per_prompt = {n: s["speedup_mean_per_prompt"] for n, s in finished.items()
                  if "speedup_mean_per_prompt" in s and n != "baseline"}
    if per_prompt:  # (one prompt a batch)
        lines += ["", "Spec-Bench's speedup (the mean of per-prompt tokens/s over the baseline's; the table's is "
                      "total tokens over total time, each side): "
                  + ", ".join(f"{n} {v:.2f}x" for n, v in per_prompt.items()) + "."]
    lines += ["", "## Per category (accept length / speedup)", ""]
    cats = sorted(results["pipelines"]["baseline"]["categories"])
    lines += ["| pipeline | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, s in finished.items():
        cells = [f"{s['categories'][c]['accept_length']:.2f} / {speedup(s['categories'][c])}" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if noisy:
        lines += ["", f"{NOISE_MARK} speedup above the accept length: a step that verifies a tree costs at least "
                      "a plain decode step, so this is timing noise; time more prompts or tokens."]
    if contradicted:
        lines += ["", f"{BROKEN_CLAIM_MARK} declared lossless, yet at temperature 0 some prompts part from the "
                      "baseline: the pipeline breaks its claim (or, batched, a near-tie of the target's two top "
                      "logits rounded otherwise); test it with specflow.bench.distribution.check_lossless."]
    if untimed:
        lines += ["", "\"-\": the category shares its batches with other categories' prompts (batch size > 1), so "
                      "its time cannot be told apart from theirs; its accept length stands."]
    if "best" in results:
        best = results["best"]
        lines += ["", "## Best", "", f"`{best}`: speedup {finished[best]['speedup']:.2f}x, accept length "
                                     f"{finished[best]['accept_length']:.2f}" if best else "no point finished"]
        if "best_confirmed" in results:
            lines[-1] += (f"; {results['best_confirmed']['speedup']:.2f}x in fresh rounds of the baseline and "
                          f"this point alone (the best of several noisy speedups overstates its own)")
    cut = {n: s for n, s in finished.items() if s.get("turns_shortened") or s.get("turns_left_out")}
    if cut:
        lines += ["", "## Cut by the model's context", "", "Turns whose chat left fewer than max_tokens new tokens "
                  "in the model's context (shortened), or none (left out, with the question's later turns):", ""]
        lines += [f"- `{n}`: {len(s['turns_shortened'])} shortened, {len(s['turns_left_out'])} left out "
                  f"({', '.join(s['turns_left_out']) or 'none'})" for n, s in cut.items()]
    failed = {n: s["error"] for n, s in results["pipelines"].items() if "error" in s}
    if failed:
        lines += ["", "## Failed pipelines", ""] + [f"- `{n}`: {err}" for n, err in failed.items()]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    _plots(finished, rows, out_dir)


def _plots(finished: dict[str, dict], rows: dict[str, list[dict]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(finished)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [finished[n]["speedup"] for n in names], color="tab:blue")
    ax1.axhline(1.0, color="gray", lw=1, ls="--")
    ax1.set_ylabel("speedup vs baseline (same run)")
    ax1.tick_params(axis="x", rotation=30)
    for n in names[1:]:
        lengths = [a for r in rows[n] for a in r["accept_lengths"]]
        if lengths:
            ax2.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=n, align="left")
    ax2.set_xlabel("tokens committed per step")
    ax2.set_ylabel("steps")
    if len(names) > 1:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=100)
    plt.close(fig)
