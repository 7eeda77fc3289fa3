"""Every notebook in notebooks/ runs top to bottom on the CPU with a tiny random model and no network, and a
notebook stored with outputs says where they came from.

The runs go through tools/run_notebooks.py (as the GPU runs do) with its "ci" set: the notebooks' parameter cell
(tagged "parameters") names the real Hub model; as papermill does, a cell injected after it sets the CI values:
the "tiny" moegraph.testing preset (random weights built in the kernel; four_bit saves them as a checkpoint and
loads it back in 4-bit), float32, few tokens. quickstart and benchmark also run on a checkpoint folder from
moegraph.testing.save_tiny_checkpoint, the path a Hub name takes. Any cell error fails the test, with the cell's
traceback.
"""

import concurrent.futures
import importlib.util
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

# one pytest-xdist worker runs them all (`--dist loadgroup`): the module fixture below starts every run at once
pytestmark = pytest.mark.xdist_group("notebooks")
ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_S = 300


def load_runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "tools" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = load_runner()
CI = runner.SETS["ci"]


def test_every_notebook_has_ci_and_h200_parameters():
    names = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == sorted(runner.ORDER) == sorted(CI) == sorted(runner.SETS["h200"])
    for name in names:
        defined = runner.parameter_names(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
        for set_name, values in runner.SETS.items():
            assert set(values[name]) <= defined, (set_name, name, set(values[name]) - defined)


def check_stored_outputs(notebook, name):
    """A notebook stored with outputs carries the record of a tools/run_notebooks.py run on a GPU that ended well."""
    if not any(c.get("outputs") for c in notebook.cells if c.cell_type == "code"):
        return  # stored without outputs
    run = notebook.metadata.get("moegraph_run")
    assert run, f"{name}.ipynb has outputs but no metadata.moegraph_run: run tools/run_notebooks.py, or clear them"
    assert run["device"] != "cpu" and run["set"] != "ci", f"{name}.ipynb: outputs of a CPU / CI run ({run['device']})"
    assert run["status"] == "ok", f"{name}.ipynb: the stored run did not finish: {run['status'][:500]}"
    for key in ("date", "torch", "transformers", "moegraph", "parameters", "wall_s"):
        assert run.get(key) is not None, f"{name}.ipynb: moegraph_run lacks {key}"
    injected = [c for c in notebook.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == (1 if run["parameters"] else 0)


@pytest.mark.parametrize("name", sorted(CI))
def test_stored_outputs_come_from_a_gpu_run(name):
    check_stored_outputs(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4), name)


def test_stored_outputs_check_rejects_a_cpu_run_and_takes_a_gpu_run():
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    notebook.metadata.pop("moegraph_run", None)  # as stored without outputs (the stored one may hold a GPU run's)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    check_stored_outputs(notebook, "quickstart")  # no outputs: nothing to check
    code = next(c for c in notebook.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="hello")]
    with pytest.raises(AssertionError, match="no metadata.moegraph_run"):
        check_stored_outputs(notebook, "quickstart")
    runner.inject_parameters(notebook, {"MODEL": "qwen3-30b-a3b"}, "a test")
    run = dict(device="cpu", set="ci", status="ok", date="2026-12-04T06:00:00+00:00", torch="2.11.0",
               transformers="5.25.0", moegraph="0.1.0", parameters={"MODEL": "qwen3-30b-a3b"}, wall_s=60.0)
    notebook.metadata["moegraph_run"] = run
    with pytest.raises(AssertionError, match="CPU / CI run"):
        check_stored_outputs(notebook, "quickstart")
    notebook.metadata["moegraph_run"] = dict(run, device="NVIDIA H200", set="h200", status="failed in cell 9: ...")
    with pytest.raises(AssertionError, match="did not finish"):
        check_stored_outputs(notebook, "quickstart")
    notebook.metadata["moegraph_run"] = dict(run, device="NVIDIA H200", set="h200")
    check_stored_outputs(notebook, "quickstart")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moegraph.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), num_layers=2)


def _offline_kernel_env(monkeypatch):
    # the kernels inherit this environment: this checkout's moegraph, no Hub access, no display
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU decode path needs no Triton


VARIANTS = {"test_notebook_runs_top_to_bottom_on_a_preset": "preset",
            "test_notebook_runs_top_to_bottom_on_a_checkpoint": "checkpoint"}


@pytest.fixture(scope="module")
def notebook_runs(request, checkpoint, tmp_path_factory):
    """The selected runs started at once, two kernels at a time: a kernel spends most of its run importing torch
    and transformers on one core, so on a 2-core machine two side by side take about the time of one."""
    runs = [(item.callspec.params["name"], VARIANTS[item.originalname]) for item in request.session.items
            if item.originalname in VARIANTS and item.module is request.module]
    with pytest.MonkeyPatch.context() as monkeypatch, concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        _offline_kernel_env(monkeypatch)
        futures = {}
        for name, variant in runs:
            values = dict(CI[name], MODEL=str(checkpoint)) if variant == "checkpoint" else CI[name]
            futures[name, variant] = pool.submit(_run, name, values, tmp_path_factory.mktemp(f"{name}_{variant}"))
        yield futures


def _run(name, values, folder):
    record = runner.run_notebook(NOTEBOOKS / f"{name}.ipynb", folder / f"{name}.ipynb", values,
                                 origin="tests/test_notebooks.py", run_info={"device": "cpu", "set": "ci"},
                                 cell_timeout_s=CELL_TIMEOUT_S)
    return record, folder / f"{name}.ipynb"


def check_run(notebook_runs, name, variant):
    record, path = notebook_runs[name, variant].result()
    print(f"{name} ({variant}): {record['wall_s']:.1f} s")
    assert record["status"] == "ok", record["status"]
    executed = nbformat.read(path, as_version=4)
    assert executed.metadata["moegraph_run"]["status"] == "ok"
    assert all(c.execution_count for c in executed.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", sorted(CI))
def test_notebook_runs_top_to_bottom_on_a_preset(name, notebook_runs):
    check_run(notebook_runs, name, "preset")


@pytest.mark.parametrize("name", ["benchmark", "quickstart"])
def test_notebook_runs_top_to_bottom_on_a_checkpoint(name, notebook_runs):
    check_run(notebook_runs, name, "checkpoint")  # benchmark: NUM_LAYERS cuts the folder's config


def test_injected_cell_replaces_an_earlier_one():
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    runner.inject_parameters(notebook, {"MODEL": "a"}, "first")
    runner.inject_parameters(notebook, {"MODEL": "b"}, "second")
    injected = [c for c in notebook.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "MODEL = 'b'" in injected[0].source
    index = runner.parameters_index(notebook)
    assert notebook.cells[index + 1] is injected[0]
