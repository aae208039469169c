"""miniddp's DistributedDataParallel against torch's C++ reducer, in one process group.

Run:  python benchmarks/ddp_vs_torch.py [--world-size 2] [--steps 30] [--hidden 1024] [--baseline DIR]

Both wrappers train identical copies of the same MLP (the 6x1024 GELU MLP of
the other benchmarks, 22 MB of fp32 gradients, with the defaults) on the same batches, on 2 gloo ranks of this
machine. After a warm-up, steps alternate A/B/A/B (so machine noise hits both
alike); a step is forward + backward + optimizer step, its time is the max over
ranks (the slowest rank sets the pace), and the result is the median of the
per-pair ratios miniddp / torch, with and without gradient accumulation
(``no_sync`` on all micro-batches but the last). ``--baseline DIR`` adds a third
wrapper, the miniddp of another checkout (``git worktree add DIR <commit>``), in the
same interleaving: a change to miniddp is measured against the code before it, in one
run. Writes ``benchmarks/results/ddp_vs_torch.json``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from timeline import gelu_mlp  # noqa: E402  (one definition of the workload)


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    """The 6x1024 GELU MLP of the other benchmarks with the defaults (22 MB of fp32 gradients)."""
    return gelu_mlp(hidden=hidden, layers=layers)


def timed_step(ddp, opt, batches, accumulation) -> float:
    dist.barrier()  # start together: measure the step, not the previous one's stragglers
    start = time.perf_counter()
    for micro, (x, y) in enumerate(batches[:accumulation]):
        with nullcontext() if micro == accumulation - 1 else ddp.no_sync():
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time is the step's time
    return elapsed.item()


def load_baseline(checkout: str):
    """The ``miniddp`` package of another checkout, imported as ``miniddp_baseline`` beside this one."""
    root = Path(checkout) / "miniddp"
    spec = importlib.util.spec_from_file_location("miniddp_baseline", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["miniddp_baseline"] = module
    spec.loader.exec_module(module)
    return module


def bench(rank, world_size, hidden, layers, steps, warmup, batch, accumulation, bucket_cap_mb, baseline=None):
    torch.manual_seed(0)
    model = make_model(hidden, layers)
    ours = miniddp.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = TorchDDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    runs = {"miniddp": (ours, torch.optim.SGD(ours.parameters(), lr=1e-3)),
            "torch": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3))}
    if baseline is not None:
        before = load_baseline(baseline).DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
        runs["baseline"] = (before, torch.optim.SGD(before.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(accumulation)]
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]  # rotate who goes first
        for name in order:
            t = timed_step(*runs[name], batches, accumulation)
            if i >= warmup:
                times[name].append(t)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"times": times, "grad_mb": grad_bytes / 2**20, "buckets": len(ours.bucket_assignment)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--baseline", metavar="DIR", help="a checkout whose miniddp runs beside this one")
    args = parser.parse_args()
    rows = []
    for accumulation in (1, 4):
        [result, *_] = run_on_ranks(bench, args.world_size, args=(args.hidden, args.layers, args.steps, args.warmup,
                                                                  args.batch, accumulation, args.bucket_cap_mb,
                                                                  args.baseline), timeout=1800)
        times = result["times"]
        ratios = [a / b for a, b in zip(times["miniddp"], times["torch"])]
        row = {"gradient_accumulation_steps": accumulation, "grad_mb": round(result["grad_mb"], 1),
               "buckets": result["buckets"], "median_step_s": {k: statistics.median(v) for k, v in times.items()},
               "median_ratio": statistics.median(ratios), "ratio_quartiles": statistics.quantiles(ratios, n=4),
               "samples": times}
        if args.baseline:
            against = [a / b for a, b in zip(times["miniddp"], times["baseline"])]
            row["baseline_ratio_to_torch"] = statistics.median(b / t for b, t in zip(times["baseline"], times["torch"]))
            row["median_ratio_to_baseline"] = statistics.median(against)
            row["ratio_to_baseline_quartiles"] = statistics.quantiles(against, n=4)
        rows.append(row)
    print(f"{args.world_size} gloo ranks, torch {torch.__version__}, MLP with {rows[0]['grad_mb']} MB of gradients, "
          f"bucket_cap_mb={args.bucket_cap_mb} ({rows[0]['buckets']} buckets), {args.steps} interleaved steps\n")
    print("| accumulation | miniddp step (ms) | torch DDP step (ms) | median ratio miniddp/torch | IQR |")
    print("|---|---|---|---|---|")
    for r in rows:
        q = r["ratio_quartiles"]
        print(f"| {r['gradient_accumulation_steps']} | {1e3 * r['median_step_s']['miniddp']:.1f} | "
              f"{1e3 * r['median_step_s']['torch']:.1f} | {r['median_ratio']:.3f} | {q[0]:.3f}-{q[2]:.3f} |")
    if args.baseline:
        print(f"\nagainst the baseline {args.baseline} (same run, interleaved):\n")
        print("| accumulation | baseline/torch | miniddp/torch | median ratio miniddp/baseline | IQR |")
        print("|---|---|---|---|---|")
        for r in rows:
            q = r["ratio_to_baseline_quartiles"]
            print(f"| {r['gradient_accumulation_steps']} | {r['baseline_ratio_to_torch']:.3f} "
                  f"| {r['median_ratio']:.3f} "
                  f"| {r['median_ratio_to_baseline']:.3f} | {q[0]:.3f}-{q[2]:.3f} |")
    out = Path(__file__).parent / "results" / "ddp_vs_torch.json"
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
