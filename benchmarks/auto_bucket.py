"""bucket_cap_mb="auto" against torch DDP's default, in one process group.

Run:  python benchmarks/auto_bucket.py [--steps 40] [--warmup 5] [--batch 32]   (about a minute)

Three wrappers train identical copies of the 6x1024 GELU MLP of
``benchmarks/timeline.py`` (21.1 MiB of fp32 gradients) on the same batches, on
2 gloo ranks: torch's ``DistributedDataParallel`` with its defaults (the
reference), miniddp with its defaults, and miniddp with ``bucket_cap_mb="auto",
gradient_as_bucket_view=True``. The warm-up includes the one-time rebuild, so
"auto" has measured and chosen before the timed steps. Then the three take
turns, step after step, in a rotating order; a step is forward + backward +
optimizer step, its time the slowest rank's. Each wrapper's score is the median
of its per-round ratio to torch's step of the same round (pairing removes most
of a shared machine's noise). Writes ``benchmarks/results/auto_bucket.json``,
with the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from timeline import gelu_mlp  # noqa: E402  (the workload of the cost-model page)

NAMES = ("torch default", "miniddp default", "miniddp auto + bucket view")


def timed_step(ddp, opt, x, y) -> float:
    dist.barrier()  # start together: measure this step, not the previous one's stragglers
    start = time.perf_counter()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return elapsed.item()


def bench(rank, world_size, steps, warmup, batch):
    torch.manual_seed(0)
    model = gelu_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrappers = {NAMES[0]: TorchDDP(copy.deepcopy(model)),
                    NAMES[1]: miniddp.DistributedDataParallel(copy.deepcopy(model)),
                    NAMES[2]: miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto",
                                                              gradient_as_bucket_view=True)}
    runs = {name: (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)) for name, ddp in wrappers.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        order = NAMES[i % 3:] + NAMES[:i % 3]  # rotate who goes first
        for name in order:
            t = timed_step(*runs[name], x, y)
            if i >= warmup:
                times[name].append(t)
    auto = wrappers[NAMES[2]]
    return {"times": times, "auto": auto.auto_bucket_report, "auto_buckets": len(auto.bucket_assignment),
            "default_buckets": len(wrappers[NAMES[1]].bucket_assignment)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    [result, *_] = run_on_ranks(bench, 2, args=(args.steps, args.warmup, args.batch), timeout=1800)
    load_after = os.getloadavg()[0]
    times, reference = result["times"], result["times"][NAMES[0]]
    rows = {}
    for name in NAMES:
        ratios = [a / b for a, b in zip(times[name], reference)]
        rows[name] = {"median_step_ms": 1e3 * statistics.median(times[name]),
                      "median_ratio_to_torch": statistics.median(ratios),
                      "ratio_quartiles": statistics.quantiles(ratios, n=4), "samples_s": times[name]}
    report = {"args": vars(args), "torch": torch.__version__, "load_average_1min": [load_before, load_after],
              "auto": result["auto"], "buckets": {"miniddp default": result["default_buckets"],
                                                  "miniddp auto": result["auto_buckets"]}, "rows": rows}
    auto = result["auto"]
    print(f"2 gloo ranks, torch {torch.__version__}, 6x1024 GELU MLP, batch {args.batch}, {args.steps} rotating steps; "
          f"load average {load_before:.1f} -> {load_after:.1f}")
    print(f"auto chose bucket_cap_mb={auto['bucket_cap_mb']} ({result['auto_buckets']} buckets) in "
          f"{1e3 * auto['measure_s']:.0f} ms: alpha {auto['alpha_us']:.0f} us, {auto['algbw_GBps']:.2f} GB/s, "
          f"overlap_cost {auto['overlap_cost']}\n")
    print("| wrapper | median step (ms) | median ratio to torch default | IQR |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        q = r["ratio_quartiles"]
        print(f"| {name} | {r['median_step_ms']:.1f} | {r['median_ratio_to_torch']:.3f} | {q[0]:.3f}-{q[2]:.3f} |")
    out = HERE / "results" / "auto_bucket.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
