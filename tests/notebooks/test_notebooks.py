"""The notebooks run top to bottom on the shipped zoo: any cell error (including a failed assert,
such as greedy speculative output differing from plain decoding) fails the test."""

from pathlib import Path

import pytest

REASON = "needs nbformat, nbclient and ipykernel (the dev extra: pip install -e '.[dev]')"
nbformat = pytest.importorskip("nbformat", reason=REASON)
NotebookClient = pytest.importorskip("nbclient", reason=REASON).NotebookClient
pytest.importorskip("ipykernel", reason=REASON)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "specflow-tests"
CELL_TIMEOUT_S = 600  # a hang guard, far above any cell's run time


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory) -> Path:
    """A data dir holding a kernelspec for the interpreter running the tests (the spec ipykernel
    installs names a bare ``python``, which may not be this one)."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, prefix=str(prefix))
    return prefix / "share" / "jupyter"


def test_the_notebooks_are_found():
    assert {"01_python_api", "02_new_drafter", "03_step_records"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, jupyter_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.delenv("SPECFLOW_ZOO", raising=False)  # the shipped zoo, never a stand-in
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
