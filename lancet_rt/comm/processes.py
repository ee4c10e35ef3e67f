"""Which process a rank is, and whether it still runs: what a lost peer's message says ("its process
has exited", "its process is alive"), for ranks on this machine and PID namespace
(:mod:`lancet_rt.comm.monitor` publishes each rank's identity in the process group's store)."""

from __future__ import annotations

import json
import os
import socket
from typing import Optional


def machine() -> Optional[str]:
    """This machine and PID namespace (two ranks with the same value can see each other's PIDs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}:{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time) of a process from /proc, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def identity() -> str:
    """This process, as :func:`state` reads it on another rank."""
    stat = proc_stat(os.getpid())
    return json.dumps({"machine": machine(), "pid": os.getpid(), "start": stat[1] if stat else None})


def state(identity: Optional[str]) -> Optional[str]:
    """ "exited" or "alive" for a process on this machine, None when that cannot be told."""
    if not identity:
        return None
    who = json.loads(identity)
    if who["machine"] is None or who["machine"] != machine():
        return None
    stat = proc_stat(who["pid"])
    if stat is None or stat[0] == "Z" or (who["start"] is not None and stat[1] != who["start"]):
        return "exited"
    return "alive"
