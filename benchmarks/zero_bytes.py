"""Bytes each rank sends per step, ZeRO stages 0, 1 and 2 on 2 to 4 ranks: counted, by the ring formula, measured.

Run (as root):  python benchmarks/zero_bytes.py [--world-sizes 2 3 4] [--hidden 512] [--layers 4]   (about 20 s)

What: one training step of the fp32 GELU MLP of ``benchmarks/zero_memory.py`` (Ψ = 924,682 parameters, 3.53
MiB), AdamW, for

* stage 0: ``miniddp.DistributedDataParallel`` + ``torch.optim.AdamW`` (one all-reduce per bucket);
* stage 1, torch's design: the same DDP + ``miniddp.ZeroRedundancyOptimizer`` (DDP's all-reduce, then every
  parameter broadcast from the rank that owns it);
* stages 1 and 2: ``miniddp.ZeroOptimizer`` (a reduce-scatter per bucket, an all-gather per bucket),

in three columns: the payload handed to each collective (``miniddp.comm_hooks.count_bytes``; broadcasts are
not counted there, so this script adds the bytes of the parameters each rank owns, which it sends as the
source), what a ring sends per rank for that payload (``ByteCount.wire_bytes``: all-reduce 2(N-1)/N, reduce-
scatter (N-1)/N of its input, all-gather N-1 times its input; a broadcast's N-1 copies shared among the ranks:
(N-1)/N of its payload on average), and what each rank's network interface actually sent (``tx_bytes`` of
``/proc/net/dev``, TCP/IP headers included, one barrier's bytes taken off). The ranks run in
``miniddp.testing.netlab``'s namespaces (two joined by a veth pair, more by a bridge), so each interface carries
exactly one rank's traffic. DDP's all-reduce of the gradients is the yardstick: 2(N-1)/N · 4Ψ bytes per rank.
Median of ``--reps`` steps after two warm-up steps. Writes ``benchmarks/results/zero_bytes.json``.
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
MiB = 2**20
VARIANTS = ["stage 0 (DDP + AdamW)", "stage 1, torch's design (miniddp.ZeroRedundancyOptimizer)",
            "stage 1 (ZeroOptimizer)", "stage 2 (ZeroOptimizer)"]


def sent_on_the_wire() -> int:
    """Bytes this host's interface has sent (the lab's ``GLOO_SOCKET_IFNAME``), from this namespace's view."""
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])  # receive has 8 fields, then transmit's bytes
    raise RuntimeError(f"no interface {interface} in /proc/self/net/dev")


def build(name: str, model):
    import miniddp

    ddp = miniddp.DistributedDataParallel(copy.deepcopy(model))
    if name.startswith("stage 0"):
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    if "ZeroRedundancyOptimizer" in name:
        return ddp, miniddp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
    return ddp, miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=int(name[6]), lr=1e-3)


def broadcast_bytes(opt) -> int:
    """What this rank sends as the source of torch-style ZeRO's broadcasts: the parameters it owns."""
    owned = getattr(opt, "owned", None)
    return 0 if owned is None else sum(p.numel() * p.element_size() for group in owned[opt.rank] for p in group)


def worker(args) -> None:
    from miniddp.comm_hooks import count_bytes

    from timeline import gelu_mlp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gelu_mlp(hidden=args.hidden, layers=args.layers)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)

    def one_step(ddp, opt):
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    barrier = []  # a barrier's own bytes, taken off each measurement
    for _ in range(5):
        dist.barrier()
        before = sent_on_the_wire()
        dist.barrier()
        barrier.append(sent_on_the_wire() - before)
    result = {"barrier_bytes": statistics.median(barrier), "numel": sum(p.numel() for p in model.parameters())}
    for name in VARIANTS:
        ddp, opt = build(name, model)
        for _ in range(2):
            one_step(ddp, opt)
        wire = []
        for _ in range(args.reps):
            dist.barrier()
            before = sent_on_the_wire()
            with count_bytes() as counted:
                one_step(ddp, opt)
            dist.barrier()  # every rank done: what this one sent for the step has left its interface
            wire.append(sent_on_the_wire() - before - result["barrier_bytes"])
        by_op = dict(counted.by_op)
        if broadcast_bytes(opt):
            by_op["broadcast (as source)"] = broadcast_bytes(opt)
        params = sum(p.numel() * p.element_size() for p in ddp.parameters())
        formula = counted.wire_bytes(n) + ((n - 1) / n * params if broadcast_bytes(opt) else 0)
        result[name] = {"payload": by_op, "ring": formula, "measured": statistics.median(wire)}
    everyone = [None] * n
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "zero_bytes.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    from miniddp.testing import netlab

    why = netlab.unavailable(shaping=False)
    if why:
        sys.exit(f"benchmarks/zero_bytes.py: {why}")
    started, sizes = time.perf_counter(), {}
    argv = [sys.executable, __file__, "--worker", "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--reps", str(args.reps)]
    for n in args.world_sizes:
        with netlab.net_lab(n) as lab:
            out = lab.run_ranks(argv, timeout=300, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
        sizes[n] = json.loads(out[0].strip().splitlines()[-1])
    psi = sizes[args.world_sizes[0]][0]["numel"]
    print(f"torch {torch.__version__}, gloo over the net lab's links, fp32 GELU MLP {args.layers}x{args.hidden}, "
          f"Ψ = {psi:,} ({4 * psi / MiB:.2f} MiB); MiB per rank per step; ring = count_bytes' wire_bytes(N); "
          "measured = the interface's tx bytes (min – max over ranks); ratio = measured mean / DDP's 2(N-1)/N·4Ψ\n")
    print("| ranks | variant | payload by collective (rank 0) | ring formula (mean) | measured (min – max) "
          "| measured mean / DDP's formula |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n, ranks in sizes.items():
        ddp = 2 * (n - 1) / n * 4 * psi
        for name in VARIANTS:
            payload = ", ".join(f"{op} {b / MiB:.2f}" for op, b in ranks[0][name]["payload"].items())
            measured = [r[name]["measured"] for r in ranks]
            ring = statistics.mean(r[name]["ring"] for r in ranks)
            rows.append({"ranks": n, "variant": name, "payload_rank0": ranks[0][name]["payload"], "ring_mean": ring,
                         "measured": measured, "ddp_formula": ddp})
            print(f"| {n} | {name} | {payload} | {ring / MiB:.2f} | {min(measured) / MiB:.2f} – "
                  f"{max(measured) / MiB:.2f} | **{statistics.mean(measured) / ddp:.2f}** |")
    args.json.write_text(json.dumps({"torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                     "args": {k: str(v) for k, v in vars(args).items()}, "numel": psi,
                                     "rows": rows, "raw": sizes}, indent=1) + "\n")
    print(f"\nwrote {args.json} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
