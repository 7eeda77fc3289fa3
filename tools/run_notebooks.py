#!/usr/bin/env python3
"""Execute notebooks/*.ipynb top to bottom with nbclient and store them with their outputs.

    python3 tools/run_notebooks.py --set h200                 # full-size presets on the GPU, outputs into notebooks/
    python3 tools/run_notebooks.py --set h200 --out $OUT      # the same, written elsewhere
    python3 tools/run_notebooks.py --set ci --only quickstart -p MAX_NEW_TOKENS=8

As papermill does, a cell tagged "injected-parameters" is inserted after each notebook's cell tagged "parameters"
(one left by an earlier run is replaced): the chosen set's values for that notebook, then the `-p NAME=VALUE`
overrides (VALUE read as a Python literal, else taken as a string) that the notebook's parameter cell defines.
Without --set the notebooks' own defaults (the Hub model) run.

The notebook is written after every cell, so a run stopped by a timeout still leaves the outputs it made. Its
metadata gets `moegraph_run`: the device (GPU name, or "cpu"), the versions of python, torch, transformers,
bitsandbytes and moegraph, the date, the set and the injected parameters, the wall time, and the status ("ok",
or the cell that failed or ran out of time). `--deadline-s` bounds the whole run: a cell still running then is
interrupted, and the notebooks not started are left as they are.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import os
import pathlib
import platform
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
ORDER = ("quickstart", "benchmark", "four_bit")  # the two without 4-bit first: they matter most within a deadline

# Parameter sets: notebook -> values injected after its parameter cell.
# ci: the tiny preset on the CPU in float32, a few tokens (tests/test_notebooks.py runs these).
# h200: Qwen3-30B-A3B shapes with random weights, bf16, sized so that the three run in about 7 minutes on one H200
# (quickstart and benchmark all 48 layers; four_bit 12 layers, as it writes a dense checkpoint to disk and loads
# it twice).
SETS: dict[str, dict[str, dict]] = {
    "ci": {
        "quickstart": dict(MODEL="tiny", NUM_LAYERS=2, DTYPE="float32", MAX_NEW_TOKENS=4, BATCH_SIZE=2, TIMED_RUNS=1),
        "four_bit": dict(MODEL="tiny", NUM_LAYERS=2, DTYPE="float32", MAX_NEW_TOKENS=4, BATCH_SIZE=2, TIMED_RUNS=1),
        "benchmark": dict(MODEL="tiny", NUM_LAYERS=1, DTYPE="float32", BATCH_SIZES=[1, 2], BACKENDS=["hf", "moegraph"],
                          NEW_TOKENS=4, RUNS=1, PROMPT_LENGTHS=(4, 8)),
    },
    "h200": {
        "quickstart": dict(MODEL="qwen3-30b-a3b", NUM_LAYERS=48, DTYPE="bfloat16", MAX_NEW_TOKENS=128, BATCH_SIZE=8,
                           TIMED_RUNS=2),
        "benchmark": dict(MODEL="qwen3-30b-a3b", NUM_LAYERS=48, DTYPE="bfloat16", BATCH_SIZES=[1, 8, 32, 64],
                          BACKENDS=["hf", "moegraph"], NEW_TOKENS=64, RUNS=1, PROMPT_LENGTHS=(16, 128),
                          TOTAL_BUDGET_S=150),
        "four_bit": dict(MODEL="qwen3-30b-a3b", NUM_LAYERS=12, DTYPE="bfloat16", MAX_NEW_TOKENS=64, BATCH_SIZE=8,
                         TIMED_RUNS=2),
    },
}
DEADLINE_S = {"h200": 480.0}  # leaves room for the carry's install inside a 9-minute call
CELL_TIMEOUT_S = 600


def parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parameter_names(notebook) -> set[str]:
    """The names the cell tagged "parameters" assigns."""
    cell = notebook.cells[parameters_index(notebook)]
    names = set()
    for node in ast.parse(cell.source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def parameters_index(notebook) -> int:
    tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"expected one cell tagged 'parameters', found {len(tagged)}")
    return tagged[0]


def inject_parameters(notebook, values: dict, origin: str) -> None:
    """Insert (or replace) the cell tagged "injected-parameters" after the parameter cell."""
    import nbformat

    notebook.cells = [c for c in notebook.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    if not values:
        return
    source = f"# Parameters (injected by {origin})\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    notebook.cells.insert(parameters_index(notebook) + 1, cell)


def clear_outputs(notebook) -> None:
    notebook.metadata.pop("moegraph_run", None)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)


def environment() -> dict:
    """What the outputs were made with (the kernel runs this same python with this environment)."""
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    import torch

    sys.path.insert(0, str(ROOT))
    import moegraph

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpu_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda if cuda else None, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": version("transformers"),
            "bitsandbytes": version("bitsandbytes"), "triton": version("triton"), "moegraph": moegraph.__version__,
            "host": platform.node()}


def kernel_env(offline: bool) -> None:
    """Set in this process, inherited by each kernel: this checkout's moegraph, no Hub, writable Jupyter folders."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    if offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if not os.access(os.path.expanduser("~"), os.W_OK):  # e.g. a read-only home on a GPU machine
        scratch = tempfile.mkdtemp(prefix="run_notebooks-")
        for name in ("JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
            os.environ.setdefault(name, os.path.join(scratch, name.lower()))


def run_notebook(source: pathlib.Path, target: pathlib.Path, values: dict, *, origin: str, run_info: dict,
                 deadline: float = float("inf"), cell_timeout_s: float = CELL_TIMEOUT_S) -> dict:
    """Execute `source` with `values` injected, writing `target` after every cell; returns its `moegraph_run`."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    notebook = nbformat.read(source, as_version=4)
    clear_outputs(notebook)
    inject_parameters(notebook, values, origin)
    started = time.perf_counter()
    record = dict(run_info, parameters=values, status="running",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    target.parent.mkdir(parents=True, exist_ok=True)

    def save():
        record["wall_s"] = round(time.perf_counter() - started, 1)
        notebook.metadata["moegraph_run"] = record  # nbformat stores a copy: set again at every save
        nbformat.write(notebook, target)

    client = NotebookClient(notebook, timeout=cell_timeout_s, kernel_name="python3", interrupt_on_timeout=False,
                            resources={"metadata": {"path": str(source.parent)}})
    save()
    try:
        with client.setup_kernel():
            info = client.wait_for_reply(client.kc.kernel_info())
            notebook.metadata["language_info"] = info["content"]["language_info"]
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type != "code":
                    continue
                left = deadline - time.perf_counter()
                if left <= 1:
                    record["status"] = f"deadline: not run from cell {index} on"
                    break
                client.timeout = int(min(cell_timeout_s, left))
                try:
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                except CellTimeoutError:
                    record["status"] = f"timed out in cell {index} after {client.timeout} s"
                    break
                except (CellExecutionError, DeadKernelError) as error:
                    record["status"] = f"failed in cell {index}: {error}"
                    break
                finally:
                    save()
            else:
                record["status"] = "ok"
    finally:
        save()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), help="parameter set (default: the notebooks' own defaults)")
    parser.add_argument("-p", action="append", default=[], metavar="NAME=VALUE", help="override, repeatable")
    parser.add_argument("--out", type=pathlib.Path, help="folder for the executed notebooks (default: notebooks/ "
                        "itself; for --set ci a temporary folder)")
    parser.add_argument("--only", action="append", choices=ORDER, help="run this notebook only (repeatable)")
    parser.add_argument("--deadline-s", type=float, help="bound on the whole run (default: 480 for --set h200)")
    parser.add_argument("--cell-timeout-s", type=float, default=CELL_TIMEOUT_S)
    args = parser.parse_args(argv)

    overrides = {}
    for item in args.p:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"-p {item!r}: expected NAME=VALUE")
        overrides[name] = parse_value(value)
    out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="notebooks-ci-")) if args.set == "ci" else NOTEBOOKS)
    deadline_s = args.deadline_s if args.deadline_s is not None else DEADLINE_S.get(args.set, float("inf"))
    deadline = time.perf_counter() + deadline_s

    import nbformat

    names = [n for n in ORDER if not args.only or n in args.only]
    plans = {}
    for name in names:
        notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        defined = parameter_names(notebook)
        values = dict(SETS[args.set][name]) if args.set else {}
        values.update({k: v for k, v in overrides.items() if k in defined})
        unknown = set(values) - defined
        if unknown:
            parser.error(f"{name}: {sorted(unknown)} not in its parameter cell ({sorted(defined)})")
        plans[name] = values
    unused = set(overrides) - {k for values in plans.values() for k in values}
    if unused:
        parser.error(f"-p {sorted(unused)}: in no parameter cell of {names}")

    kernel_env(offline=args.set is not None)
    run_info = environment()
    run_info["set"] = args.set
    run_info["command"] = "python3 tools/run_notebooks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{run_info['device']}: python {run_info['python']}, torch {run_info['torch']}, transformers "
          f"{run_info['transformers']}, bitsandbytes {run_info['bitsandbytes']}, moegraph {run_info['moegraph']}; "
          f"set {args.set}, out {out}, deadline {deadline_s:.0f} s", flush=True)
    failed = 0
    for name, values in plans.items():
        if deadline - time.perf_counter() < 10:
            print(f"{name}: not run, the deadline is near; {out / (name + '.ipynb')} left as it was", flush=True)
            failed += 1
            continue
        record = run_notebook(NOTEBOOKS / f"{name}.ipynb", out / f"{name}.ipynb", values,
                              origin="tools/run_notebooks.py" + (f" --set {args.set}" if args.set else ""),
                              run_info=run_info, deadline=deadline, cell_timeout_s=args.cell_timeout_s)
        failed += record["status"] != "ok"
        print(f"{name}: {record['wall_s']:.1f} s, {record['status'][:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
