"""The link's own numbers, measured from inside the ranks of a :mod:`bench.reallink` link (or over
loopback): the achieved per-rank rate with every direction busy (plain TCP sockets and one gloo
all-to-all) and the latency of a small all-to-all. ``python -m bench.reallink`` prints them."""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time

from bench.reallink.link import MASTER_PORT, LinkError, RealLink, address, rank_link


def probe(nbytes: int = 8 << 20, small_reps: int = 50, group=None) -> dict:
    """Measure the link from inside the ranks (every rank calls it; ``dist`` initialised):

    - ``socket_mbit``: plain TCP, every rank sending ``nbytes`` to every other at once (both
      directions of every port busy): per-rank sent bits over the slowest rank's time;
    - ``gloo_a2a_mbit``: the same bytes as one gloo ``all_to_all_single``;
    - ``a2a_latency_us``: the median time of a small all-to-all (one int64 per rank), link idle.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = dict(world=world, probe_bytes=nbytes)
    out["socket_mbit"] = _socket_rate(rank, world, nbytes, group)
    out["gloo_a2a_mbit"] = a2a_mbit(lambda y, x: dist.all_to_all_single(y, x, group=group), nbytes, group)
    small_x, small_y = torch.ones(world, dtype=torch.int64), torch.empty(world, dtype=torch.int64)
    dist.barrier(group)
    lat = []
    for _ in range(small_reps):
        t0 = time.perf_counter()
        dist.all_to_all_single(small_y, small_x, group=group)
        lat.append(time.perf_counter() - t0)
    out["a2a_latency_us"] = _slowest(statistics.median(lat), group) * 1e6
    return out


def a2a_mbit(all_to_all, nbytes: int, group=None) -> float:
    """Per-rank Mbit/s of one all-to-all of ``nbytes`` to each peer, ``all_to_all(out, in)`` run to its
    end on every rank of ``group`` (which times it: barriers, the slowest rank): the median of 3 after
    a warm-up (connections)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    x = torch.ones(world * (nbytes // 4))
    y = torch.empty_like(x)
    all_to_all(y, x)
    times = []
    for _ in range(3):
        dist.barrier(group)
        t0 = time.perf_counter()
        all_to_all(y, x)
        times.append(_slowest(time.perf_counter() - t0, group))
    return (world - 1) * nbytes * 8 / statistics.median(times) / 1e6


def _slowest(seconds: float, group) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _socket_rate(rank: int, world: int, nbytes: int, group) -> float:
    """Plain TCP sockets between every pair, all sending at once; Mbit/s per rank (the slowest)."""
    import torch.distributed as dist

    port = MASTER_PORT + 1
    host = address if rank_link() is not None else (lambda q: "127.0.0.1")  # (loopback: one host)
    listener = socket.create_server((host(rank), port + (0 if rank_link() else rank)), backlog=world)
    dist.barrier(group)
    conns = {}
    for q in range(rank + 1, world):  # connect to the higher ranks, accept the lower ones
        c = socket.create_connection((host(q), port + (0 if rank_link() else q)))
        c.sendall(rank.to_bytes(4, "little"))
        conns[q] = c
    for _ in range(rank):
        c, _ = listener.accept()
        conns[int.from_bytes(c.recv(4, socket.MSG_WAITALL), "little")] = c
    listener.close()
    payload = bytearray(nbytes)

    def send(c):
        c.sendall(payload)

    def recv(c):
        buf, got = bytearray(1 << 20), 0
        while got < nbytes:
            n = c.recv_into(buf, min(len(buf), nbytes - got))
            if n == 0:
                raise ConnectionError("peer closed")
            got += n

    dist.barrier(group)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=f, args=(c,)) for c in conns.values() for f in (send, recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = _slowest(time.perf_counter() - t0, group)
    for c in conns.values():
        c.close()
    return (world - 1) * nbytes * 8 / took / 1e6


def probe_rank(args) -> None:
    """``--rank-probe``: one rank of the link measurement (the launcher without a command runs it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        res = probe(args.probe_mb << 20)
        if dist.get_rank() == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def measure(link: RealLink, probe_mb: int = 8, timeout_s: float = 300.0) -> dict:
    """Run :func:`probe` on ``link``'s ranks; returns rank 0's numbers (LinkError if it failed)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        rc = link.launch(["-m", "bench.reallink", "--rank-probe", "--probe-mb", str(probe_mb), "--out", out], timeout_s)
        if rc != 0 or not os.path.exists(out):
            raise LinkError(f"the link probe failed (exit status {rc})")
        with open(out) as f:
            return json.load(f)
