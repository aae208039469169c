"""Tracing: see communication overlap backward, instead of taking it on faith.

What
    A ``Tracer`` records per-rank events with a monotonic clock: backward start,
    each gradient ready, each bucket launched and finished, backward end,
    optimizer step. ``to_chrome_trace`` turns the events of all ranks into the
    JSON that ``chrome://tracing`` and Perfetto open; ``plot_timeline`` draws
    the same as a PNG (one row of compute and one of communication per rank).

Why
    "Overlap" is a claim about time. A timeline shows it: bucket 0's all-reduce
    bar starting while the backward bar is still running is the whole point of
    bucketing (the DDP paper's Fig. 7; the Ultra-Scale Playbook's DP chapter
    draws the same picture).

How torch differs
    ``torch.profiler`` records the same story at kernel level (look for
    ``nccl:all_reduce`` / ``gloo:all_reduce`` rows overlapping
    ``autograd::engine`` rows), with far more detail and far more noise. This one
    records only DDP's own events, so the timeline fits on a page. A bucket's
    finish time comes from its work's future callback, which fires when the
    collective completes (on gloo's worker thread).
"""

from __future__ import annotations

import json
import threading
import time


class Tracer:
    """Collects one rank's events; ``events`` is a list of dicts (picklable)."""

    def __init__(self, rank: int = 0):
        self.rank = rank  # the rank these events belong to (a row group in the trace)
        self.events: list[dict] = []  # {"name", "t" (seconds), "kind", ...}
        self.origin = 0.0  # perf_counter is system-wide on Linux: ranks share one clock
        self.lock = threading.Lock()  # bucket-finished callbacks arrive on a comm thread

    def _now(self) -> float:
        return time.perf_counter() - self.origin

    def event(self, name: str, **fields) -> None:
        with self.lock:
            self.events.append({"name": name, "t": self._now(), "rank": self.rank, **fields})

    def bucket_launched(self, bucket) -> None:
        info = {"bucket": bucket.index, "bytes": bucket.nbytes, "params": len(bucket.params)}
        self.event("bucket launched", **info)

        def finished(fut):
            self.event("bucket finished", **info)
            return fut.value()  # hand the result on unchanged

        bucket.work.get_future().then(finished)

    def step(self) -> None:
        """Call after ``optimizer.step()``."""
        self.event("optimizer step")

    def clear(self) -> None:
        with self.lock:
            self.events = []


# --8<-- [start:chrome]
def to_chrome_trace(events_per_rank: list[list[dict]]) -> dict:
    """Chrome trace JSON: one process per rank; backward and each bucket's all-reduce as spans."""
    spans = []
    for events in events_per_rank:
        open_backward, launched = None, {}
        for e in sorted(events, key=lambda e: e["t"]):
            us, pid = e["t"] * 1e6, e["rank"]
            if e["name"] == "backward start":
                open_backward = us
            elif e["name"] == "backward end" and open_backward is not None:
                spans.append(dict(name="backward", ph="X", ts=open_backward, dur=us - open_backward, pid=pid, tid=0))
                open_backward = None
            elif e["name"] == "bucket launched":
                launched[e["bucket"]] = us
            elif e["name"] == "bucket finished" and e["bucket"] in launched:
                start = launched.pop(e["bucket"])
                spans.append(dict(name=f"all-reduce bucket {e['bucket']}", ph="X", ts=start, dur=us - start,
                                  pid=pid, tid=1, args={"bytes": e["bytes"], "params": e["params"]}))
            else:  # grad ready, optimizer step: instants
                spans.append(dict(name=e["name"] + (f" {e['param']}" if "param" in e else ""), ph="i", s="t",
                                  ts=us, pid=pid, tid=0))
        spans.append(dict(name="thread_name", ph="M", pid=events[0]["rank"] if events else 0, tid=1,
                          args={"name": "communication"}))
    return {"traceEvents": spans, "displayTimeUnit": "ms"}
# --8<-- [end:chrome]


def save_chrome_trace(events_per_rank, path) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events_per_rank), f)


def plot_timeline(events_per_rank, path, title: str = "DDP step: backward and bucket all-reduces") -> None:
    """Draw the spans of ``to_chrome_trace`` with matplotlib (an optional dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [s for s in to_chrome_trace(events_per_rank)["traceEvents"] if s["ph"] == "X"]
    t0 = min(s["ts"] for s in spans)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.9 * len(events_per_rank)))
    for s in spans:
        y = s["pid"] * 2 + s["tid"]
        color = "tab:blue" if s["tid"] == 0 else f"C{1 + int(s['name'].split()[-1]) % 8}"
        ax.barh(y, s["dur"] / 1e3, left=(s["ts"] - t0) / 1e3, color=color, edgecolor="black", height=0.8)
        if s["tid"] == 1:
            ax.text((s["ts"] - t0) / 1e3, y, s["name"].split()[-1], va="center", fontsize=7)
    ranks = range(len(events_per_rank))
    ax.set_yticks([r * 2 + t for r in ranks for t in (0, 1)],
                  [f"rank {r} {'backward' if t == 0 else 'all-reduce'}" for r in ranks for t in (0, 1)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first span")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
