"""Where a run's numbers come from: the specflow checkout's commit and whether it had uncommitted
changes (results.json's ``git_commit`` and ``git_dirty``)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The commit of the specflow checkout this runs from; None when it is not a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git
        return None
    lines = out.stdout.splitlines()
    # an installed copy may sit inside another repository: only the checkout's own commit counts
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None
    return lines[1]


def git_dirty() -> bool | None:
    """Whether the specflow checkout's tracked files differ from its commit (None: no checkout)."""
    if git_commit() is None:
        return None
    root = Path(__file__).resolve().parents[2]
    try:  # (called once the baseline has run: a slow git must not lose it)
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None
