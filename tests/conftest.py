import logging
import os

import torch

if not torch.cuda.is_available():
    # Run moegraph's Triton kernels on the CPU through Triton's interpreter. Triton reads this when a
    # kernel is decorated, so it is set before moegraph is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist workers (the README's `-n 2`) share the machine's cores rather than each taking them all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _keep_bitsandbytes_cpu_layout():
    """bitsandbytes (>= 0.49) repacks a Linear4bit in place on its first CPU forward where the CPU has AVX512-BF16
    (absmax rounded to bf16, another byte order; saving it back is lossy), so its CPU results would depend on the CI
    machine's CPU. The tests compare against bitsandbytes' exact format, the one CUDA computes with; the repacked
    layout itself is tested in tests/quant/test_nf4_generate.py."""
    try:
        import bitsandbytes.nn.modules as bnb_modules
    except ImportError:
        return
    if hasattr(bnb_modules, "has_avx512bf16"):
        bnb_modules.has_avx512bf16 = lambda: False


_keep_bitsandbytes_cpu_layout()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _seed_and_clean():
    torch.manual_seed(0)
    yield
    import moegraph

    moegraph.unpatch()  # no test leaks a class-level patch into the next


@pytest.fixture
def moegraph_logs(caplog):
    caplog.set_level(logging.INFO, logger="moegraph")
    return caplog
