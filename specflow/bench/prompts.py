"""Prompt suites: the project's own small suite by category, and Spec-Bench / MT-bench
``question.jsonl`` files given by path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str                          # the first turn
    later_turns: tuple[str, ...] = ()  # a multi-turn question's next user turns (MT-bench's second)


# Small on purpose: each category probes a different kind of predictability for drafters.
BUILTIN: dict[str, list[str]] = {
    "code": [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
        "def read_lines(path):\n    with open(path) as f:\n        return ",
    ],
    "docstring": [
        "def parse_header(line):\n    \"\"\"",
        "class Cache(object):\n    \"\"\"A simple least-recently-used cache.\n\n    ",
        "def quote(s, safe='/'):\n    \"\"\"Quote ",
    ],
    "repetition": [
        "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = ",
        "if a:\n    return a\nif b:\n    return b\nif c:\n    return c\nif d:\n",
        "    self.a = a\n    self.b = b\n    self.c = c\n    self.d = d\n    self.",
    ],
    "prose": [
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "# This module provides functions for working with",
        "Summarize: speculative decoding drafts several tokens cheaply and verifies them with the "
        "target model in one forward pass, so the output is unchanged while latency drops.\nSummary:",
    ],
}


def builtin_suite() -> list[Prompt]:
    return [Prompt(f"{cat}-{i}", cat, text) for cat, texts in BUILTIN.items() for i, text in enumerate(texts)]


def load_question_jsonl(path: str | Path) -> list[Prompt]:
    """Spec-Bench / MT-bench ``question.jsonl``: ``question_id``, ``category``, ``turns``."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "turns" not in row or not row["turns"]:
            raise ValueError(f"{path}:{n + 1}: a question needs a non-empty 'turns' list")
        prompts.append(Prompt(str(row.get("question_id", n)), row.get("category", "default"), row["turns"][0],
                              tuple(row["turns"][1:])))
    return prompts


def load_suite(suite: str, categories: list[str] | None = None, per_category: int | None = None) -> list[Prompt]:
    """``builtin`` or a path to a question.jsonl; optionally only some categories, the first
    ``per_category`` of each."""
    if suite == "builtin":
        prompts = builtin_suite()
    elif Path(suite).exists():
        prompts = load_question_jsonl(suite)
    else:
        raise ValueError(f"prompts.suite: '{suite}' is neither 'builtin' nor an existing question.jsonl path")
    if categories:
        known = sorted({p.category for p in prompts})
        missing = [c for c in categories if c not in known]
        if missing:
            raise ValueError(f"prompts.categories: unknown category '{missing[0]}'; known: {', '.join(known)}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts
