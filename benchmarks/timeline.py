"""One DDP step of the 6x1024 GELU MLP on 2 ranks: what overlaps, what is exposed, and what torch logs.

Run:  python benchmarks/timeline.py [--bucket-cap-mb 4] [--steps 20] [--device cpu|cuda]

Per rank, ``miniddp.DistributedDataParallel`` with a ``Tracer`` and torch's
``DistributedDataParallel`` on a copy of the same model, in one process group, on
the same batches; steps alternate between the two (after a warm-up that includes
the one-time bucket rebuild). For miniddp each step's events give the exposed
communication (``miniddp.diagnostics.trace.step_summary``); for torch, its own logging data
(``_get_ddp_logging_data()``, with the runtime-stats sampling rate set to every
iteration) gives ``backward_comm_time`` and ``backward_compute_comm_overlap_time``
for the same steps. The step drawn is miniddp's median one.

Writes ``docs/img/timeline.svg`` (and the same picture as ``docs/img/ddp-timeline.png``),
``benchmarks/results/ddp-trace.json`` (open it in chrome://tracing or
ui.perfetto.dev) and ``benchmarks/results/timeline.json`` (every step's figures).
On CUDA (``--device cuda``, NCCL, one GPU per rank) the tracer records CUDA events:
NCCL's futures complete when the all-reduce is *enqueued*, not when it ends.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.diagnostics.timeline import plot_timeline
from miniddp.diagnostics.trace import Tracer, save_chrome_trace, step_summary
from miniddp.launching.spawn import run_on_ranks

HERE = Path(__file__).parent


def gelu_mlp(hidden: int = 1024, layers: int = 6, inputs: int = 256, classes: int = 10) -> torch.nn.Module:
    """``layers`` hidden layers of width ``hidden`` with GELU: 5.5 M parameters (22 MB of fp32
    gradients) with the defaults: the workload of the timeline and the cost-model measurements."""
    blocks = [torch.nn.Linear(inputs, hidden), torch.nn.GELU()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes))


def traced_step(ddp, opt, x, y, tracer) -> list[dict]:
    """One training step, traced: forward (and loss), backward, optimizer; returns its events."""
    tracer.clear()
    dist.barrier()  # start together: the timeline compares like with like
    with tracer.span("forward"):
        loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    with tracer.span("optimizer"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return [dict(e) for e in tracer.synchronize()]


def torch_step(ddp, opt, x, y, device) -> dict:
    """One step of torch's DDP; returns the logging data of the *previous* step (torch records an
    iteration's timers at the next forward)."""
    dist.barrier()
    start = time.perf_counter()
    loss = F.cross_entropy(ddp(x), y)
    data = ddp._get_ddp_logging_data()  # a dict copy: outside what torch's timers measure
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)
    keys = ("iteration", "forward_compute_time", "backward_compute_time", "backward_comm_time",
            "backward_compute_comm_overlap_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")
    return {"step_s": took, **{k: data.get(k) for k in keys}}


def compare(rank, world_size, cap, steps, warmup, batch, device):
    device = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = gelu_mlp().to(device)
    tracer = Tracer(rank, device=device)
    ours = miniddp.DistributedDataParallel(model, bucket_cap_mb=cap, tracer=tracer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = TorchDDP(copy.deepcopy(model), bucket_cap_mb=cap)
    theirs._set_ddp_runtime_logging_sample_rate(1)  # default: iterations 1-10 and every 100th
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g).to(device), torch.randint(0, 10, (batch,), generator=g).to(device)
    mini, logged = [], []
    for i in range(warmup + steps + 1):  # +1: torch's last step is logged at one more forward
        order = ["miniddp", "torch"] if i % 2 == 0 else ["torch", "miniddp"]
        for name in order:
            if name == "miniddp" and i < warmup + steps:
                events = traced_step(ours, opts[0], x, y, tracer)
                if i >= warmup:
                    mini.append(events)
            elif name == "torch":
                data = torch_step(theirs, opts[1], x, y, device)
                if data["iteration"] is not None and data["iteration"] > warmup:
                    logged.append(data)
    return {"events": mini, "torch": logged, "buckets": len(ours.bucket_assignment),
            "torch_buckets": len(theirs._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-cap-mb", type=float, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    load_before = os.getloadavg()[0]  # other work on the machine: the numbers are only as quiet as it was
    results = run_on_ranks(compare, 2, args=(args.bucket_cap_mb, args.steps, args.warmup, args.batch, args.device),
                           backend=backend, timeout=600)
    summaries = [[step_summary(ev) for ev in r["events"]] for r in results]  # [rank][step]
    step_s = [max(s[i]["step_s"] for s in summaries) for i in range(args.steps)]
    median_step = sorted(range(args.steps), key=lambda i: step_s[i])[args.steps // 2]
    events = [r["events"][median_step] for r in results]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731  (ms)
    for steps in summaries:
        for s in steps:  # torch's definition, from our events: first launch -> end of the finalize, minus overlap
            s["torch_style_exposed_s"] = s["torch_backward_comm_s"] - s["torch_overlap_s"]
    ours = {k: [med([s[k] for s in steps]) for steps in summaries]
            for k in ("step_s", "exposed_comm_s", "comm_s", "finalize_s", "torch_backward_comm_s", "torch_overlap_s",
                      "torch_style_exposed_s")}
    for r in results:
        for d in r["torch"]:
            d["exposed"] = d["backward_comm_time"] - d["backward_compute_comm_overlap_time"]
    logged = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
              "backward_compute_comm_overlap_time", "exposed")  # ns
    theirs = [{"step_s": med([d["step_s"] for d in r["torch"]]), **{k: med([d[k] / 1e9 for d in r["torch"]])
               for k in logged}} for r in results]
    averages = ("avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")  # torch's own, ns
    torch_avg = [{k: r["torch"][-1][k] / 1e6 for k in averages} for r in results]

    title = (f"one step of the 6x1024 GELU MLP, 2 {backend} ranks, bucket_cap_mb={args.bucket_cap_mb:g} "
             f"({results[0]['buckets']} buckets), median of {args.steps}")
    for path in (HERE.parent / "docs" / "img" / "timeline.svg", HERE.parent / "docs" / "img" / "ddp-timeline.png"):
        plot_timeline(events, path, title=title)
    save_chrome_trace(events, HERE / "results" / "ddp-trace.json")
    report = {"args": vars(args), "torch": torch.__version__, "load_average_1min": [load_before, os.getloadavg()[0]],
              "buckets": results[0]["buckets"],
              "torch_buckets": results[0]["torch_buckets"], "median_step_index": median_step,
              "miniddp_ms_median_per_rank": ours, "torch_logging_ms_median_per_rank": theirs,
              "torch_logging_avg_ms_per_rank": torch_avg, "events_drawn": events, "miniddp_steps": summaries,
              "torch_steps": [r["torch"] for r in results]}
    (HERE / "results" / "timeline.json").write_text(json.dumps(report, indent=2) + "\n")

    print(f"{title}; miniddp {results[0]['buckets']} buckets, torch {results[0]['torch_buckets']}; "
          f"load average (1 min) before and after: {report['load_average_1min']}\n")
    print("| rank | miniddp step | exposed (after last gradient) | torch-style comm | torch-style overlap | "
          "torch-style exposed | torch DDP step | logged comm | logged overlap | logged exposed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in range(2):
        o, t = {k: v[r] for k, v in ours.items()}, theirs[r]
        print(f"| {r} | {o['step_s']:.1f} | {o['exposed_comm_s']:.1f} | {o['torch_backward_comm_s']:.1f} | "
              f"{o['torch_overlap_s']:.1f} | {o['torch_style_exposed_s']:.1f} | {t['step_s']:.1f} | "
              f"{t['backward_comm_time']:.1f} | {t['backward_compute_comm_overlap_time']:.1f} | {t['exposed']:.1f} |")
    print("(ms, medians over steps; torch's own running averages:", torch_avg, ")")
    print(f"\nwrote docs/img/timeline.svg, docs/img/ddp-timeline.png, {HERE / 'results' / 'ddp-trace.json'}, "
          f"{HERE / 'results' / 'timeline.json'}")


if __name__ == "__main__":
    main()
