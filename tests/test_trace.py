"""Tracing: events from a real step become a Chrome trace and a timeline picture."""

import json

import torch
import torch.nn.functional as F

import miniddp
from miniddp.testing import run_on_ranks
from miniddp.trace import Tracer, plot_timeline, save_chrome_trace, to_chrome_trace
from models import MODELS


def _traced_step(rank, world_size):
    torch.manual_seed(0)
    tracer = Tracer(rank)
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"](), bucket_cap_mb=0.0002, tracer=tracer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    opt.step()
    tracer.step()
    return tracer.events, len(ddp.bucket_assignment)


def test_chrome_trace_has_backward_and_one_span_per_bucket(tmp_path):
    results = run_on_ranks(_traced_step, 2, timeout=60)
    events = [r[0] for r in results]
    trace = to_chrome_trace(events)
    spans = [s for s in trace["traceEvents"] if s["ph"] == "X"]
    for rank, (_, n_buckets) in enumerate(results):
        mine = [s for s in spans if s["pid"] == rank]
        assert len([s for s in mine if s["name"] == "backward"]) == 1
        assert len([s for s in mine if s["name"].startswith("all-reduce bucket")]) == n_buckets
        assert all(s["dur"] >= 0 for s in mine)
    save_chrome_trace(events, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    plot_timeline(events, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
