"""results.md and plots for an experiment directory."""

from __future__ import annotations

from pathlib import Path


def write_report(results: dict, rows: dict[str, list[dict]], out_dir: Path) -> None:
    """A markdown table per pipeline and per category, plus speedup and accepted-length plots."""
    lines = [f"# {results['name']}", "",
             f"target `{results['target']}` on {results['device']} ({results['dtype']}), "
             f"batch size {results['batch_size']}, {results['num_prompts']} prompts; speedup is against "
             f"the autoregressive baseline measured in the same run. Lossless: the verifier keeps the "
             f"target's distribution at any temperature (at temperature 0 every pipeline is exact); matches "
             f"baseline: greedy runs only.", "",
             "| pipeline | lossless | accept length | tokens/s | speedup | matches baseline | p50 s | p99 s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in results["pipelines"].items():
        match = f"{s['matches_baseline']:.0%}" if "matches_baseline" in s else "-"
        lossless = {True: "yes", False: "no", None: "-"}[s.get("lossless")]
        lines.append(f"| {name} | {lossless} | {s['accept_length']:.2f} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f}x "
                     f"| {match} | {s['latency_s']['p50']:.3f} | {s['latency_s']['p99']:.3f} |")
    lines += ["", "## Per category (accept length / speedup)", ""]
    cats = sorted(next(iter(results["pipelines"].values()))["categories"])
    lines += ["| pipeline | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, s in results["pipelines"].items():
        cells = [f"{s['categories'][c]['accept_length']:.2f} / {s['categories'][c].get('speedup', 1.0):.2f}x"
                 for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    _plots(results, rows, out_dir)


def _plots(results: dict, rows: dict[str, list[dict]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["pipelines"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [results["pipelines"][n]["speedup"] for n in names], color="tab:blue")
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
