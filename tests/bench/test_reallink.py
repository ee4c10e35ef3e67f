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
