"""Tracing: see communication overlap backward, instead of taking it on faith.

What
    A ``Tracer`` records per-rank events with a monotonic clock: backward start,
    each gradient ready, each bucket launched and finished, backward end, and the
    spans you wrap in ``tracer.span("forward")`` / ``tracer.span("optimizer")``.
    ``to_chrome_trace`` turns the events of all ranks into the JSON that
    ``chrome://tracing`` and Perfetto open; ``step_summary`` measures one step
    (how much communication ran *after* the backward's compute: the exposed
    part); ``plot_timeline`` draws it (PNG or SVG, from the file name): per rank a
    compute row (forward, backward, wait + copy-back, optimizer) and a
    communication row (one colour per bucket, the same on every rank), the
    exposed communication shaded and totalled.

Why
    "Overlap" is a claim about time. A timeline shows it: bucket 0's all-reduce
    bar starting while the backward bar is still running is the whole point of
    bucketing (the DDP paper's Fig. 7; the Ultra-Scale Playbook's DP chapter
    draws the same picture). What is not hidden is what a bigger or smaller
    ``bucket_cap_mb`` can win back (``miniddp.engine.costmodel`` predicts it).

How torch differs
    ``torch.profiler`` records the same story at kernel level (look for
    ``nccl:all_reduce`` / ``gloo:all_reduce`` rows overlapping
    ``autograd::engine`` rows), with far more detail and far more noise. torch's
    DDP keeps five timestamps per sampled iteration instead
    (``_get_ddp_logging_data()``: ``backward_comm_time`` from the first bucket's
    launch to the end of its finalize, ``backward_compute_comm_overlap_time``
    until backward's compute ends); ``step_summary`` computes the same two from
    our events. A bucket's finish time comes from its work's future callback,
    which fires when the collective completes on gloo's worker thread. On CUDA
    that callback fires at *enqueue*, so ``Tracer(device="cuda")`` records CUDA
    events instead (in the callback, on the stream that waits for NCCL) and
    ``synchronize()`` turns them into times.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import torch


class Tracer:
    """Collects one rank's events; ``events`` is a list of dicts (picklable)."""

    def __init__(self, rank: int = 0, device=None):
        self.rank = rank  # the rank these events belong to (a row group in the trace)
        self._events: list[dict] = []  # {"name", "t" (seconds), "rank", ...}; read through .events
        self._finishing: list = []  # futures of the bucket-finished callbacks, still running on a comm thread
        self.origin = 0.0  # perf_counter is system-wide on Linux: ranks share one clock
        self.lock = threading.Lock()  # bucket-finished callbacks arrive on a comm thread
        self.cuda = device is not None and torch.device(device).type == "cuda"  # time with CUDA events
        self._pending: list = []  # CUDA: (event dict, torch.cuda.Event) until synchronize()
        self._cuda_origin = None  # CUDA: (host time, event recorded after a device sync)

    def _now(self) -> float:
        return time.perf_counter() - self.origin

    def event(self, name: str, **fields) -> None:
        with self.lock:
            e = {"name": name, "t": self._now(), "rank": self.rank, **fields}
            self._events.append(e)
            if self.cuda:  # the host time is only when it was *queued*; the device time replaces it
                if self._cuda_origin is None:
                    torch.cuda.synchronize()
                    origin = torch.cuda.Event(enable_timing=True)
                    origin.record()
                    self._cuda_origin = (self._now(), origin)
                marker = torch.cuda.Event(enable_timing=True)
                marker.record()  # on the current stream: in a future's callback, one that waits for NCCL
                self._pending.append((e, marker))

    @contextlib.contextmanager
    def span(self, name: str):
        """``with tracer.span("forward"):`` records ``forward start`` and ``forward end``."""
        self.event(f"{name} start")
        try:
            yield
        finally:
            self.event(f"{name} end")

    def bucket_launched(self, bucket) -> None:
        info = {"bucket": bucket.index, "bytes": bucket.nbytes, "params": len(bucket.params)}
        self.event("bucket launched", **info)

        def finished(fut):
            self.event("bucket finished", **info)
            return fut.value()  # hand the result on unchanged

        self._finishing.append(bucket.work.get_future().then(finished))

    @property
    def events(self) -> list[dict]:
        """Every event so far. A bucket's future completes *before* its callbacks run, on the comm thread
        and once it gets the GIL: backward can return before the last "bucket finished" is recorded, so
        this waits for them first; and a finish recorded after its backward's end is dated at that end,
        since the reducer had seen the bucket complete before it ended the backward."""
        finishing, self._finishing = self._finishing, []
        for f in finishing:
            try:
                f.wait()
            except RuntimeError:  # the collective failed: the reducer raises it, the trace keeps what it has
                pass
        with self.lock:
            _date_late_finishes(self._events)
        return self._events

    def step(self) -> None:
        """Call after ``optimizer.step()`` (or wrap it in ``span("optimizer")``)."""
        self.event("optimizer step")

    def synchronize(self) -> list[dict]:
        """The events, complete. CUDA: wait for the device and give each event its device time."""
        events = self.events
        if self.cuda and self._pending:
            torch.cuda.synchronize()
            host, origin = self._cuda_origin
            with self.lock:
                for e, marker in self._pending:
                    e["t"] = host + origin.elapsed_time(marker) / 1e3
                self._pending = []
        return events

    def clear(self) -> None:
        with self.lock:
            self._events, self._pending, self._cuda_origin, self._finishing = [], [], None, []


def _date_late_finishes(events: list[dict]) -> None:
    """In recording order: a "bucket finished" that came after the "backward end" of the backward that
    launched it gets that end's time (its callback ran late; the collective had completed by then)."""
    launched, ended = set(), {}  # buckets launched in the current backward; bucket -> its backward's end
    for e in events:
        if e["name"] == "backward start":
            launched = set()
        elif e["name"] == "bucket launched":
            launched.add(e["bucket"])
            ended.pop(e["bucket"], None)
        elif e["name"] == "backward end":
            ended.update((b, e["t"]) for b in launched)
        elif e["name"] == "bucket finished" and e["bucket"] in ended:
            e["t"] = min(e["t"], ended.pop(e["bucket"]))


def _spans(events: list[dict]) -> list[tuple[str, float, float, dict]]:
    """(name, start, end, fields) for backward, every ``span``, and each bucket's all-reduce."""
    spans, open_ = [], {}
    for e in sorted(events, key=lambda e: e["t"]):
        name = e["name"]
        if name == "bucket launched":
            open_[("bucket", e["bucket"])] = e["t"]
        elif name == "bucket finished" and ("bucket", e["bucket"]) in open_:
            spans.append((f"all-reduce bucket {e['bucket']}", open_.pop(("bucket", e["bucket"])), e["t"], e))
        elif name.endswith(" start"):
            open_[name[:-6]] = e["t"]
        elif name.endswith(" end") and name[:-4] in open_:
            spans.append((name[:-4], open_.pop(name[:-4]), e["t"], e))
    return spans


# --8<-- [start:chrome]
def to_chrome_trace(events_per_rank: list[list[dict]]) -> dict:
    """Chrome trace JSON: one process per rank; backward, spans and each bucket's all-reduce."""
    out = []
    for events in events_per_rank:
        for name, start, end, e in _spans(events):
            bucket = name.startswith("all-reduce")
            args = {"args": {"bytes": e["bytes"], "params": e["params"]}} if bucket else {}
            out.append(dict(name=name, ph="X", ts=start * 1e6, dur=(end - start) * 1e6, pid=e["rank"],
                            tid=int(bucket), **args))
        for e in events:  # grad ready, optimizer step: instants
            if e["name"] in ("grad ready", "optimizer step"):
                out.append(dict(name=e["name"] + (f" {e['param']}" if "param" in e else ""), ph="i", s="t",
                                ts=e["t"] * 1e6, pid=e["rank"], tid=0))
        out.append(dict(name="thread_name", ph="M", pid=events[0]["rank"] if events else 0, tid=1,
                        args={"name": "communication"}))
    return {"traceEvents": out, "displayTimeUnit": "ms"}
# --8<-- [end:chrome]


def save_chrome_trace(events_per_rank, path) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events_per_rank), f)


# --8<-- [start:summary]
def step_summary(events: list[dict]) -> dict:
    """One rank's step, in seconds: where compute ends, how much communication is hidden behind
    it and how much is exposed (runs after it), and torch's two logging figures for the same step."""
    first = {}
    for e in sorted(events, key=lambda e: e["t"]):
        first.setdefault(e["name"], e["t"])
    ready = [e["t"] for e in events if e["name"] == "grad ready"]
    buckets = [(s, t) for n, s, t, _ in _spans(events) if n.startswith("all-reduce")]
    start, end = first["backward start"], first["backward end"]
    compute_end = max(ready, default=start)  # backward computes until its last gradient is ready
    busy, exposed, reach = 0.0, 0.0, float("-inf")  # union of the bucket intervals (they may overlap)
    for s, t in sorted(buckets):
        s = max(s, reach)
        if t > s:
            busy += t - s
            exposed += max(0.0, t - max(s, compute_end))
            reach = t
    first_launch = min((s for s, _ in buckets), default=compute_end)
    step_start = first.get("forward start", start)
    step_end = first.get("optimizer end", first.get("optimizer step", end))
    return {"forward_s": start - step_start, "backward_compute_s": compute_end - start,
            "comm_s": busy, "exposed_comm_s": exposed, "hidden_comm_s": busy - exposed,
            "finalize_s": end - compute_end, "optimizer_s": step_end - end, "step_s": step_end - step_start,
            # what torch's logger reports for this step (reducer.cpp's timer, in seconds here)
            "torch_backward_comm_s": end - first_launch, "torch_overlap_s": max(0.0, compute_end - first_launch)}
# --8<-- [end:summary]


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
        buckets = sorted(((start, end, e["bucket"]) for name, start, end, e in _spans(events)
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
        for name, start, end, e in _spans(events):
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
