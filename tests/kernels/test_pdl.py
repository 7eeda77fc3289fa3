"""Programmatic dependent launch: only inside pdl_launches() (the decode graphs' warm-up and capture), only where the
device has it, and every kernel that may be launched with it waits for the previous kernel before it reads or writes
anything an earlier kernel touches (a static check of the kernels' source: a kernel added without the wait fails)."""

import ast
import inspect
import pathlib

import torch

from moegraph.kernels import _triton

KERNELS = pathlib.Path(_triton.__file__).parent


def test_pdl_arguments_only_inside_the_scope_and_on_a_device_that_has_it(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert _triton.pdl(cpu) == {}
    with _triton.pdl_launches():
        assert _triton.pdl(cpu) == {}  # no PDL off CUDA
    monkeypatch.setattr(_triton, "_pdl_on", lambda device_type, index: device_type == "cuda")
    assert _triton.pdl(gpu) == {}  # eager launches: plain
    with _triton.pdl_launches():
        with _triton.pdl_launches():
            assert _triton.pdl(gpu) == {"USE_PDL": True, "launch_pdl": True}
        assert _triton.pdl(gpu) == {"USE_PDL": True, "launch_pdl": True}  # the outer scope still holds
        with _triton.pdl_launches(early_trigger=False):
            assert _triton.pdl(gpu) == {"USE_PDL": 2, "launch_pdl": True}  # the next kernel launches after the wait
            monkeypatch.setattr(_triton, "PDL_EARLY_TRIGGER", True)  # a benchmark's override
            assert _triton.pdl(gpu) == {"USE_PDL": 1, "launch_pdl": True}
            monkeypatch.setattr(_triton, "PDL_EARLY_TRIGGER", None)
        assert _triton.pdl(gpu) == {"USE_PDL": 1, "launch_pdl": True}  # the outer scope's trigger is back
    assert _triton.pdl(gpu) == {}


def _kernels_launched_with_pdl():
    """(file, kernel name, its FunctionDef) of every kernel (a `_*_kernel` function) with a USE_PDL parameter."""
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and any(a.arg == "USE_PDL" for a in node.args.args)):
                yield path.name, node.name, node


def test_every_pdl_kernel_waits_before_it_touches_memory_an_earlier_kernel_wrote():
    found = list(_kernels_launched_with_pdl())
    names = {name for _, name, _ in found}
    assert {"_gemv_group_kernel", "_rms_norm_kernel", "_split_kernel", "_pair_gate_up_silu_kernel",
            "_gate_up_silu_nf4_kernel", "_nf4_linear_group_kernel"} <= names
    for file, name, node in found:
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        waits = [c for c in calls if getattr(c.func, "id", None) == "pdl_wait"]
        if name == "_gemv_group_kernel":  # delegates to _gemv_tile, which waits after its first weight load
            assert not waits and all(any(getattr(a, "id", None) == "USE_PDL" for a in c.args) for c in calls
                                     if getattr(c.func, "id", None) == "_gemv_tile")
            continue
        body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        first = body[0]  # after the docstring
        if isinstance(first, ast.AnnAssign) and first.target.id == "EARLY":  # the NF4 kernels' EARLY_WEIGHTS
            _assert_early_weights(file, name, node, first, body[1])
            continue
        assert (isinstance(first, ast.Expr) and getattr(first.value.func, "id", None) == "pdl_wait"), \
            f"{file}:{name} must call pdl_wait(USE_PDL) first"


def _assert_early_weights(file, name, node, early, second):
    """A kernel that may leave its wait to the NF4 loop: it waits first unless EARLY, and then hands USE_PDL to
    _nf4_matmul, whose words loop loads only weights before waiting; one that reads the routing before the wait
    (the down kernel) does so only with the late trigger (USE_PDL 2: that routing is two kernels back)."""
    condition = ast.unparse(early.value)
    assert "EARLY_WEIGHTS" in condition, f"{file}:{name}"
    assert (isinstance(second, ast.If) and ast.unparse(second.test) == "not EARLY"
            and ast.unparse(second.body[0]) == "pdl_wait(USE_PDL)"), f"{file}:{name} must wait first unless EARLY"
    matmuls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "_nf4_matmul"]
    waits = [ast.unparse(kw.value) for c in matmuls for kw in c.keywords if kw.arg == "WAIT"]
    assert matmuls and waits == ["USE_PDL if EARLY else 0"] * len(matmuls), f"{file}:{name} must hand _nf4_matmul its wait"
    reads_routing = "_moe_program" in ast.unparse(node)
    assert not reads_routing or "USE_PDL == 2" in condition, f"{file}:{name} reads the routing before its wait"


def test_the_nf4_loop_waits_after_loading_only_weights():
    """_nf4_matmul's WAIT: the words loop issues its first weight loads, then waits, then reads x (in the word asm);
    the bytes loop waits before anything."""
    from moegraph.kernels import _nf4

    words = inspect.getsource(_nf4._nf4_matmul_words.fn)
    before_wait = words[:words.index("pdl_wait(WAIT)")]
    assert "_nf4_load_words(" in before_wait
    assert "_word_dot(" not in before_wait and "tl.store" not in before_wait and "tl.load(x" not in before_wait
    matmul = inspect.getsource(_nf4._nf4_matmul.fn)
    bytes_branch = matmul[matmul.index("    else:"):]
    assert bytes_branch.index("pdl_wait(WAIT)") < bytes_branch.index("_nf4_matmul_bytes(")


def test_the_gemv_waits_before_it_reads_x_and_after_loading_only_weights():
    from moegraph.kernels import gemv

    for form, loads_weights_first in ((gemv._gemv_tile_fma, True), (gemv._gemv_tile_dot, False)):
        source = inspect.getsource(form.fn)
        before_wait = source[:source.index("pdl_wait(USE_PDL)")]
        assert "x_ptr +" not in before_wait and "tl.store" not in before_wait and "tl.dot" not in before_wait
        assert ("tl.load(w_rows" in before_wait) == loads_weights_first


def test_pdl_status_says_why_not(monkeypatch):
    assert _triton.pdl_status(torch.device("cpu")) in ("cpu is not CUDA",
                                                       "this Triton has no grid dependency control (launch_pdl, gdc_wait)")
    if _triton._HAVE_GDC:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert _triton.pdl_status(torch.device("cuda", 0)) == "sm_80 (it needs sm_90+)"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert _triton.pdl_status(torch.device("cuda", 0)) is None
        monkeypatch.setenv("MOEGRAPH_PDL", "0")
        assert _triton.pdl_status(torch.device("cuda", 0)) == "MOEGRAPH_PDL=0"


def test_info_says_how_graphs_launch(capsys):
    from moegraph.cli import main

    assert main(["info"]) == 0
    assert "graph launches " in capsys.readouterr().out
