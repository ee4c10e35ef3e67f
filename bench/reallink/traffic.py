"""Traffic beside a benchmark: every rank sends to every other over TCP port :data:`PORT` as fast as the link
lets it, with no dependency on the benchmark's work, so that a benchmark can time its computation while bytes
flow (``bench.overlap --link real --loaded``: the link shapes this port alone, :func:`bench.reallink.link.
port_commands`, and the benchmark's own collectives pass unshaped).

The traffic runs in a process of its own per rank (:class:`Load` starts it; it inherits the rank's network
namespace), so its system calls hold no lock of the rank's interpreter, as gloo's own threads hold none: a
sender thread per peer and a receiver thread per peer, the senders running while the load is on. The rank
turns it on and off and reads how many bytes it has handed to the sockets through the process's stdin and
stdout, one line each way. Each socket's send buffer is small (:data:`SNDBUF`), so the bytes still queued
when the load is turned off drain within a few ms at the link's rate.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from bench.reallink.link import address, die_with_parent

#: The traffic's TCP port (gloo's own ports are ephemeral, above 32767; the rendezvous is 29500).
PORT = 29700
#: Each sender's send buffer: a few ms at a few hundred Mbit/s.
SNDBUF = 128 << 10
#: Bytes per send() call (the sender checks the on/off switch between calls).
PIECE = 64 << 10


class Load:
    """The traffic process of rank ``rank`` of ``world``: started at once, ready once it is connected to
    every peer's (every rank makes one; :meth:`on` waits for it), or ended with an error after ``timeout_s``.
    ``loopback``: all ranks on 127.0.0.1, a port each (tests; no namespaces). Ends with its rank
    (PR_SET_PDEATHSIG) or at :meth:`close`."""

    def __init__(self, rank: int, world: int, loopback: bool = False, timeout_s: float = 60.0):
        argv = [sys.executable, "-m", "bench.reallink.traffic", "--rank", str(rank), "--world", str(world)]
        argv += ["--timeout", str(timeout_s)]
        self.proc = subprocess.Popen(
            argv + (["--loopback"] if loopback else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=die_with_parent,
        )
        self._ready = False

    def _ask(self, line: str) -> str:
        if not self._ready:
            self._read("ready")
            self._ready = True
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(line)

    def _read(self, what: str) -> str:
        got = self.proc.stdout.readline()  # (the process answers every line; it ends only at close or a failure)
        if not got:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"the traffic process ended before answering {what!r}: {err.strip()[-2000:]}")
        return got.strip()

    def on(self) -> None:
        """The senders run (returns at once)."""
        self._ask("on")

    def off(self) -> None:
        """The senders stop after their current piece (returns once each has)."""
        self._ask("off")

    def sent(self) -> int:
        """Bytes handed to the sockets so far (to every peer)."""
        return int(self._ask("sent"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------ the traffic process
def _endpoint(rank: int, loopback: bool) -> tuple:
    return ("127.0.0.1", PORT + rank) if loopback else (address(rank), PORT)


def _connect(where: tuple, deadline: float) -> socket.socket:
    while True:
        try:
            c = socket.create_connection(where, timeout=5)
            c.settimeout(None)
            return c
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _Senders:
    def __init__(self, conns: list):
        self.go = threading.Event()
        self.idle = [threading.Event() for _ in conns]
        self.count = [0] * len(conns)
        self.quit = False
        for i, c in enumerate(conns):
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            threading.Thread(target=self._send, args=(i, c), daemon=True).start()

    def _send(self, i: int, c: socket.socket) -> None:
        piece = memoryview(bytearray(PIECE))
        while True:
            self.idle[i].set()
            self.go.wait()
            if self.quit:
                return
            self.idle[i].clear()
            try:
                while self.go.is_set() and not self.quit:
                    self.count[i] += c.send(piece)
            except OSError:  # (a peer that has ended)
                self.idle[i].set()
                return

    def off(self) -> None:
        self.go.clear()
        for e in self.idle:
            e.wait()


def _drain(c: socket.socket) -> None:
    buf = bytearray(1 << 20)
    while c.recv_into(buf):
        pass


def serve(rank: int, world: int, loopback: bool, timeout_s: float = 60.0) -> None:
    """The traffic process: listen, connect to every peer, drain what arrives, send while on."""
    listener = socket.create_server(_endpoint(rank, loopback), backlog=world)
    deadline = time.monotonic() + timeout_s

    def accept():
        for _ in range(world - 1):
            c, _ = listener.accept()
            threading.Thread(target=_drain, args=(c,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    senders = _Senders([_connect(_endpoint(q, loopback), deadline) for q in range(world) if q != rank])
    acceptor.join(max(deadline - time.monotonic(), 0))
    if acceptor.is_alive():
        raise SystemExit(f"traffic rank {rank}: not every peer connected within {timeout_s:.0f} s")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "on":
            senders.go.set()
            print("on", flush=True)
        elif cmd == "off":
            senders.off()
            print("off", flush=True)
        elif cmd == "sent":
            print(sum(senders.count), flush=True)
        elif cmd == "quit":
            break
    senders.quit = True
    senders.go.set()
    os._exit(0)  # (the drain threads block in recv until the peers close)


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.reallink.traffic", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--loopback", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every peer to connect")
    args = p.parse_args(argv)
    serve(args.rank, args.world, args.loopback, args.timeout)


if __name__ == "__main__":
    main()
