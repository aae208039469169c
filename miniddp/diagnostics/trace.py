"""Tracing: see communication overlap backward, instead of taking it on faith.

What
    A ``Tracer`` records per-rank events with a clock the ranks share: backward start, each
    gradient ready, each bucket launched and finished, backward end (it observes the reducer,
    ``engine.observers``, which knows nothing of it), and the spans you wrap in
    ``tracer.span("forward")``. ``to_chrome_trace`` makes the JSON that Perfetto opens;
    ``step_summary`` measures one step, how much communication ran *after* the backward's
    compute (the exposed part); ``timeline.plot_timeline`` draws it.

Why
    "Overlap" is a claim about time. What is not hidden behind the backward is what another
    ``bucket_cap_mb`` can win back (``miniddp.costmodel.simulate`` predicts it).

How torch differs
    ``torch.profiler`` records the same story kernel by kernel. torch's DDP keeps timestamps per
    sampled iteration (``_get_ddp_logging_data()``: ``backward_comm_time``,
    ``backward_compute_comm_overlap_time``); ``step_summary`` computes the same two. A bucket's
    finish comes from its future's callback, which fires when gloo's collective completes; on
    CUDA it fires at *enqueue*, so ``Tracer(device="cuda")`` records CUDA events on the stream
    that waits for NCCL and ``synchronize()`` turns them into times.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import torch

from ..engine.observers import ReducerObserver


class Tracer(ReducerObserver):
    """Collects one rank's events; ``events`` is a list of dicts (picklable). Pass it to
    ``DistributedDataParallel(tracer=...)``: it observes the reducer's events (``engine.observers``)."""

    def __init__(self, rank: int = 0, device=None):
        self.rank = rank  # the rank these events belong to (a row group in the trace)
        self._events: list[dict] = []  # {"name", "t" (seconds), "rank", ...}; read through .events
        self._finishing: list = []  # futures of the bucket-finished callbacks, still running on a comm thread
        self.origin = 0.0  # perf_counter is system-wide on Linux: ranks share one clock
        self.lock = threading.Lock()  # bucket-finished callbacks arrive on a comm thread
        self.cuda = device is not None and torch.device(device).type == "cuda"  # time with CUDA events
        self._pending: list = []  # CUDA: (event dict, torch.cuda.Event) until synchronize()
        self._cuda_origin = None  # CUDA: (host time, event recorded after a device sync)
        self._launches = 0  # a serial per launch: a late finish pairs with its own launch, not a later one's

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

    # the reducer's events (engine.observers.ReducerObserver)
    def backward_started(self) -> None:
        self.event("backward start")

    def grad_ready(self, index: int, name: str) -> None:
        self.event("grad ready", param=name)

    def bucket_launched(self, bucket, future) -> None:
        info = {"bucket": bucket.index, "bytes": bucket.nbytes, "params": len(bucket.params), "launch": self._launches}
        self._launches += 1
        self.event("bucket launched", **info)

        def finished(fut):
            self.event("bucket finished", **info)
            return fut.value()  # hand the result on unchanged

        self._finishing.append(future.then(finished))

    def backward_ended(self) -> None:
        self.event("backward end")

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
            self._launches = 0


def _date_late_finishes(events: list[dict]) -> None:
    """In recording order: a "bucket finished" that came after the "backward end" of the backward that
    launched it gets that end's time (its callback ran late; the collective had completed by then). A callback
    can wait for the GIL past the next step's launch of the same bucket: launches pair by serial, not index."""
    launched, ended = set(), {}  # launches of the current backward; launch -> its backward's end
    for e in events:
        if e["name"] == "backward start":
            launched = set()
        elif e["name"] == "bucket launched":
            launched.add(_launch(e))
        elif e["name"] == "backward end":
            ended.update((b, e["t"]) for b in launched)
        elif e["name"] == "bucket finished" and _launch(e) in ended:
            e["t"] = min(e["t"], ended.pop(_launch(e)))


def _launch(e: dict):
    """Which launch an event of a bucket belongs to (hand-built events without a serial: the bucket's index)."""
    return e.get("launch", ("bucket", e["bucket"]))


def spans(events: list[dict]) -> list[tuple[str, float, float, dict]]:
    """(name, start, end, fields) for backward, every ``span``, and each bucket's all-reduce."""
    spans, open_ = [], {}
    for e in sorted(events, key=lambda e: e["t"]):
        name = e["name"]
        if name == "bucket launched":
            open_[_launch(e)] = e["t"]
        elif name == "bucket finished" and _launch(e) in open_:
            spans.append((f"all-reduce bucket {e['bucket']}", open_.pop(_launch(e)), e["t"], e))
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
        for name, start, end, e in spans(events):
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
    buckets = [(s, t) for n, s, t, _ in spans(events) if n.startswith("all-reduce")]
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
