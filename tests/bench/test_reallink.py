"""bench.reallink: the real-link launcher's set-up, teardown (normal, SIGINT, a SIGKILLed launcher's
leftovers), its refusals, and a benchmark's results over the real link equal to loopback, bitwise.

The link needs root and iproute2 (CI runs as root); without them the tests that build one skip,
saying so. The refusals run everywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.overlap.real_runner import SCHEDULES
from bench.reallink import link as reallink
from bench.reallink import traffic

REPO = Path(__file__).resolve().parents[2]
HAVE_LINK = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_link = pytest.mark.skipif(not HAVE_LINK, reason="a real link needs root and iproute2 (ip, tc)")


def _ours(owner: str) -> list:
    return [n for n in reallink._namespaces() if n.startswith(owner)]


def _run_ns(ns: str, *cmd: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=30).stdout


def _have_netem() -> bool:
    """Whether this kernel has the netem qdisc (a minimal kernel may not)."""
    name = f"{reallink.PREFIX}netemprobe{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        return (
            subprocess.run(
                ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], capture_output=True
            ).returncode
            == 0
        )
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@needs_link
def test_link_is_built_inside_its_namespaces_and_torn_down():
    t0 = time.monotonic()
    delay = 1.0 if _have_netem() else 0.0
    with reallink.real_link(2, "200mbit", delay_ms=delay) as link:
        names = _ours(link.owner)
        assert sorted(names) == sorted([link.bridge, link.ns(0), link.ns(1)])
        for r in range(2):
            addr = subprocess.run(
                ["ip", "-n", link.ns(r), "-o", "-4", "addr", "show", "dev", reallink.IFACE],
                capture_output=True,
                text=True,
            ).stdout
            assert f"inet 198.18.0.{r + 1}/24" in addr
            routes = subprocess.run(["ip", "-n", link.ns(r), "route", "show"], capture_output=True, text=True).stdout
            assert routes.strip() == f"198.18.0.0/24 dev {reallink.IFACE} proto kernel scope link src 198.18.0.{r + 1}"
            qdiscs = subprocess.run(
                ["tc", "-n", link.ns(r), "qdisc", "show", "dev", reallink.IFACE], capture_output=True, text=True
            ).stdout
            assert "tbf" in qdiscs and "rate 200Mbit" in qdiscs
            assert ("netem" in qdiscs and "delay 1ms" in qdiscs) == bool(delay)
            bridge_port = subprocess.run(
                ["tc", "-n", link.bridge, "qdisc", "show", "dev", f"p{r}"], capture_output=True, text=True
            ).stdout
            assert "rate 200Mbit" in bridge_port  # the port towards the rank: its ingress
            for ns, dev in ((link.ns(r), reallink.IFACE), (link.bridge, f"p{r}")):  # packets a short queue holds
                details = subprocess.run(
                    ["ip", "-n", ns, "-d", "link", "show", dev], capture_output=True, text=True
                ).stdout
                assert f"gso_max_size {reallink.GSO_MAX} " in details
        host = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert reallink.IFACE not in host and "p0@" not in host  # nothing of ours on the host
        link.set_rate(None)  # unshaped: the delay stays, the bucket goes
        qdiscs = subprocess.run(
            ["tc", "-n", link.ns(0), "qdisc", "show", "dev", reallink.IFACE], capture_output=True, text=True
        ).stdout
        assert "tbf" not in qdiscs and ("netem" in qdiscs) == bool(delay)
        owner = link.owner
    assert _ours(owner) == []
    assert time.monotonic() - t0 < 60


@needs_link
def test_ranks_get_their_environment_and_reach_each_other(tmp_path):
    script = tmp_path / "rank_probe.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        f"open(os.path.join({str(tmp_path)!r}, 'r' + os.environ['RANK']), 'w').write(\n"
        "    ' '.join([os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', "
        "'GLOO_SOCKET_IFNAME')]"
        " + [str(int(t))]))\n"
        "dist.destroy_process_group()\n"
    )
    with reallink.real_link(2, "500mbit") as link:
        rc = link.launch(["-c", f"import runpy; runpy.run_path({str(script)!r})"], timeout_s=120)
    assert rc == 0
    for r in range(2):
        assert (tmp_path / f"r{r}").read_text() == f"{r} 2 {r} 198.18.0.1 {reallink.IFACE} 3"


def _launcher(*args: str) -> subprocess.Popen:
    """The launcher holding its link while its ranks sleep (a command that never ends by itself)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.reallink",
            "--ranks",
            "2",
            "--rate",
            "100mbit",
            "--no-probe",
            "--timeout",
            "120",
            *args,
            "--",
            "-m",
            "timeit",
            "-n",
            "1",
            "-r",
            "1",
            "import time; time.sleep(120)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_namespaces(proc: subprocess.Popen, n: int) -> list:
    owner = f"{reallink.PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        names = _ours(owner)
        if len(names) == n and _rank_pids(names):
            return names
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the launcher made {_ours(owner)} in 45 s: {proc.communicate()}")


def _rank_pids(names: list) -> list:
    pids = []
    for name in names:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in out if reallink._marked(int(p), name)]
    return pids


def _launched() -> tuple:
    """(the launcher, its namespaces, its ranks' PIDs) once its ranks run."""
    proc = _launcher()
    names = _wait_for_namespaces(proc, 3)
    return proc, names, _rank_pids(names)


@needs_link
def test_sigint_tears_the_link_down():
    t0 = time.monotonic()
    proc, names, pids = _launched()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert _ours(f"{reallink.PREFIX}{proc.pid}-") == []
    assert all(not _alive(p) for p in pids)
    assert time.monotonic() - t0 < 60


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_link
def test_a_sigkilled_launchers_leftovers_are_removed_by_the_next_start():
    t0 = time.monotonic()
    proc, names, pids = _launched()
    proc.kill()
    proc.communicate(timeout=30)
    assert sorted(_ours(f"{reallink.PREFIX}{proc.pid}-")) == sorted(names)  # left behind
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:  # the ranks die with their launcher
        time.sleep(0.1)
    assert all(not _alive(p) for p in pids)
    with reallink.real_link(2, "100mbit") as link:  # the next start removes them (its own stay)
        assert _ours(f"{reallink.PREFIX}{proc.pid}-") == []
        assert len(_ours(link.owner)) == 3
    assert time.monotonic() - t0 < 60


@needs_link
def test_stale_cleanup_leaves_live_launchers_and_foreign_namespaces_alone():
    foreign = f"notlancet{os.getpid()}"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        with reallink.real_link(2, "100mbit") as link:
            assert reallink.remove_stale() == []  # our own link: its owner (this process) is alive
            assert len(_ours(link.owner)) == 3
        assert foreign in reallink._namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=True)


def test_refused_without_root():
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to run the launcher without root")
    out = subprocess.run(
        ["unshare", "--user", sys.executable, "-m", "bench.reallink", "--ranks", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "unshare failed" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(f"unprivileged user namespaces are off here: {out.stderr.strip()}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "bench.reallink: needs root (it makes network namespaces, veth links and tc qdiscs): run it as root"
    ]
    assert out.stdout == ""


def test_refused_without_ip_and_tc():
    env = dict(os.environ, PATH="/nonexistent")
    out = subprocess.run(
        [sys.executable, "-m", "bench.reallink"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    if os.geteuid() != 0:
        assert "needs root" in out.stderr
    else:
        assert out.stderr.strip() == "bench.reallink: needs ip and tc on the PATH (install iproute2)"
    assert out.returncode == 2


@pytest.mark.parametrize(
    "text, bps", [("450mbit", 450_000_000), ("1gbit", 1_000_000_000), ("800kbit", 800_000), (2e8, 200_000_000)]
)
def test_rates_parse(text, bps):
    assert reallink.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "450mbps", "-1mbit", "10bit", True, "200gbit"])
def test_bad_rates_are_refused(text):
    with pytest.raises(ValueError, match="rate must be"):
        reallink.parse_rate(text)


@needs_link
def test_a_delay_without_netem_is_a_clear_error():
    if _have_netem():
        pytest.skip("this kernel has netem")
    with pytest.raises(reallink.LinkError, match="--delay-ms needs the kernel's netem qdisc"):
        reallink.create(2, "100mbit", delay_ms=1.0)
    assert [n for n in reallink._namespaces() if n.startswith(f"{reallink.PREFIX}{os.getpid()}-")] == []


def test_bad_world_is_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="world must be an int in"):
        reallink.create(1, "100mbit")


TINY = [
    "--quick",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--d-ffn",
    "32",
    "--experts",
    "4",
    "--batch",
    "4",
    "--seq",
    "8",
    "--chunks",
    "2",
    "--world-size",
    "2",
]


def _dump(tmp_path, link: str, channels: str) -> dict:
    import torch

    path = tmp_path / f"{link.split(':')[0]}-{channels}"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.overlap",
            "--link",
            link,
            "--channels",
            channels,
            "--schedules",
            ",".join(SCHEDULES),
            "--dump",
            str(path),
            *TINY,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {r: torch.load(f"{path}.rank{r}") for r in range(2)}


@needs_link
def test_results_over_the_real_link_equal_loopback_bitwise(tmp_path):
    """Every schedule's gradients after one step, on every rank: the split group over a shaped real link
    against the plain group on loopback (same seeds), bitwise."""
    import torch

    real = _dump(tmp_path, "real:300mbit", "split")
    loop = _dump(tmp_path, "loopback", "plain")
    for r in range(2):
        assert sorted(real[r]) == sorted(loop[r]) == sorted(SCHEDULES)
        for name in real[r]:
            a, b = real[r][name], loop[r][name]
            assert len(a) == len(b) > 0, name
            for i, (x, y) in enumerate(zip(a, b)):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (r, name, i)
    assert not torch.equal(real[0]["sequential"][-1], real[1]["sequential"][-1])  # the ranks' own experts differ


def test_one_port_shaped_is_an_htb_class_with_a_filter_each_way():
    """``only_port``: an HTB root whose unclassified traffic passes at once, one class at the rate with the
    token bucket's burst and queue, and the TCP segments from and to the port filtered into it; a delay is
    refused (the traffic's shaping takes none)."""
    shape = reallink.Shape(100_000_000, only_port=29700)
    cmds = [" ".join(c) for c in reallink.shape_commands("lrt0", shape, "ns0")]
    assert cmds[0] == "tc -n ns0 qdisc del dev lrt0 root"
    assert cmds[1] == "tc -n ns0 qdisc add dev lrt0 root handle 1: htb direct_qlen 10000"
    burst, limit = shape.burst(), shape.limit()
    assert burst == 32_000 and limit == 32_768  # (2.5 ms at 100 Mbit/s is under 32 KB; 2 ms under two GSO packets)
    assert cmds[2] == (
        f"tc -n ns0 class add dev lrt0 parent 1: classid 1:10 htb rate 100000000bit ceil 100000000bit "
        f"burst {burst} cburst {burst}"
    )
    assert cmds[3] == f"tc -n ns0 qdisc add dev lrt0 parent 1:10 handle 10: bfifo limit {limit}"
    assert cmds[4:] == [
        f"tc -n ns0 filter add dev lrt0 parent 1: protocol ip prio 1 u32 match ip {side} 29700 0xffff flowid 1:10"
        for side in ("sport", "dport")
    ]
    unshaped = reallink.shape_commands("lrt0", reallink.Shape(None, only_port=29700))
    assert unshaped == [["tc", "qdisc", "del", "dev", "lrt0", "root"]]
    with pytest.raises(reallink.LinkError, match="only_port.*delay_ms"):
        reallink.shape_commands("lrt0", reallink.Shape(100_000_000, delay_ms=1.0, only_port=29700))


def test_traffic_beside_runs_while_on_and_stops_when_off():
    """Two traffic processes on loopback: nothing flows before ``on``; both send while on; ``off`` returns
    once the senders have stopped, and nothing is handed to the sockets after it."""
    from bench.reallink.traffic import Load

    loads = [Load(r, 2, loopback=True) for r in range(2)]
    try:
        assert [ld.sent() for ld in loads] == [0, 0]
        for ld in loads:
            ld.on()
        time.sleep(0.3)
        for ld in loads:
            ld.off()
        sent = [ld.sent() for ld in loads]
        assert min(sent) > 1 << 20, sent
        time.sleep(0.2)
        assert [ld.sent() for ld in loads] == sent
    finally:
        for ld in loads:
            ld.close()
    assert [ld.proc.returncode for ld in loads] == [0, 0]


_ONE_PORT_RANK = """
import json, os, socket, sys, threading, time
import torch
import torch.distributed as dist
from bench.reallink import probe
from bench.reallink.link import rank_link
from bench.reallink.traffic import PORT, Load

dist.init_process_group("gloo")
rank = dist.get_rank()
load = Load(rank, 2)
rank_link().set_rate(100_000_000, only_port=PORT)
dist.barrier()
before = load.sent()
load.on()
t0 = time.perf_counter()
time.sleep(1.5)
load.off()
took = time.perf_counter() - t0
out = dict(load_mbit=(load.sent() - before) * 8 / took / 1e6)
out["gloo_mbit"] = probe.a2a_mbit(lambda y, x: dist.all_to_all_single(y, x), 8 << 20)
load.close()
link = rank_link()
link.set_rate(300_000_000)  # (the whole port: a token bucket at the root)
dist.barrier()
x = torch.ones(2 * (4 << 20) // 4)  # 4 MiB to the peer
before = link.shaped_bytes()
dist.all_to_all_single(torch.empty_like(x), x)
dist.barrier()  # (the peer's all-to-all has ended: every byte of ours has passed our port)
out["shaped_mb"] = (link.shaped_bytes() - before) / 1e6
json.dump(out, open(os.path.join(sys.argv[1], f"r{rank}"), "w"))
dist.destroy_process_group()
"""


@needs_link
def test_only_the_traffic_port_is_held_to_the_rate(tmp_path):
    """On a link shaped at 100 Mbit/s for the traffic's port only: the traffic beside gets the rate (within
    TCP's goodput under a shallow queue), and a gloo all-to-all on the same ports passes unshaped (several
    times the rate). Then, the whole port shaped: the shaper counts 4 MiB of rows with every TCP segment's
    headers (1514 wire bytes for 1448 of payload at a 1500-byte MTU: 4.6% more), not the payload alone."""
    import json

    script = tmp_path / "one_port.py"
    script.write_text(_ONE_PORT_RANK)
    with reallink.real_link(2, None) as link:
        rc = link.launch(
            ["-c", f"import runpy, sys; sys.argv = ['x', {str(tmp_path)!r}]; runpy.run_path({str(script)!r})"],
            timeout_s=120,
            extra_env={"PYTHONPATH": str(REPO)},
        )
    assert rc == 0
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}").read_text())
        assert 80 <= got["load_mbit"] <= 101, got
        assert got["gloo_mbit"] > 300, got
        assert 4.194 * 1.03 <= got["shaped_mb"] <= 4.194 * 1.1, got


def _timed_row(tmp_path, link: str, *extra: str) -> dict:
    import json

    path = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "bench.overlap", "--link", link, "--rounds", "1", "--json", str(path), *TINY]
    out = subprocess.run(
        cmd + ["--schedules", "sequential,overlapped,accumulate", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(path.read_text())
    return (rows[-1] if isinstance(rows, list) else rows), out.stdout


def test_a_timed_run_splits_each_step_into_computation_and_waits(tmp_path):
    """On loopback (no root): every schedule's step outside its waits is at most its step, its waits split into
    the counts' and the rows' (the forward's within the whole), the cores' shares are fractions, and the table
    says so."""
    row, stdout = _timed_row(tmp_path, "loopback")
    for n in ("sequential", "overlapped", "accumulate"):
        assert 0 < row[f"{n}_computing_unshaped_ms"] <= row[f"{n}_compute_ms"] + 1e-6
        assert 0 <= row[f"{n}_cpu_idle_unshaped"] <= 1 and 0 <= row[f"{n}_cpu_irq_unshaped"] <= 1
    assert row["overlapped_forward_computing_unshaped_ms"] <= row["overlapped_forward_compute_ms"] + 1e-6
    assert row["accumulate_forward_compute_ms"] is None  # (its passes interleave: no one forward)
    assert "each schedule's computation (its step outside its waits" in stdout


@needs_link
def test_a_loaded_run_times_the_computation_beside_traffic_and_counts_the_shapers_bytes(tmp_path):
    """``--loaded`` on a real link: a third link in the rounds, every schedule timed while the traffic beside
    sent bytes; the busiest port's bytes are the shaper's count, and the bounds are stated with the computation
    on the link too."""
    row, stdout = _timed_row(tmp_path, "real:300mbit", "--loaded")
    for n in ("sequential", "overlapped", "accumulate"):
        assert row[f"{n}_loaded_ms"] > 0 and row[f"{n}_load_mb"] > 0, n
        assert 0 < row[f"{n}_computing_loaded_ms"] <= row[f"{n}_loaded_ms"] + 1e-6
        assert row[f"{n}_counts_waits_ms"] >= 0 and row[f"{n}_rows_waits_ms"] > 0
    # held to the rate: a step's traffic is at most the rate over the step plus what the sockets and the shaper
    # hold (each sender's send buffer, doubled by the kernel, and a piece in hand; the HTB's burst and queue)
    shape = reallink.Shape(300_000_000)
    held = 2 * traffic.SNDBUF + traffic.PIECE + shape.burst() + shape.limit()
    for n in ("sequential", "overlapped"):  # (one microbatch a step)
        assert row[f"{n}_load_mb"] * 1e6 <= 300e6 / 8 * row[f"{n}_loaded_ms"] * 1e-3 + held, n
    assert 0 < row["load_mbit"]  # (under a loaded test run it may get far less of the rate)
    assert 0 < row["forward_tx_mb"] < row["step_tx_mb"]
    assert row["pass_bound_on_link_ms_overlapped"] > 0 and row["bound_on_link_ms_accumulate"] > 0
    assert "passes, on the link" in stdout
    # each pass's fill, drain and first transfer, from one chunk's sequential step: the bounds with them are never
    # looser (equal where a pass's computation binds and the other chunks' fills cover its first transfer)
    assert row["forward_fill_ms"] > 0 and row["backward_drain_ms"] > 0 and row["backward_first_ms"] > 0
    assert row["pass_bound_filled_ms_overlapped"] >= row["pass_bound_ms_overlapped"]
    assert row["pass_bound_on_link_filled_ms_overlapped"] >= row["pass_bound_on_link_ms_overlapped"]
    assert row["bound_filled_ms_accumulate"] >= row["bound_ms_accumulate"]
    assert "passes, on the link, fill and drain" in stdout
