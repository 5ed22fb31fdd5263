"""Test tiers: the default run deselects `slow` and `dist` (pyproject addopts; `-m slow`,
`-m dist` select them, scripts/test.sh runs the default and dist tiers); `gpu` tests skip
without CUDA. Subprocesses run on the interpreter that runs pytest (tests/helpers.py). In-process
tests run on one intra-op thread: the tensors are tiny, and on a shared 2-core machine two
threads spin-wait (measured 4x slower); subprocesses get OMP_NUM_THREADS=1 from
tests/helpers.py."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
