"""Where a step synchronizes the host, by caller: every warning that ``torch.cuda.set_sync_debug_mode("warn")``
issues, recorded with the Python stack that issued it.

The warning's own file and line are torch's (``torch/cuda/__init__.py`` for ``torch.cuda.synchronize``,
say), which does not tell what to fix; the stack does. The warnings module calls ``showwarning`` on
the thread that issues the warning, before returning to the code that issued it, for warnings from
Python and from C++ (``PyErr_WarnEx``) alike, so :func:`record_syncs` replaces it and takes the stack
there. One limit: a warning issued inside ``backward()`` on autograd's own device thread reaches
Python only when the backward returns (the engine replays it), so its stack ends at that
``backward()`` call; :attr:`SyncSite.in_backward` says so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import traceback
import warnings
from typing import Callable, Iterator, List, Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The warnings machinery's own frames (Python 3.14 moved it to _py_warnings.py), left out of the stacks.
_WARNINGS_FILES = {
    os.path.join(os.path.dirname(os.path.abspath(warnings.__file__)), name)
    for name in ("warnings.py", "_py_warnings.py")
}
#: torch's synchronizing-call warning says "called a synchronizing CUDA operation".
SYNC_MESSAGE = "synchronizing"


def in_torch(frame: traceback.FrameSummary) -> bool:
    """Whether ``frame`` is torch's own code."""
    return frame.filename.startswith(_TORCH_DIR)


@dataclasses.dataclass
class SyncSite:
    """One recorded warning: its message and the stack that issued it (outermost first; the frames of
    the warnings machinery and of the recorder left out)."""

    message: str
    stack: List[traceback.FrameSummary]
    library: Callable[[traceback.FrameSummary], bool] = in_torch

    def caller(self) -> Optional[traceback.FrameSummary]:
        """The innermost frame outside the library (torch): the code that made the synchronizing call."""
        return next((f for f in reversed(self.stack) if not self.library(f)), None)

    @property
    def in_backward(self) -> bool:
        """Issued from inside ``backward()`` (autograd's engine): replayed there if the sync ran on its
        device thread, whose Python frames are then not in :attr:`stack`."""
        return any(in_torch(f) and f.name in ("_engine_run_backward", "run_backward") for f in self.stack)

    def key(self) -> tuple:
        return tuple((f.filename, f.lineno) for f in self.stack)

    def format(self) -> str:
        c = self.caller()
        where = f"{c.filename}:{c.lineno} in {c.name}" if c else "(no frame outside the library)"
        text = f"{where}: {self.message}"
        if self.in_backward:
            text += "\n  (inside backward(): if it ran on autograd's device thread, its frames are not below)"
        return text + "\n" + "".join(traceback.format_list(self.stack))


@contextlib.contextmanager
def record_syncs(
    match: str = SYNC_MESSAGE, library: Callable[[traceback.FrameSummary], bool] = in_torch
) -> Iterator[List[SyncSite]]:
    """Record every warning whose message contains ``match`` while active, each time it is issued
    (the "always" filter), with its stack; other warnings are shown as usual. Yields the list of
    :class:`SyncSite`, filled in issue order."""
    sites: List[SyncSite] = []
    with warnings.catch_warnings():  # (restores showwarning and the filters on exit)
        warnings.simplefilter("always")
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if match not in str(message):
                return show(message, category, filename, lineno, file, line)
            stack = [f for f in traceback.extract_stack()[:-1] if os.path.abspath(f.filename) not in _WARNINGS_FILES]
            sites.append(SyncSite(str(message), stack, library))

        warnings.showwarning = showwarning
        yield sites


def report(sites: List[SyncSite]) -> str:
    """Each distinct stack once, most frequent first, with its count: what to fix, by caller."""
    counts = collections.Counter(s.key() for s in sites)
    first = {}
    for s in sites:
        first.setdefault(s.key(), s)
    return "\n".join(f"--- {n} x {first[k].format()}" for k, n in counts.most_common())
