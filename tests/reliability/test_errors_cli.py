"""The commands' numeric arguments (bench.reallink, bench.overlap, bench.host, bench.peers,
bench.reallink.acceptance, examples.train_lm, lancet-autotune, the replay): an out-of-range, NaN or
infinite value is refused by argparse (``lancet_rt.cli``) with one error line naming the argument, the
value and what is allowed, and exit status 2, before the command does any work (no namespaces made,
no model built). The whole matrix runs in-process; the issue's cases and one per command also run as
the commands themselves."""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _parse(command: str, argv: list):
    """Run ``command``'s argument parsing on ``argv`` in this process; returns the parsed namespace."""
    if command == "bench.host":  # its parser lives in main(): make main stop right after it
        import bench.host as mod

        class _Parsed(Exception):
            pass

        def stop(n):
            raise _Parsed

        real, mod.torch.set_num_threads = mod.torch.set_num_threads, stop
        try:
            mod.main(argv)
        except _Parsed:
            return None
        finally:
            mod.torch.set_num_threads = real
    if command == "bench.peers":
        import bench.peers.run as mod

        return mod.main(argv + ["--models", "nothing"])  # refused after parsing (a ValueError), if parsing passes
    if command == "lancet-autotune":
        from lancet_rt.autotune import __main__ as mod
    elif command == "replay":
        from lancet_rt.autotune import replay as mod

        return mod.main(["missing-trace.json"] + argv)
    else:
        import importlib

        mod = importlib.import_module(PARSERS.get(command, command))
    return mod.parse_args(argv)


#: The module holding a package command's parser.
PARSERS = {"bench.reallink": "bench.reallink.run", "bench.overlap": "bench.overlap.args"}


BAD = {  # command -> {argument: bad values}
    "bench.reallink": {
        "--ranks": ["1", "65", "x"],
        "--delay-ms": ["-1", "nan", "inf", "1001"],
        "--queue-ms": ["nan", "0", "-2"],
        "--timeout": ["0", "inf"],
        "--probe-mb": ["0"],
        "--rate": ["fast", "1bit"],
    },
    "bench.overlap": {
        "--chunks": ["0", "65"],
        "--comm-ratio": ["nan", "0", "-1"],
        "--world-size": ["0"],
        "--latency-us": ["-1", "inf"],
        "--handshake-us": ["nan"],
        "--experts": ["0"],
        "--top-k": ["0"],
        "--capacity-factor": ["nan", "0"],
        "--steps": ["0"],
        "--threads": ["0"],
        "--max-seconds": ["-5"],
        "--microbatches": ["0"],
        "--bucket-mb": ["nan"],
        "--shadow-experts": ["-1"],
        "--replay-traces": ["0"],
    },
    "bench.host": {
        "--chunks": ["2,x", "0", "2,,4"],
        "--reps": ["0"],
        "--capacity-factor": ["inf"],
        "--top": ["-1"],
        "--world-size": ["0"],
    },
    "bench.peers": {"--world-sizes": ["0,2", "a"], "--timeout": ["-1", "nan"], "--rounds": ["0"], "--warmup": ["-1"]},
    "bench.reallink.acceptance": {"--rounds": ["0"], "--runs": ["7", "0,0", "-1"]},
    "examples.train_lm": {
        "--steps": ["0"],
        "--lr": ["inf", "0", "nan"],
        "--chunks": ["0"],
        "--capacity-factor": ["nan"],
        "--aux-loss-coef": ["-1"],
        "--timing-steps": ["-1"],
        "--vocab": ["1"],
    },
    "lancet-autotune": {
        "--bandwidth-gbps": ["inf", "0", "nan"],
        "--latency-us": ["-1"],
        "--reps": ["0"],
        "--capacity-factor": ["0", "nan", "x"],
        "--candidates": ["1,x", "0"],
        "--warmup": ["-1"],
        "--world-size": ["0"],
    },
    "replay": {"--chunks": ["0", "1,x"], "--bandwidth-gbps": ["nan", "-1"], "--latency-us": ["-1", "inf"]},
}
CASES = [(c, a, v) for c, args in BAD.items() for a, values in args.items() for v in values]


@pytest.mark.parametrize("command,arg,value", CASES, ids=[f"{c} {a} {v}" for c, a, v in CASES])
def test_a_bad_argument_is_one_line_and_exit_status_2(command, arg, value):
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as info:
        _parse(command, [f"{arg}={value}"])
    assert info.value.code == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert lines[-1].split(": error: ", 1)[-1].startswith(f"argument {arg}: "), lines
    assert repr(value) in lines[-1] and ("must be" in lines[-1] or "rate must be" in lines[-1]), lines[-1]
    assert not any("Traceback" in line for line in lines)


def test_good_arguments_still_parse():
    import bench.reallink.acceptance as acceptance
    import bench.reallink.run as reallink
    import examples.train_lm as train_lm
    from bench.reallink.link import parse_rate

    args = reallink.parse_args(["--ranks", "4", "--delay-ms", "0.5", "--queue-ms", "2", "--rate", "none"])
    assert (args.ranks, args.delay_ms, args.queue_ms, args.rate, args.probe_mb) == (4, 0.5, 2.0, "none", 8)
    assert reallink.parse_args([]).rate == 450_000_000 and parse_rate(reallink.parse_args([]).rate) == 450_000_000
    assert acceptance.parse_args([]).runs == [0, 1, 2, 3] and acceptance.parse_args(["--runs", "2,0"]).runs == [2, 0]
    args = train_lm.parse_args(["--capacity-factor", "-1", "--lr", "1e-3"])
    assert args.capacity_factor == -1.0 and args.lr == 1e-3 and args.steps == 300
    from lancet_rt.autotune import __main__ as autotune

    args = autotune.parse_args(["--capacity-factor", "none", "--candidates", "4,2,2", "--bandwidth-gbps", "50"])
    autotune.validate(args)
    assert args.capacity_factor is None and args.candidates == [2, 4] and args.bandwidth_gbps == 50.0
    assert math.isclose(autotune.parse_args([]).capacity_factor, 1.25)


COMMANDS = [  # (argv after python -m, the argument the error names)
    (["bench.reallink", "--ranks", "1"], "--ranks"),
    (["bench.reallink", "--ranks", "65"], "--ranks"),
    (["bench.reallink", "--delay-ms", "-1"], "--delay-ms"),
    (["bench.reallink", "--queue-ms", "nan"], "--queue-ms"),
    (["bench.overlap", "--chunks", "0"], "--chunks"),
    (["bench.host", "--chunks", "2,x"], "--chunks"),
    (["bench.peers", "--timeout", "-1"], "--timeout"),
    (["bench.reallink.acceptance", "--runs", "7"], "--runs"),
    (["examples.train_lm", "--lr", "inf"], "--lr"),
    (["lancet_rt.autotune", "--bandwidth-gbps", "inf"], "--bandwidth-gbps"),
    (["lancet_rt.autotune.replay", "x.json", "--chunks", "0"], "--chunks"),
]


def test_the_commands_refuse_bad_arguments_in_one_line_before_any_work():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        (
            subprocess.Popen(
                [sys.executable, "-m", *argv],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            argv,
            arg,
        )
        for argv, arg in COMMANDS
    ]
    for proc, argv, arg in procs:  # (started together: each spends its time importing torch)
        out, err = proc.communicate(timeout=600)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and out == "", (argv, proc.returncode, out, err)
        assert f"error: argument {arg}: " in lines[-1] and "must be" in lines[-1] and "Traceback" not in err, (
            argv,
            err,
        )
        if argv[0] == "bench.reallink" and shutil.which("ip"):  # no namespace of that launcher
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
            assert f"lancetrl{proc.pid}-" not in listed
