"""The timeline: one DDP step per rank as a picture, communication against compute.

What
    ``plot_timeline(events_per_rank, path)`` draws the events a ``trace.Tracer`` recorded (PNG or
    SVG, from the file name): per rank a compute row (forward, backward, wait + copy-back,
    optimizer) and a communication row (one colour per bucket, ``bucket_colours``, the same on
    every rank), the exposed communication shaded and totalled; it returns each rank's
    ``trace.step_summary``.

Why
    "Overlap" is a claim about time: bucket 0's bar starting while the backward bar still runs
    is the whole point of bucketing (the DDP paper's Fig. 7; the Ultra-Scale Playbook's DP
    chapter draws the same picture).

How torch differs
    torch draws nothing: ``torch.profiler`` exports a trace for Perfetto or TensorBoard, kernel by
    kernel; ``trace.to_chrome_trace`` gives ours in the same format.
"""

from __future__ import annotations

from .trace import spans, step_summary


def bucket_colours(n: int) -> list:
    """One colour per bucket: tab10 without its blue (backward) and red (exposed); a gradient beyond 8."""
    import matplotlib

    if n <= 8:
        return [f"tab:{c}" for c in ("orange", "green", "purple", "brown", "pink", "gray", "olive", "cyan")][:n]
    return [matplotlib.colormaps["viridis"](b / (n - 1)) for b in range(n)]


def plot_timeline(events_per_rank, path, title: str = "one DDP step") -> dict:
    """Draw one step per rank (PNG or SVG, from ``path``'s suffix); returns each rank's ``step_summary``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(e["t"] for events in events_per_rank for e in events)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    n_buckets = 1 + max((e["bucket"] for ev in events_per_rank for e in ev if "bucket" in e), default=0)
    bucket_colour = lambda b: bucket_colours(n_buckets)[b]  # noqa: E731  (the same on every rank)
    compute = {"forward": "#9ecae1", "backward": "#3182bd", "finalize": "#d9d9d9", "optimizer": "#756bb1"}
    fig, ax = plt.subplots(figsize=(11, 1.6 + 1.3 * len(events_per_rank)))
    span_ms = max(e["t"] for events in events_per_rank for e in events) * 1e3 - t0 * 1e3
    summaries, labels = [], []
    for rank, events in enumerate(events_per_rank):
        s = step_summary(events)
        summaries.append(s)
        y_comp, y_comm = 2 * rank, 2 * rank + 1
        first = {}
        for e in sorted(events, key=lambda e: e["t"]):
            first.setdefault(e["name"], e["t"])
        compute_end = first["backward start"] + s["backward_compute_s"]
        buckets = sorted(((start, end, e["bucket"]) for name, start, end, e in spans(events)
                          if name.startswith("all-reduce")))
        lanes: list[float] = []  # buckets in flight at once get lanes of their own: no bar hides another
        placed = []
        for start, end, b in buckets:
            lane = next((i for i, free in enumerate(lanes) if free <= start), len(lanes))
            lanes[lane:lane + 1] = [end]
            placed.append((start, end, b, lane))
        height = 0.7 / max(1, len(lanes))
        for start, end, b, lane in placed:
            y = y_comm - 0.35 + height * (lane + 0.5)
            ax.barh(y, ms(end) - ms(start), left=ms(start), height=height, color=bucket_colour(b),
                    edgecolor="black", linewidth=0.4, zorder=2)
            if ms(end) - ms(start) > 0.018 * span_ms:  # its number on it, where it fits
                ax.text((ms(start) + ms(end)) / 2, y, str(b), ha="center", va="center", fontsize=10, zorder=4)
        for name, start, end, e in spans(events):
            if name == "backward":  # compute until the last gradient, then wait + copy back
                ax.barh(y_comp, ms(compute_end) - ms(start), left=ms(start), height=0.7, color=compute["backward"])
                ax.barh(y_comp, ms(end) - ms(compute_end), left=ms(compute_end), height=0.7,
                        color=compute["finalize"])
            elif name in compute:
                ax.barh(y_comp, ms(end) - ms(start), left=ms(start), height=0.7, color=compute[name])
        if "optimizer step" in first and "optimizer start" not in first:  # an instant: a thin bar
            ax.barh(y_comp, 0.3, left=ms(first["optimizer step"]), height=0.7, color=compute["optimizer"])
        if s["exposed_comm_s"] > 0:  # the communication nothing hides: shaded *behind* the bars, underlined
            last = compute_end + s["exposed_comm_s"]
            ax.fill_between([ms(compute_end), ms(last)], y_comm - 0.45, y_comm + 0.45, facecolor=(1, 0, 0, 0.12),
                            hatch="///", edgecolor=(1, 0, 0, 0.5), linewidth=0, zorder=1)
            ax.plot([ms(compute_end), ms(last)], [y_comm + 0.47] * 2, color="red", linewidth=2.5,
                    solid_capstyle="butt", zorder=3)
            ax.text(ms(last), y_comm, f"  exposed {s['exposed_comm_s'] * 1e3:.1f} ms", color="darkred",
                    fontsize=10, va="center", ha="left")
        labels += [f"rank {rank} compute", f"rank {rank} all-reduce"]
    ax.set_yticks(range(len(labels)), labels, fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began", fontsize=10)
    exposed = ", ".join(f"rank {r} {s['exposed_comm_s'] * 1e3:.1f} ms" for r, s in enumerate(summaries))
    ax.set_title(f"{title}\nexposed communication (after the rank's last gradient): {exposed}", fontsize=11)
    ax.set_xlim(right=ax.get_xlim()[1] * 1.08)  # room for the labels
    handles = [Patch(color=c, label={"finalize": "wait + copy-back"}.get(k, k)) for k, c in compute.items()]
    shown = range(n_buckets) if n_buckets <= 8 else (0, 1, n_buckets - 1)  # a gradient: its ends suffice
    handles += [Patch(facecolor=bucket_colour(b), edgecolor="black", label=f"bucket {b}") for b in shown]
    handles.append(Patch(facecolor=(1, 0, 0, 0.12), hatch="///", edgecolor="red", label="exposed communication"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(events_per_rank)),
              ncol=min(8, len(handles)), fontsize=10, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: selectable, sharp at any size
        fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return summaries
