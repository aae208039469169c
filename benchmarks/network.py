"""Step time against link rate: where bucketing, overlap and compression matter, measured and predicted.

Run (as root):  python benchmarks/network.py --json benchmarks/results/network.json [--quick]

Two ranks, one per "host" of ``miniddp.testing.netlab`` (network namespaces joined by a veth pair, both
ends shaped with tbf), gloo over that link, the 6x1024 GELU MLP of ``benchmarks/timeline.py``
(21 MiB of fp32 gradients, batch 32), SGD. For each link (1, 3, 10 Gbit/s, unshaped) a fresh
pair of rank processes builds every configuration on copies of one model:

- torch DDP fp32, and miniddp fp32, at default buckets; miniddp at each ``bucket_cap_mb`` of
  the sweep, and at ``"auto"``;
- miniddp's fp16 and bf16 hooks; PowerSGD rank 4, miniddp's and torch's (torch's with one
  100 MB bucket: with several it hangs on gloo, ``docs/comm-hooks.md``);
- no communication: the plain model, no DDP at all: the floor.

After a warm-up (past the rebuild, ``"auto"``'s choice and ``start_powerSGD_iter``) the
configurations take turns, one step each, in an order that rotates every round. A step is
forward + backward + optimizer, the slowest rank's time. Reported: each configuration's
median, and the median of per-round ratios to torch fp32.

Predicted: ``miniddp.costmodel.simulate`` replays the plain model's traced gradient-ready times,
with DDP's bucket copies added (``with_bucket_copies``), with each configuration's buckets, on
the α–β fitted on that link and the overlap cost measured there; a hook is a ``Compression``
(its wire bytes, collectives, and compute measured once, on both ranks at once). The crossover is
the rate below which PowerSGD beats torch fp32: measured by interpolating the measured
ratios, predicted with ``AlphaBeta.on_link`` from the unshaped fit.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
LINKS = [1.0, 3.0, 10.0, None]  # Gbit/s; None: the veth unshaped
SIZES = [2**18, 2**20, 2**22, 2**24, 2**25]  # bytes of the α-β sweep: 256 KiB .. 32 MiB, a bucket's sizes
PSGD_RANK, START = 4, 2


def configurations(caps) -> dict:
    """name -> (torch's wrapper?, DDP keyword arguments, hook factory or None, local only?)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from miniddp import comm_hooks

    group = dist.group.WORLD
    configs = {"torch fp32": (True, {}, None, False), "miniddp fp32": (False, {}, None, False)}
    configs |= {f"miniddp fp32 cap {c:g}": (False, {"bucket_cap_mb": c}, None, False) for c in caps}
    configs |= {
        "miniddp fp32 auto": (False, {"bucket_cap_mb": "auto"}, None, False),
        "miniddp fp16": (False, {}, lambda: (group, comm_hooks.fp16_compress_hook), False),
        "miniddp bf16": (False, {}, lambda: (group, comm_hooks.bf16_compress_hook), False),
        f"miniddp PowerSGD r{PSGD_RANK}": (False, {}, lambda: (comm_hooks.PowerSGDState(
            group, matrix_approximation_rank=PSGD_RANK, start_powerSGD_iter=START), comm_hooks.powerSGD_hook), False),
        f"torch PowerSGD r{PSGD_RANK}": (True, {"bucket_cap_mb": 100}, lambda: (torch_psgd.PowerSGDState(
            group, matrix_approximation_rank=PSGD_RANK, start_powerSGD_iter=START), torch_psgd.powerSGD_hook), False),
    }
    return configs


def step(ddp, opt, local_only, tracer, x, y) -> float:
    """One step, the slowest rank's time. ``tracer``: the plain model's, recording forward, backward and
    optimizer (its gradients' ready times come from hooks, ``trace_plain``)."""
    dist.barrier()  # start together: time this step, not the previous one's stragglers
    if tracer is not None:
        tracer.clear()
        tracer.event("forward start")
    start = time.perf_counter()
    with ddp.no_sync() if local_only else nullcontext():
        loss = F.cross_entropy(ddp(x), y)
        if tracer is not None:
            tracer.event("backward start")
        loss.backward()
    if tracer is not None:
        tracer.event("backward end")
    opt.step()
    if tracer is not None:
        tracer.event("optimizer end")
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return elapsed.item()


def trace_plain(model, tracer) -> None:
    """Record each gradient's ready time on the plain model: the compute alone, no DDP."""
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: tracer.event("grad ready", param=name))


def compute_costs(model) -> dict:
    """Seconds per gradient byte of what DDP and each hook do besides communicating, on every rank at
    once (the ranks share this machine's memory bandwidth, as they do in a step): DDP's copies into
    and out of the buckets, fp16's casts, PowerSGD's products, orthogonalisation and error feedback."""
    from miniddp.comm_hooks.powersgd import orthogonalize

    grads = [torch.randn_like(p) for p in model.parameters()]
    flat = torch.empty(sum(g.numel() for g in grads))
    views = [flat[o - g.numel():o].view_as(g) for g, o in zip(grads, itertools.accumulate(g.numel() for g in grads))]
    total = 4 * flat.numel()

    def best(fn, reps=5):
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def copies():
        for g, v in zip(grads, views):
            torch.div(g, 2, out=v)  # in, divided (Bucket.put)
        for g, v in zip(grads, views):
            g.copy_(v)  # out (Bucket.write_back)

    mats = [v.view(v.shape[0], -1) for v in views if v.dim() == 2]
    errors = [torch.zeros_like(m) for m in mats]
    qs = [torch.randn(m.shape[1], PSGD_RANK) for m in mats]

    def powersgd():
        for m, e, q in zip(mats, errors, qs):
            m += e
            p = orthogonalize(m @ orthogonalize(q))
            q.copy_((p.t() @ m).t())
            e.copy_(m)
            torch.matmul(p, q.t(), out=m)
            e.sub_(m)

    return {"copy_s_per_byte": best(copies) / 2 / total,  # one copy: each way is charged separately
            "fp16_s_per_byte": best(lambda: flat.to(torch.float16).div_(2).to(torch.float32)) / total,
            "powersgd_s_per_byte": best(powersgd) / (4 * sum(m.numel() for m in mats))}


def worker(args) -> None:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import miniddp
    from miniddp import comm_hooks
    from miniddp.costmodel.alpha_beta import measure_all_reduce, measure_overlap_cost
    from miniddp.diagnostics.trace import Tracer

    from timeline import gelu_mlp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    points = measure_all_reduce(SIZES, reps=args.reps)
    overlap = measure_overlap_cost(2**22, reps=3)
    torch.manual_seed(0)
    model = gelu_mlp()
    runs, tracer = {}, Tracer(rank)
    for name, (theirs, options, hook, local_only) in configurations(args.caps).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 deprecates broadcast_buffers
            wrapper = TorchDDP if theirs else miniddp.DistributedDataParallel
            ddp = wrapper(copy.deepcopy(model), **options)
        if hook is not None:
            ddp.register_comm_hook(*hook())
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), local_only, None)
    plain = copy.deepcopy(model)  # no DDP at all: the floor, and the compute the cost model replays
    trace_plain(plain, tracer)
    runs["no communication"] = (plain, torch.optim.SGD(plain.parameters(), lr=1e-3), False, tracer)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    names, times, events = list(runs), {n: [] for n in runs}, []
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
            t = step(*runs[name], x, y)
            if i >= args.warmup:
                times[name].append(t)
                if runs[name][3] is not None:
                    events.append(list(tracer.events))
    costs = compute_costs(model)
    sent = {}
    for name, (ddp, opt, local_only, _) in runs.items():
        if name.startswith("miniddp"):
            with comm_hooks.count_bytes() as counted:
                step(ddp, opt, local_only, None, x, y)
            sent[name] = counted.total
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, events)
    auto = runs["miniddp fp32 auto"][0]
    result = {"points": points, "overlap_cost": overlap, "times": times, "bytes": sent, "events": everyone,
              "auto_cap_mb": auto.auto_bucket_cap_mb, "compute": costs,
              "buckets": {n: len(d.bucket_assignment) for n, (d, *_) in runs.items()
                          if hasattr(d, "bucket_assignment")}}
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=HERE / "results" / "network.json")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and caps: at most 5 minutes")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="all-reduce repetitions per size of the α-β sweep")
    parser.add_argument("--caps", type=float, nargs="+", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.quick else 20)
    args.caps = args.caps or ([1, 5, 25, 100] if args.quick else [1, 2, 5, 10, 25, 50, 100])
    if args.worker:
        return worker(args)
    from network_analysis import analyse, plot, print_table

    from miniddp.testing import netlab

    why = netlab.unavailable()
    if why:
        sys.exit(f"benchmarks/network.py: {why}")
    started, load_before, links = time.perf_counter(), os.getloadavg()[0], {}
    argv = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--reps", str(args.reps), "--caps", *map(str, args.caps)]
    with netlab.net_lab(2) as lab:
        for link in LINKS:
            lab.set_rate(link)
            out = lab.run_ranks(argv, timeout=900, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
            links[str(link)] = json.loads(out[0].strip().splitlines()[-1])
            print(f"link {link or 'unshaped'}: done at {time.perf_counter() - started:.0f} s", flush=True)
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "torch": torch.__version__, "load_average_1min": [load_before, os.getloadavg()[0]],
              "wall_s": time.perf_counter() - started, **analyse(links), "links": links}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    plot(report, HERE.parent / "docs" / "img" / "network.svg")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
