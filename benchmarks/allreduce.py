"""Ring all-reduce vs dist.all_reduce vs naive per-parameter averaging, on this machine.

    python benchmarks/allreduce.py                  # 2 gloo ranks, ~20 s
    python benchmarks/allreduce.py --world-size 4 --reps 5

For each total size S (float32), every rank times, with the same input:

* ``dist.all_reduce``   one call on one flat tensor of S bytes (what a bucket gets)
* ``ring_all_reduce``   miniddp's ring, written with isend/irecv, on the same tensor
* ``naive_all_reduce``  all-gather every rank's tensor, then sum (the textbook reference)
* ``per-parameter``     ``average_gradients`` over ``--params`` tensors totalling S bytes:
                        one all-reduce each (the naive DDP baseline)

Repetitions are interleaved (each round runs every method once, in a rotating
order, after a barrier) so that a slow moment of the machine hits all methods
alike; a round's time is the slowest rank's, and we report the median over rounds.
Bus bandwidth is algbw x 2(n-1)/n, as nccl-tests reports it (doc/PERFORMANCE.md).
Writes ``benchmarks/results/allreduce.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miniddp.by_hand.averaging import average_gradients, naive_all_reduce, ring_all_reduce
from miniddp.launching.spawn import run_on_ranks

METHODS = ["dist.all_reduce", "ring_all_reduce", "naive_all_reduce", "per-parameter"]
OUT = Path(__file__).resolve().parent / "results" / "allreduce.json"


def _params(total: int, count: int) -> list[torch.nn.Parameter]:
    """``count`` parameters with gradients, ``total`` float32 elements in all."""
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    params = [torch.nn.Parameter(torch.zeros(max(s, 1))) for s in sizes]
    for p in params:
        p.grad = torch.ones_like(p)
    return params


def _bench(rank, world_size, sizes, reps, n_params):
    """On each rank: time every method at every size; return per-round times in seconds."""
    times = {}  # (numel, method) -> list of this rank's per-round seconds
    for numel in sizes:
        flat = torch.ones(numel)
        params = _params(numel, n_params)
        run = {
            "dist.all_reduce": lambda: dist.all_reduce(flat),
            "ring_all_reduce": lambda: ring_all_reduce(flat),
            "naive_all_reduce": lambda: naive_all_reduce(flat),
            "per-parameter": lambda: average_gradients(params),
        }
        for method in METHODS:  # warm-up: first-call allocations and connections
            run[method]()
        for rep in range(reps):
            order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]  # rotate
            for method in order:
                dist.barrier()
                start = time.perf_counter()
                run[method]()
                times.setdefault((numel, method), []).append(time.perf_counter() - start)
                flat.fill_(1.0)  # keep the values bounded across repetitions
    # the slowest rank decides each round
    keys = sorted(times)
    mine = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return [(k[0], k[1], mine[i].tolist()) for i, k in enumerate(keys)] if rank == 0 else None


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**10, 2**14, 2**18, 2**20, 2**22],
                        help="float32 elements per rank")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--params", type=int, default=64, help="tensors in the per-parameter case")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.sizes = sorted(set(args.sizes))

    started = time.perf_counter()
    rows = run_on_ranks(_bench, args.world_size, args=(args.sizes, args.reps, args.params),
                        backend="gloo", timeout=600)[0]
    n = args.world_size
    results = []
    for numel, method, per_round in rows:
        median = statistics.median(per_round)
        size = numel * 4
        results.append({
            "numel": numel, "bytes": size, "method": method, "median_s": median,
            "rounds": len(per_round), "min_s": min(per_round),
            "rounds_s": [round(t, 7) for t in per_round],  # every round, slowest rank, in run order
            "algbw_GBps": size / median / 1e9, "busbw_GBps": size / median / 1e9 * 2 * (n - 1) / n,
        })
    report = {
        "benchmark": "allreduce", "world_size": n, "backend": "gloo", "dtype": "float32",
        "per_parameter_tensors": args.params, "reps": args.reps,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "machine": platform.machine(), "date": datetime.date.today().isoformat(),
        "wall_s": round(time.perf_counter() - started, 1), "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report))
    print(f"\n{n} gloo ranks, median of {args.reps} interleaved rounds, {report['wall_s']} s; wrote {args.out}")


def markdown_table(report) -> str:
    by = {(r["numel"], r["method"]): r for r in report["results"]}
    sizes = sorted({r["numel"] for r in report["results"]})
    head = ["size per rank"] + [f"{m} (ms)" for m in METHODS] + ["dist.all_reduce busbw (GB/s)", "ring busbw (GB/s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for numel in sizes:
        cells = [human_bytes(numel * 4)] + [f"{by[numel, m]['median_s'] * 1e3:.3f}" for m in METHODS]
        cells += [f"{by[numel, m]['busbw_GBps']:.3f}" for m in ("dist.all_reduce", "ring_all_reduce")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
