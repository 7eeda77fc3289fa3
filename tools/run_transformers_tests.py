#!/usr/bin/env python
"""Run transformers' own Qwen3-MoE model tests three ways and count where their generate() calls went.

transformers' `tests/models/qwen3_moe/test_modeling_qwen3_moe.py` (with the mixins it inherits: the
model tests, GenerationTesterMixin, the pipeline and training mixins) is run

  none   unpatched, the reference;
  class  with the class-level `moegraph.patch()` applied before any test runs;
  model  with `moegraph.patch(model)` on every Qwen3-MoE model the tests build (at the end of its
         construction, `PreTrainedModel.post_init`, so also inside `from_pretrained`);

each in its own pytest process, on the CPU (CUDA_VISIBLE_DEVICES=""). Every outermost generate() call is
recorded with the test that made it and where it went: moegraph's decode loop, a moegraph fallback
(with moegraph's reason, `decode_stats(model).fallback_reason`), a model moegraph does not cover, or
an exception. The counting wraps `GenerationMixin.generate` and `GraphDecoder.generate` from this
plugin; nothing in moegraph changes for it.

The test sources must match the installed transformers. They come from two places:
- the sdist of the installed version, `pip download transformers==X --no-binary :all: --no-deps`
  (downloaded once into the work dir): `src/` and the top-level `tests/*.py`, exactly that release;
- the files the sdist lacks (`tests/models/qwen3_moe/`, `tests/generation/`, `tests/causal_lm_tester.py`,
  ...) from a transformers git repository given with `--transformers-git` (a checkout or a bare clone),
  at `--ref` (default `v<installed version>`; if that ref is missing, HEAD, and the report says so).
If the files taken from git expect a newer or older transformers, the report lists the compatibility
shims applied (two today: `PreTrainedModel._is_stateful`, which the generation tests read and 5.25 removed,
and `_TEXT_MODEL_TESTER_DEFAULTS`, which some testers import from
`transformers.testing_utils`), and `tests/distributed_testing_utils.py` is stubbed when neither source
has it (the distributed mixins need several processes and skip on one CPU anyway).

Usage (from the repository root):
    git clone --bare https://github.com/huggingface/transformers /tmp/transformers.git   # once
    python tools/run_transformers_tests.py --transformers-git /tmp/transformers.git
    python tools/run_transformers_tests.py --transformers-git ... --modes class -k generate

Writes <workdir>/report-<mode>.json (per test outcome, per generate() call) and prints the table.
Exit status 0 when the patched runs fail exactly the tests the unpatched run fails.
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TEST_FILE = "tests/models/qwen3_moe/test_modeling_qwen3_moe.py"
# what the test file needs beyond the sdist's top-level tests/*.py (each taken only where the sdist lacks it)
GIT_PATHS = [
    "tests/__init__.py", "tests/causal_lm_tester.py", "tests/distributed_testing_utils.py",
    "tests/generation", "tests/exporters", "tests/models/__init__.py", "tests/models/qwen3_moe",
    "tests/utils", "tests/fixtures", "utils/test_module",
]
MODES = ("none", "class", "model")
_STUB_DISTRIBUTED = '''"""Stub written by moegraph's tools/run_transformers_tests.py: the distributed mixins need several processes."""
import unittest


def _skip(*args, **kwargs):
    raise unittest.SkipTest("distributed testing utils are not part of this run (stubbed)")


_get_distributed_backend = _get_distributed_device_type = _get_rank_device = _skip
_set_rank_device = _start_rank_processes = run_distributed = _skip
'''
# the defaults transformers' testers read from transformers.testing_utils in releases that have them
_TEXT_MODEL_TESTER_DEFAULTS = {
    "batch_size": 13, "seq_length": 7, "is_training": True, "use_input_mask": True, "use_labels": True,
    "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 32, "hidden_act": "gelu", "max_position_embeddings": 512,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "expert_interval": 1, "moe_layer_start_index": 0,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 36, "shared_expert_gate": True,
    "moe_num_shared_experts": 2, "num_experts_per_tok": 2, "num_experts": 8,
}


# ----- building the test tree ------------------------------------------------------------------------
def installed_transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def fetch_sdist(version: str, workdir: Path) -> Path:
    """The installed release's sdist, extracted under workdir (downloaded once)."""
    root = workdir / f"transformers-{version}"
    if (root / "src" / "transformers").is_dir():
        return root
    download = workdir / "download"
    download.mkdir(parents=True, exist_ok=True)
    archive = download / f"transformers-{version}.tar.gz"
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                        "--no-deps", "--no-build-isolation", "-d", str(download)], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return root


def _git(repo: Path, *args: str, binary: bool = False):
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    return out.stdout if binary else out.stdout.decode()


def resolve_ref(repo: Path, ref: str) -> tuple[str, str | None]:
    """(commit, note): the ref's commit, or HEAD's with a note when the ref is missing."""
    try:
        return _git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}").strip(), None
    except subprocess.CalledProcessError:
        head = _git(repo, "rev-parse", "HEAD").strip()
        version = _git(repo, "show", f"{head}:src/transformers/__init__.py")
        found = re.search(r'__version__ = "([^"]+)"', version)
        return head, f"ref {ref!r} not in {repo}; test files taken from HEAD {head[:10]} (version " \
                     f"{found.group(1) if found else '?'})"


def build_tree(workdir: Path, git_repo: Path, ref: str) -> tuple[Path, dict]:
    """The sdist's tree plus the test files it lacks from git at `ref`; returns (tree, provenance)."""
    version = installed_transformers_version()
    tree = fetch_sdist(version, workdir)
    commit, note = resolve_ref(git_repo, ref)
    present = [p for p in GIT_PATHS if _git(git_repo, "ls-tree", "--name-only", commit, "--", p).strip()]
    taken = []
    data = _git(git_repo, "archive", "--format=tar", commit, "--", *present, binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile() and not (tree / member.name).exists():
                tar.extract(member, tree, filter="data")
                taken.append(member.name)
    stubbed = []
    if not (tree / "tests" / "distributed_testing_utils.py").exists():
        (tree / "tests" / "distributed_testing_utils.py").write_text(_STUB_DISTRIBUTED)
        stubbed.append("tests/distributed_testing_utils.py")
    provenance = {"transformers": version, "sdist": str(tree), "git": str(git_repo), "ref": ref, "commit": commit,
                  "note": note, "from_git": len(taken), "stubbed": stubbed}
    (tree / "MOEGRAPH_SOURCES.json").write_text(json.dumps(provenance, indent=1))
    return tree, provenance


# ----- the pytest plugin (loaded with -p run_transformers_tests in each run) -----------------------------
_calls: list[dict] = []
_outcomes: dict[str, str] = {}
_longrepr: dict[str, str] = {}
_shims: list[str] = []
_current_test = {"id": None}
_depth = contextvars.ContextVar("moegraph_hf_generate_depth", default=0)
_slot = contextvars.ContextVar("moegraph_hf_generate_slot", default=None)


def _install_shims() -> None:
    import transformers.testing_utils as testing_utils

    if not hasattr(testing_utils, "_TEXT_MODEL_TESTER_DEFAULTS"):
        testing_utils._TEXT_MODEL_TESTER_DEFAULTS = dict(_TEXT_MODEL_TESTER_DEFAULTS)
        _shims.append("transformers.testing_utils._TEXT_MODEL_TESTER_DEFAULTS")
    from transformers import PreTrainedModel

    # generation tests before 5.25 skip stateful models through this class attribute, which 5.25 removed
    if not hasattr(PreTrainedModel, "_is_stateful"):
        PreTrainedModel._is_stateful = False
        _shims.append("transformers.PreTrainedModel._is_stateful = False")


def _install_counting() -> None:
    """Record every outermost generate() call and, when moegraph's decoder took it, what the decoder did."""
    import functools

    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if _depth.get():
            return original(self, *args, **kwargs)
        entry = {"test": _current_test["id"], "model": type(self).__name__, "path": "transformers", "reason": None}
        _calls.append(entry)
        depth, slot = _depth.set(1), _slot.set(entry)
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            if entry["path"] == "transformers":
                entry["path"], entry["reason"] = "raised", f"{type(exc).__name__}: {str(exc)[:200]}"
            raise
        finally:
            _depth.reset(depth)
            _slot.reset(slot)

    GenerationMixin.generate = generate

    try:
        from moegraph.cuda_graph.decoder import GraphDecoder
    except ImportError:
        return
    decoder_generate = GraphDecoder.generate

    def counted(self, hf_generate, args, kwargs):
        # moegraph's generate wrapper sits outside GenerationMixin.generate: this is the outermost call
        entry = _slot.get()
        if entry is None or entry["path"] != "transformers":
            entry = {"test": _current_test["id"], "model": type(self.model).__name__, "path": "transformers",
                     "reason": None}
            _calls.append(entry)
        depth, slot = _depth.set(1), _slot.set(entry)
        try:
            result = decoder_generate(self, hf_generate, args, kwargs)
        except BaseException as exc:
            entry["path"], entry["reason"] = "raised", f"{type(exc).__name__}: {str(exc)[:200]}"
            raise
        finally:
            _depth.reset(depth)
            _slot.reset(slot)
        reason = self.stats.fallback_reason
        entry["path"], entry["reason"] = ("fallback", reason) if reason else ("moegraph", None)
        return result

    GraphDecoder.generate = counted


def _patch_per_model() -> None:
    """moegraph.patch(model) on every Qwen3-MoE model, as its construction ends (post_init)."""
    import functools

    import moegraph
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if getattr(getattr(self, "config", None), "model_type", None) == "qwen3_moe":
            moegraph.patch(self)
        return result

    PreTrainedModel.post_init = post_init


def pytest_configure(config):
    mode = os.environ.get("MOEGRAPH_HF_MODE")
    if mode is None:
        return
    _install_shims()
    _install_counting()
    if mode == "class":
        import moegraph

        moegraph.patch()
    elif mode == "model":
        _patch_per_model()


def pytest_runtest_logstart(nodeid, location):
    _current_test["id"] = nodeid


def pytest_runtest_logreport(report):
    if os.environ.get("MOEGRAPH_HF_MODE") is None:
        return
    if report.when == "call" or report.failed or (report.skipped and report.when == "setup"):
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        if report.nodeid not in _outcomes or outcome in ("failed", "error"):
            _outcomes[report.nodeid] = outcome
        if report.failed:
            _longrepr[report.nodeid] = str(report.longrepr)[-3000:]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MOEGRAPH_HF_REPORT")
    if path is None:
        return
    Path(path).write_text(json.dumps({"mode": os.environ.get("MOEGRAPH_HF_MODE"), "exitstatus": int(exitstatus),
                                      "shims": _shims, "outcomes": _outcomes, "failures": _longrepr,
                                      "generate_calls": _calls}, indent=1))


# ----- running and reporting ---------------------------------------------------------------------------
def run_mode(tree: Path, mode: str, workdir: Path, extra: list[str], timeout: int) -> dict:
    report = workdir / f"report-{mode}.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ, MOEGRAPH_HF_MODE=mode, MOEGRAPH_HF_REPORT=str(report), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent),
                                           str(Path(__file__).resolve().parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "run_transformers_tests", "-p", "no:cacheprovider",
               "-q", "-o", "log_cli=false", *extra]
    print(f"[{mode}] {' '.join(command)}  (in {tree})", flush=True)
    log = workdir / f"pytest-{mode}.log"
    with open(log, "w") as out:
        subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    return load_report(workdir, mode)


def load_report(workdir: Path, mode: str) -> dict:
    report, log = workdir / f"report-{mode}.json", workdir / f"pytest-{mode}.log"
    if not report.exists():
        raise SystemExit(f"[{mode}] pytest wrote no report; see {log}")
    result = json.loads(report.read_text())
    lines = [line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    result["pytest_summary"] = lines[-1].strip("= ") if lines else "?"
    return result


def summarize(results: dict[str, dict]) -> int:
    print()
    print("| run | pytest's summary | tests failed (incl. subtests) | generate() calls | moegraph loop | fallback "
          "| other |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, res in results.items():
        counts = collections.Counter(res["outcomes"].values())
        paths = collections.Counter(c["path"] for c in res["generate_calls"])
        total = len(res["generate_calls"])
        other = total - paths["moegraph"] - paths["fallback"]
        print(f"| {mode} | {res['pytest_summary']} | {counts['failed'] + counts['error']} | {total} | {paths['moegraph'] if mode != 'none' else '-'} | "
              f"{paths['fallback'] if mode != 'none' else '-'} | {other if mode != 'none' else '-'} |")
    status = 0
    base = {t for t, o in results.get("none", {"outcomes": {}})["outcomes"].items() if o in ("failed", "error")}
    for mode, res in results.items():
        if res["shims"]:
            print(f"\n[{mode}] shims: {', '.join(res['shims'])}")
        failing = {t for t, o in res["outcomes"].items() if o in ("failed", "error")}
        if mode != "none" and "none" in results and failing != base:
            status = 1
            for test in sorted(failing - base):
                print(f"\n[{mode}] FAILS only patched: {test}\n{res['failures'].get(test, '')[-1500:]}")
            for test in sorted(base - failing):
                print(f"[{mode}] passes only patched: {test}")
        elif mode == "none" and failing:
            print(f"\n[none] failing unpatched: {sorted(failing)}")
        reasons = collections.defaultdict(list)
        for call in res["generate_calls"]:
            if mode != "none" and call["path"] != "moegraph":
                reasons[(call["path"], call["reason"])].append(call["test"].split("::")[-1] if call["test"] else "?")
        for (path, reason), tests in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            names = sorted(set(tests))
            print(f"[{mode}] {len(tests):3d} x {path}: {reason}\n      in {', '.join(names[:6])}"
                  f"{f' (+{len(names) - 6} more)' if len(names) > 6 else ''}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-git", type=Path, required=True,
                        help="a transformers git repository (checkout or bare clone) for the test files the sdist lacks")
    parser.add_argument("--ref", default=None, help="git ref of those files (default: v<installed version>)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "moegraph-hf-suite")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of none,class,model")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--fresh", action="store_true", help="rebuild the test tree")
    parser.add_argument("--report-only", action="store_true", help="summarize the reports already in --workdir")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --, e.g. -- -k generate")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    if args.report_only:
        return summarize({mode: load_report(args.workdir, mode) for mode in modes})
    version = installed_transformers_version()
    if args.fresh:
        shutil.rmtree(args.workdir / f"transformers-{version}", ignore_errors=True)
    tree, provenance = build_tree(args.workdir, args.transformers_git.resolve(), args.ref or f"v{version}")
    print(json.dumps(provenance, indent=1))
    results = {mode: run_mode(tree, mode, args.workdir, args.pytest_args, args.timeout) for mode in modes}
    return summarize(results)


if __name__ == "__main__":
    sys.exit(main())
