"""Every notebook in notebooks/ runs top to bottom on the CPU with the tiny random checkpoint and no network.

The notebooks' parameter cell (tagged "parameters") names the real Hub model; as papermill does, a cell injected
after it sets the CI values: a local checkpoint from moegraph.testing.save_tiny_checkpoint, float32, few tokens.
Any cell error fails the test, with the cell's traceback.
"""

import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_S = 300

# CI values per notebook, injected after its parameter cell
SMALL = dict(DTYPE="float32", MAX_NEW_TOKENS=4, BATCH_SIZE=2, TIMED_RUNS=1)
PARAMETERS = {
    "quickstart.ipynb": SMALL,
    "four_bit.ipynb": SMALL,
    "benchmark.ipynb": dict(DTYPE="float32", NUM_LAYERS=1, BATCH_SIZES=[1, 2], BACKENDS=["hf", "moegraph"],
                            NEW_TOKENS=4, RUNS=1, PROMPT_LENGTHS=(4, 8)),
}


def test_every_notebook_has_ci_parameters():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(PARAMETERS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moegraph.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), num_layers=2)


@pytest.fixture
def offline_kernel_env(monkeypatch):
    # the kernel inherits this environment: this checkout's moegraph, no Hub access, no display
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU decode path needs no Triton


def inject_parameters(notebook, values: dict):
    """Insert a cell setting `values` after the cell tagged "parameters", as papermill does."""
    tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    source = "# CI parameters (injected by tests/test_notebooks.py)\n" + "\n".join(
        f"{name} = {value!r}" for name, value in values.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(tagged[0] + 1, cell)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_notebook_runs_top_to_bottom(name, checkpoint, offline_kernel_env):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), (
        f"{name} is stored with outputs; clear them")
    inject_parameters(notebook, {"MODEL": str(checkpoint), **PARAMETERS[name]})
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    print(f"{name}: {time.perf_counter() - start:.1f} s")
