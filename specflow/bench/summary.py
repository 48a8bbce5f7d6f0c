"""A pipeline's numbers from its rows (one per prompt and turn) against the baseline's: accept
length, tokens/s, speedups, latency percentiles, acceptance by depth, per category."""

from __future__ import annotations

import torch


def batch_seconds(rows: list[dict]) -> float:
    """The wall time of the distinct batches of ``rows`` (every row holds its batch's time)."""
    return sum({r["batch"]: r["seconds"] for r in rows}.values())


def summarize(rows: list[dict], baseline: list[dict] | None) -> dict:
    """Accept length, tokens/s, speedup against the baseline rows (total tokens over total time,
    each side; with one prompt a batch also ``speedup_mean_per_prompt``, Spec-Bench's mean of
    per-prompt tokens/s over the baseline's), latency percentiles (of the rows' batch seconds), and the
    share of prompts whose tokens match the baseline's, per category. Prompts are seeded, so a
    sampled run matches too where its verifier follows the target's own draws (greedy; rejection
    over top-k drafts); other sampled runs are exact in distribution, not token for token.

    A selection's seconds are the wall times of its distinct batches. A category whose batches
    also hold other categories' prompts cannot be timed apart from them: it gets its accept
    length but no tokens/s or speedup."""

    def stats(sel: list[dict], base: list[dict] | None, timed: bool) -> dict:
        tokens = sum(r["tokens"] for r in sel)
        steps = sum(r["steps"] for r in sel)
        out = {"prompts": len(sel), "tokens": tokens,
               "accept_length": sum(r["step_tokens"] for r in sel) / max(1, steps)}
        if timed:
            out["tokens_per_s"] = tokens / max(batch_seconds(sel), 1e-9)
            if base is not None:
                out["speedup"] = out["tokens_per_s"] / (sum(r["tokens"] for r in base) / max(batch_seconds(base), 1e-9))
                if len({r["batch"] for r in sel}) == len(sel):  # one prompt a batch: each prompt's own time
                    out["speedup_mean_per_prompt"] = mean_tokens_per_s(sel) / mean_tokens_per_s(base)
        if base is not None:  # (by id: the model's context may have left a turn out on one side)
            tokens_of = {r["id"]: r["token_ids"] for r in base}
            out["matches_baseline"] = sum(r["token_ids"] == tokens_of.get(r["id"]) for r in sel) / len(sel)
        return out

    lat = torch.tensor([r["seconds"] for r in rows])
    summary = stats(rows, baseline, timed=True)
    summary["latency_s"] = {f"p{q}": float(lat.quantile(q / 100)) for q in (50, 90, 99)}
    # (each prompt's last step left out: max_tokens or a stop may have cut its accepted drafts)
    summary["acceptance_by_depth"] = acceptance_by_depth([n for r in rows for n in r["accept_lengths"][:-1]],
                                                         [d for r in rows for d in r["tried_depths"][:-1]])
    summary["categories"] = {}
    for cat in sorted({r["category"] for r in rows}):
        sel = [r for r in rows if r["category"] == cat]
        base = [r for r in baseline if r["category"] == cat] if baseline else None
        batches = {r["batch"] for r in sel}
        mixed = any(r["batch"] in batches and r["category"] != cat for r in rows)
        summary["categories"][cat] = stats(sel, base, timed=not mixed)
    return summary


def mean_tokens_per_s(rows: list[dict]) -> float:
    """The mean over prompts of each prompt's tokens/s (rows of one prompt a batch): Spec-Bench's
    speedup is this mean of a method over the baseline's."""
    return sum(r["tokens"] / max(r["seconds"], 1e-9) for r in rows) / len(rows)


def acceptance_by_depth(accept_lengths: list[int], tried_depths: list[int]) -> list[float]:
    """EAGLE's per-depth acceptance rates, from each step's committed tokens (``accept_lengths``:
    drafts + bonus, so n - 1 accepted drafts) and its tried depth (``tried_depths``: the deepest
    draft the verifier tested on the accepted path, ``spec_step.tried_depth``). Entry d - 1 is
    the share of steps that accepted a depth-d draft among those that tested one: accepted depth
    d - 1 at a node with children. A path that ended at a leaf (a chain's end, a branch of a tree
    shallower than its others, a root-only step, an n-gram miss) is no rejection at d. Up to the
    deepest depth some step tested (the counts tested only fall with d)."""
    assert len(accept_lengths) == len(tried_depths), "one tried depth per step"
    steps = list(zip(accept_lengths, tried_depths))
    assert all(n - 1 <= t <= n for n, t in steps), "a step tests at most one draft past those it accepts"
    rates = []
    for d in range(1, max(tried_depths, default=0) + 1):
        tested = [n - 1 >= d for n, t in steps if t >= d]  # (t >= d: accepted depth d - 1, tested a child)
        if not tested:
            break
        rates.append(sum(tested) / len(tested))
    return rates
