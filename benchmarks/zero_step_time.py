"""ZeRO's step time against DDP's, in one run: DDP + AdamW, ``ZeroOptimizer`` stages 1 and 2, torch-style ZeRO-1.

Run:  python benchmarks/zero_step_time.py [--links loopback 1] [--rounds 12] [--chunk 4] [--candidate DIR]
      (the 1 Gbit/s link needs root: ``miniddp.testing.netlab``; about 3 minutes for both links)

Two gloo ranks train four copies of the 6x1024 GELU MLP of ``benchmarks/timeline.py`` (5.5 M fp32 parameters,
batch 32 per rank, AdamW, default buckets), one per variant, on the same batches:

* ``DDP + AdamW``: ``miniddp.DistributedDataParallel`` and ``torch.optim.AdamW`` (stage 0);
* ``ZeroOptimizer stage 1`` and ``stage 2``: the same DDP with ``miniddp.ZeroOptimizer(ddp, AdamW, stage)``
  (a reduce-scatter per bucket, AdamW on this rank's shard, an all-gather per bucket);
* ``ZeroRedundancyOptimizer``: the same DDP (its all-reduce) with ``miniddp.ZeroRedundancyOptimizer`` (torch's
  design: AdamW on the parameters this rank owns, then one broadcast per parameter from its owner).

After a warm-up the variants take turns in chunks of ``--chunk`` steps, in an order that rotates every round. A
step is forward + backward + ``step()`` + ``zero_grad()``; a chunk starts at a barrier with one untimed step, and
each step's time is from the end of the step before to its own end, the slower rank's (per step, gathered after
the chunk). No barrier between timed steps: ``ZeroOptimizer`` leaves its all-gather in flight after ``step()``
(``zero/gather_prefetch.py``), and the next forward waits for it; a barrier there would wait for it untimed. Per
round, a variant's time is the median of its chunk; the figure of merit is the median over rounds of the per-round
ratio variant / DDP, with its quartiles. ``--links loopback`` runs the two ranks on this machine's loopback; ``1``
runs them in two network namespaces joined by a veth shaped to 1 Gbit/s (tbf). Each rank calls
``torch.set_num_threads(1)``. ``--candidate DIR`` adds ``ZeroOptimizer`` stages 1 and 2 of another
checkout's ``miniddp`` (its DDP too) to the same interleaving, to measure a change against this one. Sanity, not
a claim: after the run every variant's parameters are compared with DDP's (the same steps on the same batches),
beside how far DDP's moved from the initial ones.
Writes ``benchmarks/results/zero_step_time.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIANTS = ["DDP + AdamW", "ZeroOptimizer stage 1", "ZeroOptimizer stage 2", "ZeroRedundancyOptimizer"]
LR = 1e-4


def build(name: str, model: torch.nn.Module, candidate: str | None = None):
    """``(ddp, optimizer)`` of variant ``name`` on a copy of ``model`` (``candidate ...``: that checkout's)."""
    import miniddp

    if name.startswith("candidate"):
        from ddp_vs_torch import load_baseline

        miniddp, name = load_baseline(candidate), name.removeprefix("candidate ")
    ddp = miniddp.DistributedDataParallel(copy.deepcopy(model))
    if name == "DDP + AdamW":
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)
    if name.startswith("ZeroOptimizer"):
        return ddp, miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=int(name[-1]), lr=LR)
    return ddp, miniddp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=LR)


def step(ddp, optimizer, x, y) -> None:
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def chunk_times(ddp, optimizer, x, y, n: int) -> list[float]:
    """``n`` consecutive steps after a barrier and one untimed step: each from the end of the step before to its
    own end (what the step left in flight is paid by the next), the slower rank's seconds."""
    dist.barrier()
    step(ddp, optimizer, x, y)
    ends = [time.perf_counter()]
    for _ in range(n):
        step(ddp, optimizer, x, y)
        ends.append(time.perf_counter())
    elapsed = torch.tensor([b - a for a, b in zip(ends, ends[1:])], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q1, q2, q3


def variants(candidate: str | None) -> list[str]:
    return VARIANTS + ([f"candidate {v}" for v in VARIANTS if v.startswith("ZeroOptimizer")] if candidate else [])


def train(rank: int, world_size: int, rounds: int, chunk: int, warmup: int, batch: int,
          candidate: str | None = None) -> dict:
    """On each rank: every variant on one copy of the model, chunks taking turns; per-round times."""
    from timeline import gelu_mlp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gelu_mlp()
    names = variants(candidate)
    runs = {name: build(name, model, candidate) for name in names}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    for name in names:
        for _ in range(warmup):
            step(*runs[name], x, y)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            times[name].append(chunk_times(*runs[name], x, y, chunk))
    reference = list(runs["DDP + AdamW"][0].parameters())
    drift = {name: max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), reference))
             for name, (ddp, _) in runs.items()}
    moved = max((p - q).abs().max().item() for p, q in zip(reference, model.parameters()))  # not a vacuous match
    return {"times": times, "max_abs_diff_from_ddp": drift, "moved_from_init": moved,
            "numel": sum(p.numel() for p in model.parameters())}


def summarise(result: dict) -> dict:
    """Per variant: median step (ms), and the median and quartiles of the per-round ratio to DDP."""
    per_round = {name: [statistics.median(c) for c in chunks] for name, chunks in result["times"].items()}
    out = {}
    for name, medians in per_round.items():
        ratios = [a / b for a, b in zip(medians, per_round["DDP + AdamW"])]
        q1, q2, q3 = quartiles(ratios)
        out[name] = {"step_ms": 1e3 * statistics.median(s for c in result["times"][name] for s in c),
                     "ratio_median": q2, "ratio_q1": q1, "ratio_q3": q3, "ratios": ratios,
                     "max_abs_diff_from_ddp": result["max_abs_diff_from_ddp"][name]}
    return out


def worker(args) -> None:
    """One rank in the net lab (torchrun's variables set by the lab): rank 0 prints the result as JSON."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    result = train(dist.get_rank(), 2, args.rounds, args.chunk, args.warmup, args.batch, args.candidate)
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "1"],
                        help="loopback, and/or link rates in Gbit/s through the net lab")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per variant before the rounds")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--candidate", metavar="DIR", help="a checkout whose ZeroOptimizer runs beside this one")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "zero_step_time.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    links = {}
    for link in args.links:
        if link == "loopback":
            from miniddp.launching.spawn import run_on_ranks

            result = run_on_ranks(train, 2, args=(args.rounds, args.chunk, args.warmup, args.batch,
                                                      args.candidate), timeout=900)[0]
        else:
            from miniddp.testing import netlab

            why = netlab.unavailable()
            if why:
                sys.exit(f"benchmarks/zero_step_time.py: {why}")
            argv = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--chunk", str(args.chunk),
                    "--warmup", str(args.warmup), "--batch", str(args.batch)]
            argv += ["--candidate", args.candidate] if args.candidate else []
            with netlab.net_lab(2, rate_gbit=float(link)) as lab:
                out = lab.run_ranks(argv, timeout=900, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
            result = json.loads(out[0].strip().splitlines()[-1])
        links[link] = {**summarise(result), "numel": result["numel"], "moved_from_init": result["moved_from_init"]}
        load.append(os.getloadavg()[0])
        print(f"{link}: done at {time.perf_counter() - started:.0f} s", flush=True)
    report = {"torch": torch.__version__, "date": datetime.date.today().isoformat(), "world_size": 2,
              "model": "gelu_mlp(1024, 6)", "args": {k: str(v) for k, v in vars(args).items()},
              "load_average_1min": load, "wall_s": time.perf_counter() - started, "links": links}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n2 gloo ranks, gelu_mlp 6x1024 ({next(iter(links.values()))['numel']:,} parameters), AdamW, "
          f"{args.rounds} rounds x {args.chunk} steps; ratio = median of per-round ratios to DDP + AdamW (IQR)\n")
    print("| variant | " + " | ".join(f"{'loopback' if k == 'loopback' else k + ' Gbit/s'}: step ms, ratio (IQR)"
                                      for k in links) + " |")
    print("|---|" + "---|" * len(links))
    for name in variants(args.candidate):
        cells = [f"{s[name]['step_ms']:.1f} · **{s[name]['ratio_median']:.3f}** ({s[name]['ratio_q1']:.3f} – "
                 f"{s[name]['ratio_q3']:.3f})" for s in links.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    drift = max(s[name]["max_abs_diff_from_ddp"] for s in links.values() for name in variants(args.candidate))
    moved = min(s["moved_from_init"] for s in links.values())
    print(f"\nlargest parameter difference from DDP after the run: {drift:.2e} (DDP's parameters moved up to "
          f"{moved:.2e} from the initial ones); load average {load}")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
