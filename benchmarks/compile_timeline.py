"""What torch.compile does to overlap, and what splitting the graph at the buckets gives back: one DDP step.

Run:  python benchmarks/compile_timeline.py [--bucket-cap-mb 5]   (about 30 s; CPU, aot_eager)

2 gloo ranks, the 6x1024 GELU MLP of ``benchmarks/timeline.py``, ``miniddp.DistributedDataParallel``
with a ``Tracer``: once around the eager model, once around ``torch.compile(model,
backend="aot_eager")``. Eager, each gradient is ready as the backward reaches its layer, and a
bucket's all-reduce starts while earlier layers still compute. Compiled, the backward is one
graph: no gradient is ready before it has run, then all of them within the copies into the
buckets, which are all the all-reduces can overlap. Third, ``torch.compile(ddp,
backend=miniddp.DDPOptimizer(ddp))``: the graph split where the buckets change, one backward node
per piece, so a bucket goes out while the next piece computes. Each one's median step is drawn
(``docs/img/compile-timeline-{eager,compiled,split}.svg``); ``benchmarks/results/compile-timeline.json``
holds the events and the summaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import miniddp
from miniddp.diagnostics.timeline import plot_timeline
from miniddp.diagnostics.trace import Tracer, step_summary
from miniddp.launching.spawn import run_on_ranks

HERE = Path(__file__).resolve().parent
MODES = ("eager", "compiled", "split")
sys.path.insert(0, str(HERE))
from timeline import gelu_mlp, traced_step  # noqa: E402


def steps(rank, world_size, cap, n, warmup):
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = gelu_mlp()
        tracer = Tracer(rank)
        inner = torch.compile(model, backend="aot_eager") if mode == "compiled" else model
        ddp = miniddp.DistributedDataParallel(inner, bucket_cap_mb=cap, tracer=tracer)
        run = torch.compile(ddp, backend=miniddp.DDPOptimizer(ddp)) if mode == "split" else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        out[mode] = [traced_step(run, opt, x, y, tracer) for _ in range(warmup + n)][warmup:]
    dist.barrier()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-cap-mb", type=float, default=5)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    ranks = run_on_ranks(steps, 2, args=(args.bucket_cap_mb, args.steps, args.warmup), timeout=600)
    report = {"args": vars(args), "torch": torch.__version__}
    for mode in MODES:
        per_step = [[r[mode][i] for r in ranks] for i in range(args.steps)]
        totals = [max(step_summary(ev)["step_s"] for ev in step) for step in per_step]
        drawn = per_step[sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]]
        path = HERE.parent / "docs" / "img" / f"compile-timeline-{mode}.svg"
        what = {"eager": "eager model", "compiled": "compiled model", "split": "compiled, split at the buckets"}[mode]
        title = f"one DDP step, {what}, bucket_cap_mb={args.bucket_cap_mb:g}"
        summaries = plot_timeline(drawn, path, title=title)
        report[mode] = {"median_step_ms": 1e3 * statistics.median(totals), "summaries": summaries, "drawn": drawn}
        print(f"{mode}: median step {report[mode]['median_step_ms']:.1f} ms, exposed "
              + ", ".join(f"rank {r} {1e3 * s['exposed_comm_s']:.1f} ms" for r, s in enumerate(summaries)))
    (HERE / "results" / "compile-timeline.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
