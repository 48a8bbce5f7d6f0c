"""bench/gpu/session.sh's test phase on a machine that lacks a test-only dependency: the GPU tests
must still be collected (the H200 image has no scipy, openai, fastapi, gradio or nbformat, which
CPU-only test modules import)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import sys
for name in ("scipy", "scipy.stats"):
    sys.modules[name] = None  # `import scipy` raises ModuleNotFoundError
"""


@pytest.mark.slow  # (collects the whole suite in a subprocess: a minute on two cores)
def test_the_gpu_test_phase_survives_a_module_that_cannot_import(tmp_path):
    line = next(l for l in (ROOT / "bench" / "gpu" / "session.sh").read_text().split("\n\n")
                if "python -m pytest -m gpu" in l)
    args = shlex.split(re.search(r"python -m pytest (.*?)\"\$@\"", line.replace("\\\n", " "), re.S).group(1))
    (tmp_path / "no_scipy.py").write_text(BLOCKER)
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no_scipy", "--collect-only"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert "tests/test_gpu.py" in proc.stdout or "test_gpu.py" in proc.stdout, proc.stdout[-3000:]
    assert "Interrupted" not in proc.stdout, proc.stdout[-3000:]
