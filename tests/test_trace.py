"""Tracing: events from a real step become a Chrome trace and a timeline picture."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import miniddp
from miniddp.diagnostics.timeline import plot_timeline
from miniddp.diagnostics.trace import Tracer, save_chrome_trace, spans, step_summary, to_chrome_trace
from miniddp.engine.observers import ReducerObserver
from miniddp.launching.spawn import run_on_ranks
from miniddp.testing import backend_params

from models import MODELS


def _traced_step(rank, world_size, backend):
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    tracer = Tracer(rank, device=device)  # on CUDA: device times from CUDA events
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"]().to(device), bucket_cap_mb=0.0002, tracer=tracer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with tracer.span("forward"):
        loss = F.mse_loss(ddp(torch.randn(4, 8, device=device)), torch.zeros(4, 4, device=device))
    loss.backward()
    opt.step()
    tracer.step()
    return tracer.synchronize(), len(ddp.bucket_assignment)


@pytest.mark.parametrize("backend", backend_params(2))
def test_chrome_trace_has_backward_and_one_span_per_bucket(tmp_path, backend):
    results = run_on_ranks(_traced_step, 2, args=(backend,), backend=backend, timeout=60)
    events = [r[0] for r in results]
    trace = to_chrome_trace(events)
    spans = [s for s in trace["traceEvents"] if s["ph"] == "X"]
    for rank, (_, n_buckets) in enumerate(results):
        mine = [s for s in spans if s["pid"] == rank]
        assert len([s for s in mine if s["name"] == "backward"]) == 1
        assert len([s for s in mine if s["name"] == "forward"]) == 1
        assert len([s for s in mine if s["name"].startswith("all-reduce bucket")]) == n_buckets
        assert all(s["dur"] >= 0 for s in mine)
        summary = step_summary(results[rank][0])
        assert 0 <= summary["exposed_comm_s"] <= summary["comm_s"] <= summary["torch_backward_comm_s"] + 1e-9
        launched = min(s["ts"] for s in mine if s["name"].startswith("all-reduce"))
        last_ready = max(e["t"] for e in results[rank][0] if e["name"] == "grad ready") * 1e6
        assert launched < last_ready  # bucket 0 went out while backward was still computing: overlap
    save_chrome_trace(events, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    plot_timeline(events, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_events_include_a_finish_whose_callback_still_runs_when_backward_returns():
    # a future wakes its waiters (the reducer) before it runs its callbacks (the tracer's), on the completing
    # thread: a callback ahead of the tracer's holds it there, as a busy comm thread would
    tracer = Tracer(0)
    fut = torch.futures.Future()
    fut.then(lambda f: time.sleep(0.5))
    tracer.bucket_launched(SimpleNamespace(index=0, nbytes=4, params=[0]), fut)
    threading.Thread(target=fut.set_result, args=(torch.zeros(1),)).start()
    fut.wait()  # what the reducer waits for before backward returns
    assert [e["name"] for e in tracer.events] == ["bucket launched", "bucket finished"]


def test_a_finish_recorded_after_its_backward_ended_is_dated_at_that_end():
    # the reducer waits for every bucket before it ends the backward: a later "finished" is a late callback
    tracer, fut = Tracer(0), torch.futures.Future()
    tracer.event("backward start")
    tracer.bucket_launched(SimpleNamespace(index=0, nbytes=4, params=[0]), fut)
    tracer.event("backward end")
    time.sleep(0.05)
    fut.set_result(torch.zeros(1))  # its callbacks run here, after the end
    t = {e["name"]: e["t"] for e in tracer.events}
    assert t["bucket finished"] == t["backward end"]


def test_a_finish_whose_callback_ran_after_the_next_backward_launched_the_same_bucket_stays_in_its_own_step():
    # the callback waits for the GIL on the comm thread; a small model's next step can launch bucket 0 first
    tracer, first, second = Tracer(0), torch.futures.Future(), torch.futures.Future()
    bucket = SimpleNamespace(index=0, nbytes=4, params=[0])
    tracer.event("backward start")
    tracer.bucket_launched(bucket, first)
    tracer.event("backward end")
    tracer.event("backward start")
    tracer.bucket_launched(bucket, second)
    first.set_result(torch.zeros(1))  # the first step's callback, late
    second.set_result(torch.zeros(1))
    tracer.event("backward end")
    events = tracer.events
    ends = [e["t"] for e in events if e["name"] == "backward end"]
    finishes = sorted(e["t"] for e in events if e["name"] == "bucket finished")
    assert finishes[0] == ends[0]  # dated at its own backward's end, not left in the next step
    assert [len(spans([e for e in events if lo <= e["t"] <= hi and e["name"].startswith("bucket")]))
            for lo, hi in ((0, ends[0]), (ends[0] + 1e-12, ends[1]))] == [1, 1]


def _events(rank, *spec):
    """Events from (name, t, fields) tuples, times in seconds."""
    return [{"name": n, "t": t, "rank": rank, **f} for n, t, f in spec]


def _one_step(rank=0, last_finish=14.0):
    # forward 0-2, backward 2-10 (gradients at 4, 7, 10), buckets 0 and 1 launched at 5 and 10,
    # bucket 1 finishing at last_finish; copy-back until 15 (or just after the last bucket); optimizer 15-16
    end = max(15.0, last_finish + 1)
    b0, b1 = {"bucket": 0, "bytes": 8, "params": 2}, {"bucket": 1, "bytes": 8, "params": 2}
    return _events(rank, ("forward start", 0.0, {}), ("forward end", 1.5, {}), ("backward start", 2.0, {}),
                   ("grad ready", 4.0, {"param": "b"}), ("grad ready", 4.5, {"param": "w"}),
                   ("bucket launched", 5.0, b0), ("grad ready", 7.0, {"param": "v"}), ("bucket finished", 8.0, b0),
                   ("grad ready", 10.0, {"param": "u"}), ("bucket launched", 10.0, b1),
                   ("bucket finished", last_finish, b1),
                   ("backward end", end, {}), ("optimizer start", end, {}), ("optimizer end", end + 1, {}))


def test_step_summary_separates_hidden_from_exposed_communication():
    s = step_summary(_one_step())
    assert s["forward_s"] == 2 and s["backward_compute_s"] == 8  # until the last gradient
    assert s["comm_s"] == 3 + 4 and s["hidden_comm_s"] == 3 and s["exposed_comm_s"] == 4
    assert s["finalize_s"] == 5 and s["optimizer_s"] == 1 and s["step_s"] == 16
    # torch's logging figures for the same step: comm from the first launch to the end of the finalize,
    # overlap from the first launch to the end of backward's compute
    assert s["torch_backward_comm_s"] == 10 and s["torch_overlap_s"] == 5


def test_step_summary_counts_overlapping_bucket_intervals_once():
    # gloo queues a bucket launched while the previous one still runs: the intervals overlap
    events = _one_step()
    next(e for e in events if e["name"] == "bucket finished" and e["bucket"] == 0)["t"] = 11.0  # after 1 launched
    s = step_summary(events)
    assert s["comm_s"] == 14 - 5 and s["exposed_comm_s"] == 4


def test_no_exposed_communication_when_the_last_bucket_ends_before_backward():
    events = [e for e in _one_step() if not (e.get("bucket") == 1)]
    assert step_summary(events)["exposed_comm_s"] == 0


def test_plot_timeline_draws_svg_with_exposed_communication_and_returns_the_summaries(tmp_path):
    path = tmp_path / "timeline.svg"
    summaries = plot_timeline([_one_step(0), _one_step(1, last_finish=12.0)], path, title="two ranks")
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert [s["exposed_comm_s"] for s in summaries] == [4, 2]
    for text in ("exposed communication", "rank 0 4000.0 ms", "rank 1 2000.0 ms", "bucket 1", "optimizer"):
        assert text in svg, text  # matplotlib's SVG names each text in a comment beside its glyphs


def test_chrome_trace_has_forward_and_optimizer_spans():
    spans = [s for s in to_chrome_trace([_one_step()])["traceEvents"] if s["ph"] == "X"]
    names = [s["name"] for s in spans]
    assert sorted(names) == ["all-reduce bucket 0", "all-reduce bucket 1", "backward", "forward", "optimizer"]
    assert next(s for s in spans if s["name"] == "forward")["dur"] == 1.5e6


class _Recorder(ReducerObserver):
    """Any observer gets the reducer's named events; this one writes down their names."""

    def __init__(self):
        self.seen = []

    def backward_started(self):
        self.seen.append("backward started")

    def grad_ready(self, index, name):
        self.seen.append(f"ready {name}")

    def bucket_launched(self, bucket, future):
        self.seen.append(f"bucket {bucket.index}")

    def backward_ended(self):
        self.seen.append("backward ended")


def _observed(rank, world_size):
    torch.manual_seed(0)
    recorder = _Recorder()
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"](), bucket_cap_mb=0.0001, tracer=recorder)
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    buckets = len(ddp.bucket_assignment)  # the next forward rebuilds them
    with ddp.no_sync():  # a local backward: nothing to observe
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    return recorder.seen, [n for n, _ in ddp.module.named_parameters()], buckets


def test_an_observer_sees_one_synced_backward_as_named_events_in_order():
    for seen, names, buckets in run_on_ranks(_observed, 2, timeout=60):
        assert seen[0] == "backward started" and seen[-1] == "backward ended" and seen.count("backward ended") == 1
        assert sorted(e[6:] for e in seen if e.startswith("ready ")) == sorted(names)  # each gradient, once
        assert [e for e in seen if e.startswith("bucket ")] == [f"bucket {b}" for b in range(buckets)]
        first_launch = seen.index("bucket 0")
        assert 1 < first_launch < len(seen) - 2  # bucket 0 went out while gradients were still arriving
