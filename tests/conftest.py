import os
import zlib

import torch

# The CPU lane runs Triton kernels in the interpreter. Triton reads this when a kernel is defined,
# so it is set before any test module imports kernels/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.cuda_semantics import execution  # noqa: E402,F401 - the fixture: plain and CUDA-semantics runs


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (the GPU lane: pytest -m gpu)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU lane: needs CUDA; its CPU twin runs under TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: fresh inputs per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
