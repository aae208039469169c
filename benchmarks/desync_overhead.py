"""What MINIDDP_DEBUG=collectives costs per collective, measured side by side with it off.

Run:  python benchmarks/desync_overhead.py [--world-size 2] [--rounds 15] [--ops 100]

On 2 gloo ranks of this machine, three process groups span the same ranks:
``checked`` (the default group, made by ``miniddp.init_distributed()`` with
``MINIDDP_DEBUG=collectives``), ``plain`` gloo (``dist.new_group(backend="gloo")``)
and ``torch_detail``: gloo wrapped in torch's ``ProcessGroupWrapper``, as
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does (the debug level is DETAIL only while that
group is created). Each round times the same work on all three, in rotating order,
so machine noise hits them alike: ``--ops`` all-reduces of 1 float, of 1 MiB, and
``--ops / 10`` miniddp DDP training steps of a small MLP (forward, backward, SGD
step). A time is the slowest rank's; the result is the median over rounds of the
per-operation time, and of the per-round difference from plain. Writes
``benchmarks/results/desync_overhead.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import miniddp
from miniddp.launching.spawn import run_on_ranks


def timed(work, count: int, group) -> float:
    """Seconds per call of ``work``, for the slowest rank."""
    dist.barrier(group=group)  # start together
    start = time.perf_counter()
    for _ in range(count):
        work()
    elapsed = torch.tensor([(time.perf_counter() - start) / count], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def bench(rank, world_size, rounds, ops):
    os.environ["MINIDDP_DEBUG"] = "collectives"
    miniddp.init_distributed(backend="gloo", timeout=300)
    groups = {"checked": dist.group.WORLD, "plain": dist.new_group(backend="gloo")}  # same ranks, same transport
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # what TORCH_DISTRIBUTED_DEBUG=DETAIL does at group creation
    groups["torch_detail"] = dist.new_group(backend="gloo")
    dist.set_debug_level(dist.DebugLevel.OFF)
    assert type(groups["plain"]) is dist.ProcessGroup and type(groups["checked"]).__name__ == "CheckedGroup"
    assert "Wrapper" in type(groups["torch_detail"]._get_backend(torch.device("cpu"))).__name__
    small, mib = torch.ones(1), torch.ones(2**20 // 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddps = {name: miniddp.DistributedDataParallel(copy.deepcopy(model), process_group=g, bucket_cap_mb=0.1)
            for name, g in groups.items()}  # one replica per group, ~100 KB buckets
    opts = {name: torch.optim.SGD(ddp.parameters(), lr=1e-3) for name, ddp in ddps.items()}
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step(name):
        torch.nn.functional.cross_entropy(ddps[name](x), y).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    cases = {  # name -> (work on a group, calls per timing)
        "all_reduce of 1 float": (lambda name: dist.all_reduce(small, group=groups[name]), ops),
        "all_reduce of 1 MiB": (lambda name: dist.all_reduce(mib, group=groups[name]), ops),
        "miniddp DDP training step": (step, max(1, ops // 10)),
    }
    times = {case: {name: [] for name in groups} for case in cases}
    for r in range(rounds + 1):  # round 0 warms up
        for case, (work, count) in cases.items():
            names = list(groups)
            for name in names[r % 3:] + names[:r % 3]:  # rotate who goes first
                t = timed(lambda: work(name), count, groups["plain"])
                if r:
                    times[case][name].append(t)
    return {"times": times, "buckets_per_step": len(ddps["plain"].bucket_assignment)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=100)
    args = parser.parse_args()
    [result, *_] = run_on_ranks(bench, args.world_size, args=(args.rounds, args.ops), init=False, timeout=1800)
    rows = []
    for case, t in result["times"].items():
        row = {"case": case}
        for name in ("plain", "checked", "torch_detail"):
            row[f"{name}_us"] = 1e6 * statistics.median(t[name])
            if name != "plain":
                diffs = [a - b for a, b in zip(t[name], t["plain"])]
                row[f"{name}_overhead_us"] = 1e6 * statistics.median(diffs)
                row[f"{name}_overhead_quartiles_us"] = [1e6 * q for q in statistics.quantiles(diffs, n=4)]
        rows.append(row | {"samples_s": t})
    print(f"{args.world_size} gloo ranks, torch {torch.__version__}, {args.rounds} interleaved rounds; "
          f"a DDP step issues {result['buckets_per_step']} bucket all-reduces\n")
    print("| per operation | plain gloo | MINIDDP_DEBUG=collectives | overhead | TORCH_DISTRIBUTED_DEBUG=DETAIL "
          "| overhead |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['plain_us']:.0f} us | {r['checked_us']:.0f} us | +{r['checked_overhead_us']:.0f} us "
              f"| {r['torch_detail_us']:.0f} us | +{r['torch_detail_overhead_us']:.0f} us |")
    out = Path(__file__).parent / "results" / "desync_overhead.json"
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                               "buckets_per_step": result["buckets_per_step"], "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
