import os
import sys
import zlib
from pathlib import Path

import torch

# The CPU lane runs Triton kernels in the interpreter. Triton reads this when a kernel is defined,
# so it is set before any test module imports kernels/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's choice, without its warning

# `make peers` installs the peers in .venv/peers, which bench.peers puts on sys.path when imported. The
# suite puts it there from the start, so every library agrees on whether DeepSpeed is installed
# (accelerate decides when imported, transformers' Trainer at each call): a page of examples that runs
# the peers must not change what a later page's Trainer finds.
PEERS_DIR = Path(sys.prefix) / "peers"
if PEERS_DIR.is_dir() and str(PEERS_DIR) not in sys.path:
    sys.path.append(str(PEERS_DIR))

import pytest  # noqa: E402

from tests.cuda_semantics import execution  # noqa: E402,F401 - the fixture: plain and CUDA-semantics runs

#: The distributions whose versions decide what the suite exercises, printed in its header: ours, the
#: peers it compares against (bench.peers) and Hugging Face's kernels, which transformers imports.
REPORTED = (
    "torch",
    "triton",
    "transformers",
    "accelerate",
    "safetensors",
    "xxhash",
    "greenlet",
    "kernels",
    "torchtitan",
    "deepspeed",
)


def pytest_report_header(config):
    import importlib.metadata
    import platform

    path = sys.path + [str(PEERS_DIR)]

    def version(name):
        dist = next(iter(importlib.metadata.distributions(name=name, path=path)), None)
        return "-" if dist is None else dist.version

    return ["versions: python " + platform.python_version() + ", " + ", ".join(f"{n} {version(n)}" for n in REPORTED)]


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
