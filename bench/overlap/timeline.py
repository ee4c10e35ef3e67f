"""The timeline PNG of bench.overlap (``--png``): the link's transfers and the host's computation of
one sequential and one overlapped step, and the cross-microbatch step when there is one."""

from __future__ import annotations


def _busy_intervals(events, t0, t1):
    """[t0, t1] minus the host's waits on the link: when the host (the compute stream on CPU) works."""
    waits = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "wait")
    busy, cur = [], t0
    for a, b in waits:
        if a > cur:
            busy.append((cur, a))
        cur = max(cur, b)
    if t1 > cur:
        busy.append((cur, t1))
    return busy


def draw_timeline(traces: dict, path: str, row: dict) -> None:
    """Two lanes per schedule: the link's transfers, and the computation (grey: busy; colours: the
    chunk a stage belongs to; forward chunks, then backward stages of the MoE layers). With an
    "accumulate" trace, a second panel shows the cross-microbatch step (:func:`draw_accumulate_lanes`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = dict(traces)
    accum = traces.pop("accumulate", None)
    if accum is None:
        fig, ax = plt.subplots(figsize=(12, 3.4))
    else:
        fig, (ax, accum_ax) = plt.subplots(2, 1, figsize=(12, 6.2), gridspec_kw=dict(height_ratios=[4, 3]))
    colors = plt.get_cmap("tab10")
    lanes = []
    for mode, tr in traces.items():
        events = tr.events()
        host = [e for e in events if e["tid"] in ("compute", "wait")]
        t0 = min(e["ts"] for e in host)
        t1 = max(e["ts"] + e["dur"] for e in host)
        y_link, y_comp = len(lanes), len(lanes) + 1
        lanes += [f"{mode}\nlink", f"{mode}\ncompute"]
        for e in events:
            if e["tid"] == "link":
                ax.broken_barh(
                    [((e["ts"] - t0) / 1e3, e["dur"] / 1e3)],
                    (y_link - 0.4, 0.8),
                    facecolors="tab:red",
                    edgecolor="white",
                    linewidth=0.3,
                )
        ax.broken_barh(
            [((a - t0) / 1e3, (b - a) / 1e3) for a, b in _busy_intervals(events, t0, t1)],
            (y_comp - 0.4, 0.8),
            facecolors="lightgray",
        )
        for e in events:
            chunk = e["args"].get("chunk")
            if e["tid"] != "compute" or chunk is None:
                continue
            if not (e["name"].startswith("chunk") or e["name"].endswith("bwd") or e["name"] == "dW"):
                continue
            ax.broken_barh(
                [((e["ts"] - t0) / 1e3, e["dur"] / 1e3)],
                (y_comp - 0.4, 0.8),
                facecolors=colors(chunk % 10),
                alpha=0.9 if e["name"].startswith("chunk") else 1.0,
            )
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_xlabel("ms (one forward + backward step)")
    ax.set_title(
        f"{row['device']}: sequential {row['sequential_ms']:.1f} ms vs overlapped "
        f"{row['overlapped_ms']:.1f} ms (comm {row['comm_ms']:.1f} ms, compute {row['compute_ms']:.1f} ms); "
        f"grey: busy, colours: chunks",
        fontsize=9,
    )
    if accum is not None:
        draw_accumulate_lanes(accum_ax, accum, row)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_accumulate_lanes(ax, tr, row: dict) -> None:
    """The cross-microbatch step: the link's transfers (red: all-to-alls, blue: all-reduces), and
    which pass the host runs: microbatch i's forward (light) and backward (dark, hatched) in
    microbatch i's colour, white where the host waits for a transfer."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    events = tr.events()
    host = [e for e in events if e["tid"] in ("compute", "wait")]
    t0 = min(e["ts"] for e in host)
    t1 = max(e["ts"] + e["dur"] for e in host)
    kind = {"all_reduce": "tab:blue", "exchange": "dimgray"}
    for e in events:
        if e["tid"] == "link":
            ax.broken_barh(
                [((e["ts"] - t0) / 1e3, e["dur"] / 1e3)],
                (1.6, 0.8),
                facecolors=kind.get(e["name"], "tab:red"),
                edgecolor="white",
                linewidth=0.3,
            )
    for name, alpha, hatch in (("forward", 0.35, None), ("backward", 0.95, "///")):
        for e in events:
            if e["tid"] == "compute" and e["name"].startswith(name + " "):
                i = e["args"]["microbatch"]
                ax.broken_barh(
                    [((e["ts"] - t0) / 1e3, e["dur"] / 1e3)],
                    (0.6, 0.8),
                    facecolors=colors(i % 10),
                    alpha=alpha,
                    hatch=hatch,
                    edgecolor="white" if hatch else None,
                    linewidth=0,
                )
    busy = _busy_intervals(events, t0, t1)
    idle = [(a, b) for (_, a), (b, _) in zip(busy, busy[1:])]
    ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in idle], (0.6, 0.8), facecolors="white")
    ax.set_yticks([1, 2], ["accumulate\nhost", "accumulate\nlink"], fontsize=8)
    ax.set_xlabel(f"ms (one step of {row['microbatches']} microbatches)")
    ax.set_title(
        f"Overlapped.accumulate: {row['accumulate_ms']:.1f} ms vs {row['microbatches']} x overlapped "
        f"{row['accumulate_sequential_ms']:.1f} ms (comm {row['accum_comm_ms']:.1f} ms, hides "
        f"{row['hidden_comm_fraction_accum']:.2f}); light: forward i, dark: backward i beside forward i+1",
        fontsize=9,
    )
