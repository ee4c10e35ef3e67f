"""tests/host_sync.py on the CPU: a warning issued from a known frame is reported with its caller and
full stack (the GPU test test_gpu_runtime.py::test_overlapped_cuda_steady_state_has_no_host_sync
relies on it to name who synchronized, where torch's own frame would not say)."""

from __future__ import annotations

import inspect
import warnings

import torch

from tests.host_sync import SYNC_MESSAGE, in_torch, record_syncs, report


def _library_sync():
    """Stands for torch.cuda.synchronize: library code whose C++ issues the warning (torch.range
    warns from C++ on every call, as the sync debug mode does)."""
    return torch.range(0, 3)


def _caller():
    line = inspect.currentframe().f_lineno + 1
    _library_sync()
    return line


def _library(frame) -> bool:
    return in_torch(frame) or frame.name == "_library_sync"


def test_a_warning_from_cpp_names_the_caller_with_its_stack():
    with record_syncs(match="torch.range is deprecated", library=_library) as sites:
        for _ in range(2):
            line = _caller()
        _caller()  # the same caller from another line: another stack
    assert len(sites) == 3  # every time, not once per location
    site = sites[0]
    assert site.stack[-1].name == "_library_sync"  # the frame that issued it: not what to fix
    caller = site.caller()
    assert (caller.name, caller.lineno, caller.filename) == ("_caller", line, __file__)
    assert [f.name for f in site.stack[-3:]] == [
        "test_a_warning_from_cpp_names_the_caller_with_its_stack",
        "_caller",
        "_library_sync",
    ]
    assert not site.in_backward
    text = report(sites)
    assert text.startswith(f"--- 2 x {__file__}:{line} in _caller: torch.range is deprecated")
    assert text.count("--- 1 x ") == 1  # the third call, from another line of the test
    assert "in test_a_warning_from_cpp_names_the_caller_with_its_stack" in text  # the full stack follows


def test_torchs_own_frame_is_skipped_and_other_warnings_pass_through(recwarn):
    x = torch.randn(3)
    with record_syncs(match="Implicit dimension choice") as sites:
        line = inspect.currentframe().f_lineno + 1
        torch.nn.functional.softmax(x)  # torch's Python code warns, from torch/nn/functional.py
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    (site,) = sites
    assert in_torch(site.stack[-1])
    caller = site.caller()
    assert (caller.filename, caller.lineno) == (__file__, line)
    assert [str(w.message) for w in recwarn] == ["unrelated"]  # shown as usual, not recorded


def test_sync_debug_message_matches_the_default():
    """The mode's warning text (torch/csrc/cuda: "called a synchronizing CUDA operation")."""
    with record_syncs() as sites:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert SYNC_MESSAGE in "called a synchronizing CUDA operation" and len(sites) == 1
