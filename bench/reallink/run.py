"""``python -m bench.reallink``: build a real link, measure it or run a command of ours over it, tear it
down (the link itself: :mod:`bench.reallink.link`; the probe: :mod:`bench.reallink.probe`)."""

from __future__ import annotations

import argparse
import os
import sys

from bench.reallink import link
from bench.reallink.link import QUEUE_MS, LinkError, parse_rate, real_link, require_tools, signals_raise
from lancet_rt.cli import checked, float_in, int_in, or_word


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m bench.reallink", description=link.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int_in(2, 64), default=2)
    p.add_argument(
        "--rate",
        type=or_word(checked(parse_rate), value="none"),
        default="450mbit",
        help="each rank's port rate, tc style (450mbit, 1gbit); 'none': unshaped",
    )
    p.add_argument("--delay-ms", type=float_in(0, 1000), default=0.0, help="netem delay on each rank's egress")
    p.add_argument(
        "--queue-ms",
        type=float_in(0, 1000, above=True),
        default=QUEUE_MS,
        help="the token bucket's queue, in ms at the rate",
    )
    p.add_argument(
        "--timeout", type=float_in(0, 1e7, above=True), default=3600.0, help="seconds the ranks may run (then ended)"
    )
    p.add_argument(
        "--probe-mb", type=int_in(1, 4096), default=8, help="MiB each rank sends to each other in the rate probe"
    )
    p.add_argument("--no-probe", action="store_true", help="with a command: do not measure the link first")
    p.add_argument(
        "--json", default="out/reallink.json", help="append the probe's row here ('': no row; default out/, untracked)"
    )
    p.add_argument("--rank-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.command = command
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_probe:
        from bench.reallink.probe import probe_rank

        probe_rank(args)
        return 0
    try:
        if args.command and args.command[0] != "-m":
            raise ValueError(
                f"the command after -- must be '-m <module> ARGS' (a module of ours), got {args.command[:2]}"
            )
        rate = None if args.rate == "none" else parse_rate(args.rate)
        require_tools()
    except (LinkError, ValueError) as exc:
        print(f"bench.reallink: {exc}", file=sys.stderr)
        return 2
    signals_raise()
    from bench.common import RowLog, run_metadata

    try:
        with real_link(args.ranks, rate, args.delay_ms, queue_ms=args.queue_ms) as link:
            print(
                f"bench.reallink: {args.ranks} ranks in namespaces {link.ns(0)}.., bridge {link.bridge}; each port "
                f"{'unshaped' if rate is None else f'{rate / 1e6:g} Mbit/s'}"
                f"{f', delay {args.delay_ms:g} ms' if args.delay_ms else ''}; load average "
                f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}",
                flush=True,
            )
            if not args.no_probe or not args.command:
                from bench.reallink.probe import measure

                res = measure(link, args.probe_mb)
                print(
                    f"link: per-rank rate achieved {res['socket_mbit']:.0f} Mbit/s with plain sockets, "
                    f"{res['gloo_a2a_mbit']:.0f} Mbit/s as one gloo all-to-all ({args.probe_mb} MiB to each peer, "
                    f"all directions at once); small all-to-all latency {res['a2a_latency_us']:.0f} us",
                    flush=True,
                )
                if args.json:
                    import torch

                    RowLog(args.json).add(
                        dict(
                            bench="reallink",
                            **run_metadata(torch.device("cpu")),
                            load_avg=os.getloadavg(),
                            configured_mbit=(rate or 0) / 1e6,
                            delay_ms=args.delay_ms,
                            queue_ms=args.queue_ms,
                            **res,
                        )
                    )
            if args.command:
                return link.launch(args.command, args.timeout)
    except LinkError as exc:
        print(f"bench.reallink: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.reallink: interrupted; the link was torn down", file=sys.stderr)
        return 130
    return 0
