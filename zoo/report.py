"""zoo/build.py's last stages: held-out evaluation prompts and BUILD.md (provenance of the family)."""

from __future__ import annotations

import json
import re
from pathlib import Path

PROMPTS_PER_FILE = 4
PROMPT_LINES = 4           # a prompt is a ``def`` line and the lines after it
MODELS = ["target", "draft", "eagle", "eagle3", "medusa"]


def write_prompts(out: Path, record: dict) -> None:
    """``heldout_prompts.jsonl`` (Spec-Bench's question.jsonl format): function openings from the
    held-out stdlib files, ``PROMPTS_PER_FILE`` evenly spaced ``def`` lines per file."""
    corpus = json.loads((out / "corpus.json").read_text())
    root = Path(corpus["root"])
    rows = []
    for entry in corpus["held_out"]:
        lines = (root / entry["path"]).read_text(encoding="utf-8").splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(", line)]
        step = max(1, len(starts) // PROMPTS_PER_FILE)
        for n, i in enumerate(starts[::step][:PROMPTS_PER_FILE]):
            text = "".join(lines[i : i + PROMPT_LINES])
            rows.append({"question_id": f"{Path(entry['path']).stem}-{n}", "category": Path(entry["path"]).stem,
                         "turns": [text]})
    (out / "heldout_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record["prompts"] = {"file": "heldout_prompts.jsonl", "count": len(rows)}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _samples(out: Path, n: int = 3, max_tokens: int = 64) -> list[tuple[str, str]]:
    """Greedy continuations of the first held-out prompts by the target."""
    from specflow import SamplingParams, SpecEngine

    prompts = [json.loads(line)["turns"][0] for line in (out / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = prompts[:: max(1, len(prompts) // n)][:n]
    engine = SpecEngine(out / "target", device="cpu", dtype="float32")
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(p, o.text) for p, o in zip(prompts, outs)]


def write_build_md(out: Path, record: dict) -> None:
    """BUILD.md from build.json, corpus.json, the curves and (when present) the evaluation."""
    corpus = json.loads((out / "corpus.json").read_text())
    m = record["machine"]
    lines = [
        "# zoo/tiny-code: how it was built",
        "",
        "Rebuild from scratch with `python zoo/build.py` (stages: tokenizer, target, draft, eagle, eagle3,",
        "medusa, prompts, eval, report; `--stages` runs a subset). Every training stage is `specflow train",
        "configs/train/<stage>.yaml` with paths pointed here; Lightning uses the GPU when there is one.",
        f"This build: Python {m['python']}, torch {m['torch']}, {m['device']} ({m['platform']}), one torch thread.",
        "",
        "## Models",
        "",
        "| dir | what | recipe | params | size on disk | seed | steps | tokens seen | wall | final train loss | val loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    what = {"target": "Llama target (HF checkpoint + BPE tokenizer)", "draft": "Llama draft model (HF checkpoint)",
            "eagle": "EAGLE-1/2 head (SafeAILab layout)", "eagle3": "EAGLE-3 head (SafeAILab layout, d2t/t2d)",
            "medusa": "Medusa heads (FasterDecoding layout)"}
    recipe = {"target": "lm", "draft": "distill", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}
    for name in MODELS:
        r = record.get(name, {})
        lines.append(f"| `{name}/` | {what[name]} | `{recipe[name]}` ([config](../../{r.get('config', '')})) | "
                     f"{r.get('params', 0) / 1e6:.2f} M | {_size(out / name) / 1e6:.1f} MB | {r.get('seed')} | "
                     f"{r.get('steps')} | {r.get('tokens_seen', 0) / 1e6:.2f} M | {r.get('wall_s', 0) / 60:.1f} min | "
                     f"{r.get('train/loss', float('nan')):.3f} | {r.get('val/loss', float('nan')):.3f} |")
    lines += [
        "",
        "Losses are in nats: cross-entropy (target), 0.9 soft-CE + 0.1 CE against the target (draft),",
        "SmoothL1(feature) + 0.1 soft-CE (eagle), sum over unrolled steps of 0.8^k soft-CE (eagle3),",
        "sum over heads of 0.8^i CE (medusa). The train loss is the last logged batch. Loss curves:",
        "`curves/<stage>/loss.png` and `metrics.csv` (every logged step), with the resolved config",
        "(`train_config.yaml`) and `summary.json`. Machine-readable record: `build.json`.",
        f"Total size of this folder: {_size(out) / 1e6:.1f} MB.",
        "",
        "## Data",
        "",
        f"Corpus: the top-level `*.py` modules of the Python {corpus['python']} standard library "
        f"(`{corpus['root']}`), sorted by name; every 20th file is held out. Licence: the Python Software",
        "Foundation License Version 2 (the PSF licence text ships with Python as "
        f"`{Path(corpus['licence']).name if corpus['licence'] else 'LICENSE.txt'}` beside the sources; "
        "https://docs.python.org/3/license.html). The corpus itself is not copied here except for the",
        "short held-out prompts in `heldout_prompts.jsonl` (PSF-licensed excerpts). `corpus.json`",
        "lists every file with its size and sha256 prefix; another Python version has other files,",
        "and a rebuild there gives a different (equally valid) family.",
        "",
        f"- Training files ({len(corpus['train'])}): " + ", ".join(f"`{r['path']}`" for r in corpus["train"]),
        f"- Held-out files ({len(corpus['held_out'])}, never trained on; the evaluation prompts): "
        + ", ".join(f"`{r['path']}`" for r in corpus["held_out"]),
        f"- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {record['tokenizer']['vocab_size']}, trained on "
        f"the training files; EOS `{record['tokenizer']['eos_token']}` (id {record['tokenizer']['eos_token_id']}) "
        "ends every file.",
        "- Target and draft train on the training files cut into 256-token sequences; the heads learn from",
        "  the frozen target's features over the same sequences (see each config's `data:`).",
    ]
    for name in MODELS:
        r = record.get(name, {})
        if r.get("generated_tokens"):
            lines.append(f"- `{name}` also trains on {r['generated_tokens'] / 1e3:.0f}k tokens of the target's own greedy "
                         f"continuations of corpus windows (written in {r['generate_s'] / 60:.1f} min; "
                         f"{r['train_tokens'] / 1e6:.2f} M training tokens in all).")
    eval_file = Path("runs/zoo_eval/results.json")   # the eval stage's output
    if eval_file.exists():
        lines += ["", "## Evaluation (held-out prompts, greedy)", "", _eval_table(json.loads(eval_file.read_text()))]
    lines += ["", "## Greedy samples from the target (held-out prompts)", ""]
    for prompt, text in _samples(out):
        lines += ["```python", prompt + text, "```", ""]
    (out / "BUILD.md").write_text("\n".join(lines).rstrip() + "\n")


def _eval_table(results: dict) -> str:
    """Per pipeline: accepted tokens per step, tokens/s and speedup from ``specflow run``'s results."""
    rows = ["| pipeline | accepted tokens / step | tokens/s | speedup |", "|---|---|---|---|"]
    for name, p in results["pipelines"].items():
        if "error" in p:
            rows.append(f"| {name} | failed: {p['error']} | | |")
            continue
        rows.append(f"| {name} | {p['accept_length']:.2f} | {p['tokens_per_s']:.1f} | {p['speedup']:.2f}x |")
    return "\n".join(rows) + ("\n\nAccepted tokens per step count the accepted drafts plus the bonus token; "
                              "EAGLE-2 trees of 16 draft tokens (topk 4, depth 6); every pipeline's output "
                              "equals the baseline's. From `specflow run configs/zoo_eval.yaml` "
                              "(runs/zoo_eval/results.md); the CPU was shared with other jobs, so tokens/s "
                              "are noisy.")
