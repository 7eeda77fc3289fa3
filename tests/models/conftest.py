"""The family tests run on a few hundred elements per tensor: a second intra-op thread only adds synchronisation,
which costs seconds on a CPU shared with other work (a family file took ~12 s with one thread, up to ~35 s with two
on a loaded 2-core machine). Both sides of every comparison run with the same setting."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
