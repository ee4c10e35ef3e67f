"""Run a function in W real processes with a gloo group; a hang fails within a timeout."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _entry(fn, rank, world, init_file, queue, args, environ):
    import torch
    import torch.distributed as dist

    # The fork server's environment is the one it started with: the rank takes the test's, as a
    # spawned process would (tests set LANCET_TIMEOUT_S, LANCET_KERNELS, ... for their ranks).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report everything to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


HANG_GUARD_S = 600.0

#: Imported once by the fork server the ranks are forked from, instead of by every rank: a spawned
#: rank spent about 3 s importing torch and lancet_rt (5 s with transformers), most of a gloo test.
#: What these modules read from the environment at import time (TRITON_INTERPRET) is the test
#: session's when the first gloo test starts the server; what they read at call time is the rank's.
_PRELOAD = ("torch", "torch.distributed", "lancet_rt", "transformers")
_context = None


def _mp_context():
    """The ranks' start method: a fork server with :data:`_PRELOAD` imported. A fork from that
    single-threaded server gives each rank the clean state a spawned one has, without re-importing."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return _context


def run_ranks(fn, world: int, *args, timeout: float = 120.0, may_die=()) -> dict:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return {rank: (status, result)}.

    ``fn`` must be a module-level function. Raises AssertionError if any rank is still running
    after ``timeout`` seconds (the processes are killed), so a hang is a failure, never a wait.
    Ranks in ``may_die`` may end without a result (a test that kills them).
    """
    # ``timeout`` is a hang guard, not a speed limit: starting W torch processes and running them on
    # a loaded machine can take minutes, so it is never less than HANG_GUARD_S.
    timeout = max(timeout, HANG_GUARD_S)
    ctx = _mp_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, init_file, queue, args, dict(os.environ)), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = queue.get(timeout=0.5)
                results[rank] = (status, payload)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
            except Exception as exc:  # e.g. a tensor result whose shared memory died with its rank
                raise AssertionError(
                    f"a rank's result could not be received ({type(exc).__name__}: {exc}); "
                    f"return plain Python values, not tensors"
                ) from exc
        hung = [r for r, p in enumerate(procs) if r not in results and p.is_alive()]
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} did not finish within {timeout}s (hang)"
        missing = [r for r in range(world) if r not in results and r not in may_die]
        assert not missing, f"ranks {missing} died without a result"
        return results


def die_reporting(res, out_dir: str, rank: int) -> None:
    """Kill this rank (SIGKILL: no cleanup, as a crash) after writing ``res`` to ``out_dir/rank{rank}.json``."""
    import json
    import signal

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os.kill(os.getpid(), signal.SIGKILL)


def with_the_dead(results: dict, victim: int, out_dir) -> list:
    """Each rank's result of a run in which ``victim`` killed itself by :func:`die_reporting` (its
    result then read from its file); every other rank must have returned."""
    import json

    errors = {r: p for r, (s, p) in results.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    assert victim not in results, f"rank {victim} was to kill itself, and returned"
    out = []
    for r in range(len(results) + 1):
        if r == victim:
            out.append(json.loads(open(os.path.join(str(out_dir), f"rank{victim}.json")).read()))
        else:
            assert results[r][0] == "ok", results[r][1]
            out.append(results[r][1])
    return out


def assert_all_ok(results: dict) -> list:
    errors = {r: p for r, (s, p) in results.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    return [results[r][1] for r in sorted(results)]


def outcome(fn) -> list:
    """[exception type name, message, ranks] of ``fn()``, or ["ok", result, None]: what a rank's case
    ended with, picklable for :func:`run_ranks` (KeyboardInterrupt included: it is one of the faults)."""
    try:
        return ["ok", fn(), None]
    except BaseException as exc:  # what escapes, whatever it is, is the outcome
        return [type(exc).__name__, str(exc), getattr(exc, "ranks", None)]


def assert_raised(result, exc: str, *words, ranks=None) -> None:
    """An :func:`outcome` is the exception ``exc`` (by name), its message holds ``words``, and, if
    given, it names ``ranks`` as the ones at fault."""
    kind, msg, at_fault = result
    assert kind == exc and all(w in msg for w in words), f"expected {exc} with {words}, got {kind}: {msg}"
    if ranks is not None:
        assert at_fault == ranks, (at_fault, msg)


@contextlib.contextmanager
def nccl_one_rank():
    """This process as the one rank of an NCCL default group on its current CUDA device (GPU lane)."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
