import logging
import os

import torch

if not torch.cuda.is_available():
    # Run moegraph's Triton kernels on the CPU through Triton's interpreter. Triton reads this when a
    # kernel is decorated, so it is set before moegraph is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
