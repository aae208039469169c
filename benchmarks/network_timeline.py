"""One DDP step over a 1 Gbit/s link, overlap on and off: what the network leaves exposed.

Run (as root):  python benchmarks/network_timeline.py [--rate 1] [--bucket-cap-mb 5]   (about 30 s)

Two ranks, one per host of ``miniddp.testing.netlab`` (a veth pair shaped with tbf on both ends),
the 6x1024 GELU MLP of ``benchmarks/timeline.py``, ``miniddp.DistributedDataParallel`` with a
``Tracer``. Overlap on: the reducer as it is, each bucket launched once it is full. Overlap
off: the same reducer with every launch held back to the end of the backward (the negative
control of ``tests/test_bucketing.py``). Each rank's median step of each is drawn with
``miniddp.diagnostics.timeline`` (exposed communication hatched). Writes
``docs/img/network-timeline-overlap.svg``, ``docs/img/network-timeline-no-overlap.svg`` and
``benchmarks/results/network-timeline.json`` (the events, and each step's summary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def worker(args) -> None:
    import miniddp
    from miniddp.diagnostics.trace import Tracer, step_summary
    from miniddp.engine.reducer import Reducer

    from timeline import gelu_mlp, traced_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, out = dist.get_rank(), {}
    launch = Reducer._launch
    for mode in ("overlap", "no overlap"):
        Reducer._launch = launch if mode == "overlap" else (
            lambda self, state, wait=False: launch(self, state, wait) if wait else None)  # all at the end
        torch.manual_seed(0)
        tracer = Tracer(rank)
        ddp = miniddp.DistributedDataParallel(gelu_mlp(), bucket_cap_mb=args.bucket_cap_mb, tracer=tracer)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        steps = [traced_step(ddp, opt, x, y, tracer) for _ in range(args.warmup + args.steps)][args.warmup:]
        out[mode] = steps
    Reducer._launch = launch
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    dist.destroy_process_group()
    if rank == 0:
        result = {}
        for mode in out:
            per_step = [[everyone[r][mode][i] for r in range(len(everyone))] for i in range(args.steps)]
            totals = [max(step_summary(ev)["step_s"] for ev in ranks) for ranks in per_step]
            median = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
            result[mode] = {"step_ms": [1e3 * t for t in totals], "median_step_ms": 1e3 * statistics.median(totals),
                            "drawn": per_step[median]}
        print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.0, help="the link, Gbit/s")
    parser.add_argument("--bucket-cap-mb", type=float, default=5)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from miniddp.diagnostics.timeline import plot_timeline
    from miniddp.testing import netlab

    why = netlab.unavailable()
    if why:
        sys.exit(f"benchmarks/network_timeline.py: {why}")
    argv = [sys.executable, __file__, "--worker", "--bucket-cap-mb", str(args.bucket_cap_mb), "--steps",
            str(args.steps), "--warmup", str(args.warmup)]
    with netlab.net_lab(2, rate_gbit=args.rate) as lab:
        result = json.loads(lab.run_ranks(argv, timeout=600, PYTHONPATH=str(HERE.parent))[0].strip().splitlines()[-1])
    report = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "torch": torch.__version__, **result}
    for mode, slug in (("overlap", "overlap"), ("no overlap", "no-overlap")):
        path = HERE.parent / "docs" / "img" / f"network-timeline-{slug}.svg"
        summaries = plot_timeline(report[mode]["drawn"], path, title=f"one step over a {args.rate:g} Gbit/s link, "
                                  f"bucket_cap_mb={args.bucket_cap_mb:g}, {mode}")
        report[mode]["summaries"] = summaries
        print(f"{mode}: median step {report[mode]['median_step_ms']:.1f} ms; drawn: " + ", ".join(
            f"rank {r} exposed {1e3 * s['exposed_comm_s']:.1f} ms" for r, s in enumerate(summaries)) + f" -> {path}")
    (HERE / "results" / "network-timeline.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
