"""A real rate-limited link between W ranks on one machine (root), and the ranks launched over it.

    python -m bench.reallink --ranks 2 --rate 450mbit                       # build, measure, tear down
    python -m bench.reallink --ranks 2 --rate 450mbit --delay-ms 0.5 -- -m bench.overlap --link real ...

Each rank lives in a network namespace of its own with one veth interface (``lrt0``, address
198.18.0.<rank + 1>/24, from the benchmarking range 198.18.0.0/15); the other end of each veth is a
port of a Linux bridge in a namespace of its own. Every rank's egress is rate-limited by a token
bucket (``tbf``; with ``--delay-ms``, behind a ``netem`` delay), and so is the bridge port towards it
(its ingress), so each rank has a port of the configured rate both ways, as on a switch. No
interface is attached to a host interface, no default route or route out exists, and the addresses
live only inside the namespaces made here, whose names start with :data:`PREFIX`, the launcher's
PID and its start time.

Rank processes run ``python ARGS`` (any module of ours) in their namespace with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (rank 0's address), MASTER_PORT and GLOO_SOCKET_IFNAME set,
so ``dist.init_process_group("gloo")`` binds gloo to the rank's interface. A rank may change its own
port's rate (:func:`set_rate`, tc in its own namespace and on its bridge port) so that a benchmark can
calibrate the link or compare it with the unshaped one.

Every run is bounded (``--timeout``) and torn down on a normal exit, an exception, SIGINT, SIGTERM or
SIGHUP: the ranks (started here, ended by PID) and then the namespaces (their veths go with them).
A launcher killed with SIGKILL leaves its namespaces; the next start removes those whose owner PID
is dead (:func:`remove_stale`); its ranks die with it (PR_SET_PDEATHSIG).

Without a command after ``--``, the launcher measures the link it made (:func:`probe`): the
achieved per-rank rate of plain TCP sockets and of gloo's all-to-all (every rank sending to every
other at once, so both directions of each port are busy) and the all-to-all latency of small
messages; it prints them and appends a JSON row (``--json``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: Namespace names made here: PREFIX + "<owner pid>-<owner start time>-" + "br" or "r<rank>".
PREFIX = "lancetrl"
#: The rank's interface, inside its own namespace.
IFACE = "lrt0"
#: Rank r's address (198.18.0.0/15 is reserved for benchmarking, RFC 2544).
SUBNET, PREFIX_LEN = "198.18.0.", 24
MASTER_PORT = 29500
#: The largest packet (GSO segment) a veth of ours hands the qdisc: a queue of a few of them holds.
GSO_MAX = 16384
#: The token bucket's queue, in ms at the port's rate: a shallow switch buffer (a deeper queue with
#: larger GSO segments held a small message far longer behind a bulk transfer: bench/results/HISTORY.md).
QUEUE_MS = 2.0
#: The environment a rank process finds (read by :func:`rank_link`, and nowhere else).
ENV_NS, ENV_BRIDGE, ENV_RATE, ENV_DELAY, ENV_SHAPE = (
    "LANCET_REALLINK_NS",
    "LANCET_REALLINK_BRIDGE",
    "LANCET_REALLINK_RATE_BPS",
    "LANCET_REALLINK_DELAY_MS",
    "LANCET_REALLINK_SHAPE",
)
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(br|r\d+)$")


class LinkError(RuntimeError):
    """The link cannot be made (not root, ip/tc missing, a command failed); its message is one line."""


def address(rank: int) -> str:
    return f"{SUBNET}{rank + 1}"


def parse_rate(text) -> int:
    """A rate as bits per second: an int, or tc-style text ("450mbit", "1gbit", "800kbit", "2e8bit")."""
    if isinstance(text, bool):
        raise ValueError(f"rate must be a number of bits/s or text such as '450mbit', got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(bit|kbit|mbit|gbit)?\s*", str(text).lower())
        if m is None:
            raise ValueError(f"rate must be a number of bits/s or text such as '450mbit', got {text!r}")
        value = float(m.group(1)) * {None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    if not 1e5 <= value <= 1e11:
        raise ValueError(f"rate must be between 100kbit and 100gbit, got {text!r}")
    return int(value)


def require_tools() -> None:
    """LinkError unless this process is root and ``ip`` and ``tc`` are on the PATH."""
    if os.geteuid() != 0:
        raise LinkError("needs root (it makes network namespaces, veth links and tc qdiscs): run it as root")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise LinkError(f"needs {' and '.join(missing)} on the PATH (install iproute2)")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"{' '.join(cmd)}: no answer in 60 s") from exc
    if check and out.returncode != 0:
        raise LinkError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return out


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _namespaces() -> list:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list:
    """Remove the namespaces of launchers that died (SIGKILL): our prefix, an owner PID that is gone
    or belongs to another process now. Processes still inside them (ranks of ours, recognised by the
    marker in their environment) are killed by PID first. Returns the names removed."""
    removed = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m is None or _start_time(int(m.group(1))) == m.group(2):
            continue  # not ours, or its launcher is alive
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in map(int, pids):
            if _marked(pid, name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def _marked(pid: int, ns: str) -> bool:
    """Whether process ``pid`` is one of our ranks in namespace ``ns`` (its environment says so)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{ENV_NS}={ns}".encode() in f.read().split(b"\0")
    except OSError:
        return False


@dataclass
class Shape:
    """A port's shaping: ``rate_bps`` (None: unshaped), the bucket, the queue and the delay."""

    rate_bps: Optional[int]
    delay_ms: float = 0.0
    burst_bytes: Optional[int] = None  # default: 2.5 ms at the rate, at least 32 KB (late timers on a busy host)
    queue_ms: float = QUEUE_MS  # tbf's queue: this many ms at the rate (beyond it, drops)
    only_port: Optional[int] = None  # the rate binds only TCP to or from this port; the rest passes unshaped

    def burst(self) -> int:
        return self.burst_bytes or max(32_000, int(self.rate_bps / 8 * 2.5e-3))

    def limit(self) -> int:
        return max(int(self.rate_bps / 8 * self.queue_ms * 1e-3), 2 * GSO_MAX)  # (two of the largest packets at least)

    def tbf(self) -> list:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst()), "limit", str(self.limit())]


def shape_commands(dev: str, shape: Shape, ns: Optional[str] = None) -> list:
    """The tc commands that give ``dev`` (in namespace ``ns``; None: this process's) ``shape``, from
    any earlier shaping of ours: a netem delay at the root (if any), the token bucket under it; or, with
    ``only_port``, the rate on that port's TCP only (:func:`port_commands`)."""
    tc = ["tc"] + (["-n", ns] if ns else [])
    cmds = [tc + ["qdisc", "del", "dev", dev, "root"]]  # (fails harmlessly when there is none)
    if shape.only_port is not None and shape.rate_bps is not None:
        if shape.delay_ms > 0:
            raise LinkError("a rate on one port only (only_port) takes no delay (delay_ms)")
        return cmds + port_commands(tc, dev, shape)
    if shape.delay_ms > 0:
        cmds.append(
            tc
            + [
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{shape.delay_ms}ms",
                "limit",
                "100000",
            ]
        )
        if shape.rate_bps is not None:
            cmds.append(tc + ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"] + shape.tbf())
    elif shape.rate_bps is not None:
        cmds.append(tc + ["qdisc", "add", "dev", dev, "root", "handle", "10:"] + shape.tbf())
    return cmds


def port_commands(tc: list, dev: str, shape: Shape) -> list:
    """An HTB root whose one class holds the rate, the bucket and the queue (a byte FIFO) of ``shape``, and
    two filters sending the TCP segments from or to ``shape.only_port`` into it. Everything else is
    unclassified, which HTB sends at once (its direct queue): the traffic beside a benchmark
    (bench.reallink.traffic) flows at the rate while the benchmark's own runs unshaped. (This kernel has
    HTB, TBF and u32, no prio qdisc.)"""
    port, burst = str(shape.only_port), str(shape.burst())
    cmds = [
        tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "direct_qlen", "10000"],
        tc
        + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", f"{shape.rate_bps}bit"]
        + ["ceil", f"{shape.rate_bps}bit", "burst", burst, "cburst", burst],
        tc + ["qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "bfifo", "limit", str(shape.limit())],
    ]
    for side in ("sport", "dport"):
        cmds.append(
            tc
            + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32"]
            + ["match", "ip", side, port, "0xffff", "flowid", "1:10"]
        )
    return cmds


def _apply(cmds: list) -> None:
    for i, cmd in enumerate(cmds):
        try:
            _run(*cmd, check=i > 0)
        except LinkError as exc:
            if "netem" in cmd and "unknown" in str(exc):
                raise LinkError(
                    "--delay-ms needs the kernel's netem qdisc (sch_netem), which this kernel lacks"
                ) from None
            raise


@dataclass
class RealLink:
    """W namespaces joined through a bridge, each rank's port shaped (:func:`create` makes one)."""

    world: int
    shape: Shape
    owner: str  # PREFIX + "<pid>-<start>-"
    made: list = field(default_factory=list)  # namespaces made, in order
    procs: list = field(default_factory=list)  # rank processes started (Popen)

    @property
    def bridge(self) -> str:
        return f"{self.owner}br"

    def ns(self, rank: int) -> str:
        return f"{self.owner}r{rank}"

    def env(self, rank: int) -> dict:
        """The environment rank ``rank``'s process gets on top of this one's."""
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world),
            "MASTER_ADDR": address(0),
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": IFACE,
            ENV_NS: self.ns(rank),
            ENV_BRIDGE: self.bridge,
            ENV_RATE: str(self.shape.rate_bps or 0),
            ENV_DELAY: str(self.shape.delay_ms),
            ENV_SHAPE: json.dumps(dict(burst_bytes=self.shape.burst_bytes, queue_ms=self.shape.queue_ms)),
            # c10d warns at every connection that a peer's address has no name (no DNS in a namespace)
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        }

    def set_rate(self, rate_bps: Optional[int], ranks: Optional[Sequence[int]] = None) -> None:
        """Shape the ports of ``ranks`` (default all) at ``rate_bps`` (None: unshaped), both ways."""
        self.shape.rate_bps = rate_bps
        for r in range(self.world) if ranks is None else ranks:
            _apply(shape_commands(IFACE, self.shape, self.ns(r)))
            _apply(shape_commands(f"p{r}", self.shape, self.bridge))

    def launch(self, argv: Sequence[str], timeout_s: float, grace_s: float = 30.0, extra_env=None) -> int:
        """Run ``python argv`` as every rank, each in its namespace; wait at most ``timeout_s``
        (:func:`supervise`). Returns 0, the first non-zero exit status, or 124 on timeout."""
        for r in range(self.world):
            env = {**os.environ, **(extra_env or {}), **self.env(r)}
            env.setdefault("OMP_NUM_THREADS", "1")
            self.procs.append(
                _spawn([sys.executable, *argv], env=env, preexec_fn=_enter(self.ns(r)), start_new_session=True)
            )
        try:
            return supervise(self.procs, timeout_s, grace_s)
        finally:
            self.stop_ranks()
            self.procs.clear()

    def stop_ranks(self) -> None:
        """End the rank processes started here (by PID)."""
        stop(self.procs)

    def teardown(self) -> None:
        """End the ranks, then delete every namespace made (their veths and qdiscs go with them).
        Idempotent; SIGINT/SIGTERM are held off until it is done."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
        try:
            self.stop_ranks()
            self.procs.clear()
            while self.made:
                _run("ip", "netns", "del", self.made.pop(), check=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def supervise(procs: list, timeout_s: float, grace_s: float = 30.0) -> int:
    """Wait for the rank processes ``procs`` (Popen) at most ``timeout_s``. Once one fails, the others
    get ``grace_s`` to end (lancet's collectives name the lost peer and raise), then they are ended.
    Returns 0, the first non-zero exit status, or 124 on timeout (every rank ended)."""
    deadline = time.monotonic() + timeout_s
    failed_at, status = None, 0
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        codes = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if codes and failed_at is None:
            failed_at, status = now, codes[0]
        if now >= deadline:
            print(f"bench.reallink: the ranks ran past the timeout ({timeout_s:g} s); ending them", file=sys.stderr)
            stop(procs)
            return 124
        if failed_at is not None and now - failed_at >= grace_s:
            stop(procs)
            break
        time.sleep(0.1)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def stop(procs: list) -> None:
    """End the processes ``procs`` (Popen, started by us) by PID: SIGTERM, then SIGKILL after 5 s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, end - time.monotonic()))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def launch_loopback(world: int, argv: Sequence[str], timeout_s: float, extra_env=None) -> int:
    """Run ``python argv`` as ``world`` ranks on this host's loopback (no namespaces, no root), with the
    environment :meth:`RealLink.launch` gives, less the link's: the reference a real-link run is
    compared with. Returns as :func:`supervise`."""
    with socket.socket() as probe_sock:
        probe_sock.bind(("127.0.0.1", 0))
        port = probe_sock.getsockname()[1]
    procs = []
    try:
        for r in range(world):
            env = {
                **os.environ,
                **(extra_env or {}),
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
            }
            env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(_spawn([sys.executable, *argv], env=env, start_new_session=True, preexec_fn=die_with_parent))
        return supervise(procs, timeout_s)
    finally:
        stop(procs)


#: The signals that end the launcher (:func:`signals_raise`).
_ENDING = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _spawn(argv: list, preexec_fn, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv, preexec_fn=preexec_fn, ...)`` with the ending signals held off in this
    process while it forks: a SIGINT that lands in the interpreter's fork handlers (a preexec_fn forks
    in Python) is reported and dropped there, and the launcher would wait out its timeout instead of
    tearing down. Held, it is raised once the child exists (in :func:`supervise`'s loop or before). The
    child starts with the launcher's own mask (unblocked in ``preexec_fn``'s wrapper)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)

    def child():
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        preexec_fn()

    try:
        return subprocess.Popen(argv, preexec_fn=child, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def die_with_parent():
    """A preexec_fn: the child is killed when the process that started it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _enter(ns: str):
    """A preexec_fn: join namespace ``ns`` and die with the launcher (PR_SET_PDEATHSIG)."""

    def enter():
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            os._exit(126)
        os.close(fd)
        die_with_parent()

    return enter


def create(
    world: int, rate, delay_ms: float = 0.0, queue_ms: Optional[float] = None, burst_bytes: Optional[int] = None
) -> RealLink:
    """Make the link: ``world`` rank namespaces and a bridge namespace, each port shaped at ``rate``
    (bits/s or tc text; None: unshaped) with a ``delay_ms`` netem delay. Removes stale namespaces of
    dead launchers first; on failure, removes what it made and raises :class:`LinkError`."""
    if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= 64:
        raise ValueError(f"world must be an int in [2, 64], got {world!r}")
    if not (isinstance(delay_ms, (int, float)) and 0 <= delay_ms <= 1000):
        raise ValueError(f"delay_ms must be a number of ms in [0, 1000], got {delay_ms!r}")
    queue_ms = QUEUE_MS if queue_ms is None else queue_ms
    shape = Shape(None if rate is None else parse_rate(rate), float(delay_ms), burst_bytes, float(queue_ms))
    require_tools()
    remove_stale()
    me = os.getpid()
    link = RealLink(world, shape, f"{PREFIX}{me}-{_start_time(me)}-")
    try:
        for name in [link.bridge] + [link.ns(r) for r in range(world)]:
            _run("ip", "netns", "add", name)
            link.made.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        br = ["ip", "-n", link.bridge]
        _run(*br, "link", "add", "br0", "type", "bridge")
        _run(*br, "link", "set", "br0", "up")
        for r in range(world):
            # made inside the bridge namespace, its peer created straight in the rank's: never on the host
            _run(*br, "link", "add", f"p{r}", "type", "veth", "peer", "name", IFACE, "netns", link.ns(r))
            _run(*br, "link", "set", f"p{r}", "master", "br0")
            _run(*br, "link", "set", f"p{r}", "gso_max_size", str(GSO_MAX))
            _run(*br, "link", "set", f"p{r}", "up")
            rn = ["ip", "-n", link.ns(r)]
            _run(*rn, "link", "set", IFACE, "gso_max_size", str(GSO_MAX))
            _run(*rn, "addr", "add", f"{address(r)}/{PREFIX_LEN}", "dev", IFACE)
            _run(*rn, "link", "set", IFACE, "up")
        link.set_rate(shape.rate_bps)
    except BaseException:
        link.teardown()
        raise
    return link


@contextlib.contextmanager
def real_link(world: int, rate, delay_ms: float = 0.0, **kw):
    """:func:`create`, torn down when the block ends, however it ends."""
    link = create(world, rate, delay_ms, **kw)
    try:
        yield link
    finally:
        link.teardown()


# ------------------------------------------------------------------------------ inside a rank
@dataclass
class RankLink:
    """What a rank process knows of the link it runs on (:func:`rank_link`)."""

    rank: int
    world: int
    ns: str
    bridge: str
    shape: Shape

    def set_rate(self, rate_bps: Optional[int], only_port: Optional[int] = None) -> None:
        """Shape this rank's port (its egress, and the bridge port towards it) at ``rate_bps``
        (None: unshaped), all its traffic or (``only_port``) the TCP to and from that port only. Each rank
        sets its own; a benchmark then meets at a barrier."""
        self.shape.rate_bps, self.shape.only_port = rate_bps, only_port
        _apply(shape_commands(IFACE, self.shape))
        _apply(shape_commands(f"p{self.rank}", self.shape, self.bridge))

    def shaped_bytes(self) -> int:
        """Bytes this rank's port has passed through its shaper (its egress's root qdisc): what the rate limits,
        every TCP segment's headers counted. (The interface's own counter, /proc/net/dev, counts a GSO packet's
        headers once: about 4% fewer bytes for the same transfer at a 1500-byte MTU.)"""
        out = _run("tc", "-s", "qdisc", "show", "dev", IFACE).stdout
        m = re.search(r"Sent (\d+) bytes", out)
        if m is None:
            raise LinkError(f"no byte count in tc's statistics of {IFACE}: {out.strip()[:200]!r}")
        return int(m.group(1))


def rank_link() -> Optional[RankLink]:
    """The link this process runs on as a rank of :func:`RealLink.launch`, or None (not launched by it)."""
    ns = os.environ.get(ENV_NS)
    if not ns:
        return None
    rate = int(os.environ.get(ENV_RATE, "0")) or None
    extra = json.loads(os.environ.get(ENV_SHAPE, "{}"))
    return RankLink(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        ns,
        os.environ[ENV_BRIDGE],
        Shape(rate, float(os.environ.get(ENV_DELAY, "0")), extra.get("burst_bytes"), extra.get("queue_ms", QUEUE_MS)),
    )


def signals_raise() -> None:
    """SIGTERM and SIGHUP end the launcher as SIGINT does (the finally blocks tear down)."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
