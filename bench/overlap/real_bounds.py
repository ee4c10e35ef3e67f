"""What no schedule beats on ``bench.overlap --link real``'s link, from one run's row: the link's whole-step
bound (the busiest port's bytes at the configured rate, :func:`link_bound`) and each schedule's own bound
(:func:`pass_bound`: a single step's backward starts after its forward, ``accumulate``'s passes interleave
across microbatches; stated with its unshaped computation, or with its computation as it ran on the link), the
table of each schedule against its own (:func:`report_bounds`), and the table of what each schedule computed
and waited for (:func:`report_computing`)."""

from __future__ import annotations

from typing import Optional

from bench.common import print_table


def link_bound(row: dict, step_tx_bytes: Optional[float]) -> dict:
    """What no schedule can beat on this link: the busiest port must pass ``step_tx_bytes`` (one sequential
    step's wire bytes) at the configured rate, ``link_time_ms``; Overlapped's step is at least that and at least
    its own unshaped step, so ``bound_speedup`` = sequential / max(the two) and ``bound_hidden`` the hidden
    fraction there. (The calibration's ``comm_ms``, shaped minus unshaped, is less than ``link_time_ms``: the
    unshaped link's transfers take time too, inside the sequential step's computation.) None without a rate."""
    rate, ov = row.get("configured_mbit"), row.get("overlapped_compute_ms")
    if not step_tx_bytes or not rate or ov is None or "sequential_ms" not in row:
        return dict(
            step_tx_mb=None if not step_tx_bytes else step_tx_bytes / 1e6,
            link_time_ms=None,
            bound_speedup=None,
            bound_hidden=None,
        )
    link_ms = step_tx_bytes * 8 / (rate * 1e6) * 1e3
    best = max(link_ms, ov)
    comm = row["comm_ms"]
    return dict(
        step_tx_mb=step_tx_bytes / 1e6,
        link_time_ms=link_ms,
        bound_speedup=row["sequential_ms"] / best,
        bound_hidden=1 - (best - ov) / comm if comm > 0 else None,
    )


def pass_bound(
    row: dict,
    step_tx_bytes: Optional[float],
    fwd_tx_bytes: Optional[float],
    names: list,
    compute: str = "unshaped",
    fill: Optional[dict] = None,
) -> dict:
    """Each schedule's own bound on this link. A single step's backward cannot start before its forward
    ends, so a step of ``n`` takes at least max(n's forward compute, the forward's link time) + max(n's
    backward compute, the backward's link time): the busiest port's bytes of each pass (one sequential step's,
    read at its forward's end) at the configured rate (``forward_link_ms``, ``backward_link_ms``), and
    ``n``'s unshaped forward and the rest of its unshaped step. Per schedule with one forward then one
    backward: ``pass_bound_ms_<n>``, ``pass_bound_speedup_<n>`` (sequential over it), ``pass_bound_hidden_<n>``
    and how near ``n`` comes, ``of_pass_bound_<n>`` (the bound over its step: 1 at the bound) and
    ``of_pass_bound_hidden_<n>`` (its hidden fraction over the bound's). ``accumulate``'s passes interleave
    across microbatches, so its bound is the whole step's per microbatch, max(its own compute, the link
    time): ``bound_ms_accumulate``, ``bound_speedup_accumulate``, ``bound_hidden_accumulate``,
    ``of_bound_accumulate``. Nothing without a rate or the bytes.

    ``compute="on_link"``: the same bounds stated with each schedule's computation as it ran on the link, its
    step's time outside its waits (``<n>_computing_ms``, ``<n>_forward_computing_ms``: bench.overlap.real_waits),
    what the bytes' transfer took from the cores included, as ``pass_bound_on_link_*`` and ``bound_on_link_*``
    (nothing for a schedule without that timing).

    ``fill``: each pass's fill, drain and first transfer (bench.overlap.real_fill): a pass's link is idle until
    its first collective and after its last, so its link term is fill + its bytes at the rate + drain; its
    computation waits for a chunk's first transfer where the other chunks' fills do not cover it, so its
    computation term is the computation + max(0, first transfer - (chunks - 1) fills) (with the computation on the
    link, the fills grown as the pass's computation grew there). ``accumulate``'s step's
    link term is the first forward's fill + the bytes + the last backward's drain, shared by its microbatches.
    The fields gain ``_filled`` after the computation's tag (``pass_bound_filled_*``,
    ``pass_bound_on_link_filled_*``, ``bound_filled_*``...); nothing if a figure is missing."""
    rate, comm = row.get("configured_mbit"), row.get("comm_ms")
    if not step_tx_bytes or fwd_tx_bytes is None or not rate or "sequential_ms" not in row:
        return {}
    to_ms = 8 / (rate * 1e6) * 1e3
    fwd_link, bwd_link = fwd_tx_bytes * to_ms, (step_tx_bytes - fwd_tx_bytes) * to_ms
    out = dict(forward_tx_mb=fwd_tx_bytes / 1e6, forward_link_ms=fwd_link, backward_link_ms=bwd_link)
    seq = row["sequential_ms"]
    if compute not in SOURCES:
        raise ValueError(f"compute must be one of {SOURCES}, got {compute!r}")
    tag = "" if compute == "unshaped" else f"_{compute}"
    link_idle = dict(forward=0.0, backward=0.0, step=0.0)
    if fill is not None:
        if any(fill.get(k) is None for k in FILL):
            return out
        tag += "_filled"
        link_idle = dict(
            forward=fill["forward_fill_ms"] + fill["forward_drain_ms"],
            backward=fill["backward_fill_ms"] + fill["backward_drain_ms"],
            step=(fill["forward_fill_ms"] + fill["backward_drain_ms"]) / (row.get("microbatches") or 1),
        )
    others = (row.get("chunks") or 1) - 1

    def compute_idle(p: str, computed: float, unshaped: float) -> float:
        # (the fills were measured off the link: as the pass's computation ran, they took ``computed / unshaped``)
        if fill is None:
            return 0.0
        return max(0.0, fill[f"{p}_first_ms"] - others * fill[f"{p}_fill_ms"] * computed / unshaped)

    def fields(suffix: str, bound: float, n: str) -> None:
        hidden = 1 - (bound - row[f"{n}_compute_ms"]) / comm if comm and comm > 0 else None
        out[f"{suffix}_ms_{n}"] = bound
        out[f"{suffix}_speedup_{n}"] = seq / bound
        out[f"{suffix}_hidden_{n}"] = hidden
        out[f"of_{suffix}_{n}"] = bound / row[f"{n}_ms"]
        mine = row.get(f"hidden_{n}")
        out[f"of_{suffix}_hidden_{n}"] = mine / hidden if hidden and mine is not None else None

    for n in names:
        step, fwd = (row.get(f"{n}_compute_ms"), row.get(f"{n}_forward_compute_ms"))
        if compute == "on_link":
            step, fwd = (row.get(f"{n}_computing_ms"), row.get(f"{n}_forward_computing_ms"))
        if step is None:
            continue
        # (the sequential step overlaps nothing; a peer's all-to-alls run on another transport than the rate's)
        if fwd is not None and n != "sequential" and not n.startswith("peer_"):
            fwd_off, bwd_off = row[f"{n}_forward_compute_ms"], row[f"{n}_compute_ms"] - row[f"{n}_forward_compute_ms"]
            forward = max(fwd + compute_idle("forward", fwd, fwd_off), fwd_link + link_idle["forward"])
            backward = max(step - fwd + compute_idle("backward", step - fwd, bwd_off), bwd_link + link_idle["backward"])
            fields(f"pass_bound{tag}", forward + backward, n)
        if n == "accumulate":
            fields(f"bound{tag}", max(step, fwd_link + bwd_link + link_idle["step"]), "accumulate")
    return out


#: The computations a bound may take (:func:`pass_bound`'s ``compute``).
SOURCES = ("unshaped", "on_link")
#: The figures :func:`pass_bound`'s ``fill`` needs (bench.overlap.real_fill), in ms: each pass's fill, drain and
#: first transfer.
FILL = (
    "forward_fill_ms",
    "forward_drain_ms",
    "backward_fill_ms",
    "backward_drain_ms",
    "forward_first_ms",
    "backward_first_ms",
)


#: The bounds' computations as the table names them: field suffix, words, the forward's field.
BOUND_SOURCES = (
    ("", "", "{}_forward_compute_ms"),
    ("_on_link", ", on the link", "{}_forward_computing_ms"),
    ("_filled", ", fill and drain", "{}_forward_compute_ms"),
    ("_on_link_filled", ", on the link, fill and drain", "{}_forward_computing_ms"),
)


def report_bounds(row: dict, names: list) -> None:
    """Each schedule against its own bound (:func:`pass_bound`)."""
    if row.get("forward_link_ms") is None:
        return
    print(
        f"pass bound: the forward's bytes take {row['forward_link_ms']:.0f} ms at the rate, the backward's "
        f"{row['backward_link_ms']:.0f} ms; a step is at least max(its forward's compute, the forward's link) + "
        "max(its backward's compute, the backward's link)"
    )
    if all(row.get(k) is not None for k in FILL):
        print(
            f"fill and drain (bench.overlap.real_fill: one chunk's computation before a pass's first collective and "
            f"after its last; its first transfer on the link): forward {row['forward_fill_ms']:.1f} + "
            f"{row['forward_drain_ms']:.1f} ms (first transfer {row['forward_first_ms']:.1f} ms), backward "
            f"{row['backward_fill_ms']:.1f} + {row['backward_drain_ms']:.1f} ms (first transfer "
            f"{row['backward_first_ms']:.1f} ms); with them, a pass takes at least fill + its bytes at the rate + "
            "drain and at least its computation + max(0, first transfer - (chunks - 1) fills)"
        )
    table = []
    for n in names:
        for base in ("pass_bound", "bound"):
            for source, said, fwd in BOUND_SOURCES:
                suffix = base + source
                if f"{suffix}_ms_{n}" not in row:
                    continue
                table.append(
                    dict(
                        schedule=n,
                        bound=("passes" if base == "pass_bound" else "step") + said,
                        forward_compute_ms=row.get(fwd.format(n)),
                        bound_ms=row[f"{suffix}_ms_{n}"],
                        bound_speedup=row[f"{suffix}_speedup_{n}"],
                        bound_hidden=row[f"{suffix}_hidden_{n}"],
                        of_bound=row[f"of_{suffix}_{n}"],
                        of_bound_hidden=row[f"of_{suffix}_hidden_{n}"],
                    )
                )
    if table:
        cols = ["schedule", "bound", "forward_compute_ms", "bound_ms", "bound_speedup", "bound_hidden"]
        print_table(table, cols + ["of_bound", "of_bound_hidden"], title="each schedule's own bound on this link")


def report_computing(row: dict, names: list) -> None:
    """What each schedule computed (its steps' time outside their waits) off the link, on it, and, with
    ``--loaded``, off it while the traffic beside filled it at the rate with no dependency on the step; and
    what its step on the link waited for: the counts, and rows (all-to-alls), in the forward and in all."""
    table = []
    for n in names:
        off, on = row.get(f"{n}_computing_unshaped_ms"), row.get(f"{n}_computing_ms")
        if off is None or on is None:
            continue
        beside = row.get(f"{n}_computing_loaded_ms")
        table.append(
            dict(
                schedule=n,
                off_link_ms=off,
                beside_traffic_ms=beside,
                x_beside=None if beside is None else beside / off,
                on_link_ms=on,
                x_on_link=on / off,
                waits_counts_ms=row.get(f"{n}_counts_waits_ms"),
                waits_rows_ms=row.get(f"{n}_rows_waits_ms"),
                fwd_waits_counts_ms=row.get(f"{n}_forward_counts_waits_ms"),
                fwd_waits_rows_ms=row.get(f"{n}_forward_rows_waits_ms"),
                idle_off_link=row.get(f"{n}_cpu_idle_unshaped"),
                idle_on_link=row.get(f"{n}_cpu_idle"),
                irq_on_link=row.get(f"{n}_cpu_irq"),
            )
        )
    if table:
        beside = f", traffic beside at {row['load_mbit']:.0f} Mbit/s a rank" if row.get("load_mbit") else ""
        print_table(
            table,
            list(table[0]),
            title=f"each schedule's computation (its step outside its waits, per microbatch){beside}; what its "
            "step on the link waited for; and the machine's cores idle off the link and on it, and in interrupts "
            "(the network's receive path) on it",
        )
