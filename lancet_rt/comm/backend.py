"""What :class:`lancet_rt.comm.monitor.GroupMonitor` asks of a process group beyond collectives, through
torch.distributed's private API where there is no public one (each answer degrades to "unknown"): its
global ranks, its store, its gloo backend (the operation timeout), and aborting its communicator."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("lancet_rt")


def global_ranks(group, size: int) -> list:
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # a group torch.distributed does not know (a test double): group numbering
        return list(range(size))


def group_store(group) -> "Store":
    try:
        return Store(dist.distributed_c10d._get_process_group_store(group))
    except Exception:  # a private API: without it, failures are found by timeout only
        return Store(None)


class Store:
    """The process group's store under ``lancet_rt/`` keys, never blocking and never raising: a failed
    operation (the store's host may be the rank that died) answers None."""

    def __init__(self, store):
        self.store = store  # (None: no store; every operation answers None)

    def put(self, key: str, value: str) -> None:
        try:
            if self.store is not None:
                self.store.set(f"lancet_rt/{key}", value)
        except Exception:
            pass

    def add(self, key: str, n: int):
        try:
            return None if self.store is None else self.store.add(f"lancet_rt/{key}", n)
        except Exception:
            return None

    def get(self, key: str):
        try:
            if self.store is None or not self.store.check([f"lancet_rt/{key}"]):
                return None
            return self.store.get(f"lancet_rt/{key}").decode()
        except Exception:
            return None


def gloo_backend(group):
    try:
        backend = group._get_backend(torch.device("cpu"))
        backend.options._timeout  # noqa: B018 - the API the operation timeout needs
        return backend
    except Exception:
        return None


def abort(group) -> None:
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception as exc:
        log.error(
            "lancet-rt: could not abort the communicator (%s); the process waits for the process group's own timeout",
            exc,
        )
