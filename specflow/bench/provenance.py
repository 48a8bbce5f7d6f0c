"""Where a run's numbers come from: the specflow checkout's commit, whether it had uncommitted
changes, and the hardware that timed it (results.json's ``git_commit``, ``git_dirty`` and
``device_name``)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding specflow/bench/provenance.py
# the checkout's importable packages: registry.plugin_sources leaves their modules to git_commit
PACKAGES = ("specflow", "drafters", "trees", "verifiers")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    """``git -C root *args``; None when git is missing or slower than its timeout."""
    try:  # (called once the baseline has run: a slow git must not lose it)
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(root: Path = ROOT) -> str | None:
    """The commit of the specflow checkout this runs from; None when it is not a git checkout."""
    out = _git(root, "rev-parse", "--show-toplevel", "HEAD")
    if out is None:
        return None
    lines = out.stdout.splitlines()
    # an installed copy may sit inside another repository: only the checkout's own commit counts
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None
    return lines[1]


def git_dirty(root: Path = ROOT) -> bool | None:
    """Whether the code of the specflow checkout differs from its commit (None: no checkout): a
    tracked file of its packages changed, or a module in them that git does not track (a
    ``--plugin drafters/mine.py``, which plugin_sources counts as built in: its code is in no
    commit and has no sha256). Files outside the packages (bench/results/, a README) are not code
    that ran."""
    if git_commit(root) is None:
        return None
    tracked = _git(root, "status", "--porcelain", "--untracked-files=no", "--", *PACKAGES)
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *PACKAGES)
    if tracked is None or untracked is None or tracked.returncode or untracked.returncode:
        return None
    return bool(tracked.stdout.strip()) or any(f.endswith(".py") for f in untracked.stdout.splitlines())


def device_name(device: torch.device) -> str:
    """The hardware whose times a run reports: the GPU's name, else the CPU's model (``device`` alone,
    "cuda" or "cpu", says nothing of an H100 against an A10, or of the CPU's cores)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:  # (not Linux)
        pass
    return platform.processor() or platform.machine()
