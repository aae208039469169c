"""The gloo collectives ZeRO could use for one bucket, timed side by side: where ZeroOptimizer's step time goes.

Run:  python benchmarks/zero_collectives.py [--links loopback 1] [--reps 9]   (the 1 Gbit/s link needs root;
      about 20 s)

Two gloo ranks, a bucket of the 6x1024 GELU MLP's size (5,521,418 fp32 elements, 21 MiB, the size of
``benchmarks/zero_step_time.py``'s gradients), each way to move it:

* the gradient: ``all_reduce`` in place (DDP's); gloo's ``reduce_scatter_tensor`` (what ZeroOptimizer called on
  gloo before ``collectives/shard_collectives.py``); the direct reduce-scatter that ZeroOptimizer calls on gloo
  now (``shard_collectives.reduce_scatter``: every chunk sent to its rank with ``batch_isend_irecv``, a thread
  waits and sums this rank's chunk), in messages of at most ``SEGMENT_BYTES``, and the same with each chunk one
  message; ``all_to_all_single`` and a sum of the received chunks (the same bytes
  through one gloo collective);
* the parameters: gloo's ``all_gather_into_tensor`` into a flat buffer (what ZeroOptimizer called on gloo
  before); the direct all-gather ZeroOptimizer calls on gloo now (``shard_collectives.all_gather_pieces``: each
  piece sent from its owner's parameter straight into the other rank's, here the step-time model's 14
  parameters), segmented, and the same with each piece one message; one asynchronous ``broadcast`` per rank of
  its chunk (torch's ``ZeroRedundancyOptimizer`` broadcasts per parameter).

The operations take turns, one at a time from a barrier, ``--reps`` rounds in an order that rotates; each time is
the slower rank's; the table shows medians. ``loopback`` runs the ranks on this machine; ``1`` in the net lab's
two namespaces joined by a veth shaped to 1 Gbit/s, where each rank's bytes on its interface are counted too
(MiB it sent, per rank, median) and set against the time they take at the link's rate (``line rate``: the
larger rank's bytes x 8 / rate, divided by the measured time). Writes ``benchmarks/results/zero_collectives.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
NUMEL = 5_521_418
MiB = 2**20


def parameters() -> list[torch.Tensor]:
    """Tensors shaped as ``gelu_mlp(1024, 6)``'s 14 parameters (5,521,418 elements): the all-gather's views."""
    shapes = [(1024, 256), (1024,)] + [(1024, 1024), (1024,)] * 5 + [(10, 1024), (10,)]
    return [torch.randn(shape) for shape in shapes]


def operations(rank: int, n: int) -> dict:
    """name -> a function running that collective once on one bucket."""
    from miniddp.collectives import shard_collectives
    from miniddp.collectives.shard_collectives import all_gather_pieces, reduce_scatter
    from miniddp.zero.gradient_shards import Shards

    size = -(-NUMEL // n)
    flat, mine = torch.randn(size * n), torch.randn(size)
    params = parameters()
    bucket = SimpleNamespace(buffer=flat[:NUMEL], params=params, indices=list(range(len(params))))
    pieces_by_rank = [Shards([bucket], r, n).pieces[0] for r in range(n)]  # whose elements are whose, as ZeRO cuts

    def all_to_all_and_sum():
        received = torch.empty(size * n)
        dist.all_to_all_single(received, flat)
        return received.view(n, size).sum(0)

    def broadcasts():
        gathered = torch.empty(size * n)
        gathered[rank * size:(rank + 1) * size] = mine
        works = [dist.broadcast(gathered[r * size:(r + 1) * size], src=r, async_op=True) for r in range(n)]
        for work in works:
            work.wait()

    def whole(run):  # the direct exchange as it was first written: one message per tensor, not segmented
        def unsegmented():
            segment, shard_collectives.SEGMENT_BYTES = shard_collectives.SEGMENT_BYTES, 2**62
            try:
                run()
            finally:
                shard_collectives.SEGMENT_BYTES = segment
        return unsegmented

    direct_rs = lambda: reduce_scatter(torch.empty(size), flat, dist.group.WORLD).wait()  # noqa: E731
    direct_ag = lambda: all_gather_pieces(pieces_by_rank, size, flat, dist.group.WORLD).wait()  # noqa: E731
    return {
        "gradient: all_reduce (DDP)": lambda: dist.all_reduce(flat),
        "gradient: gloo's reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(size), flat),
        "gradient: direct reduce-scatter, chunks sent to their ranks (ZeroOptimizer on gloo)": direct_rs,
        "gradient: the same, each chunk one message (not segmented)": whole(direct_rs),
        "gradient: all_to_all_single + sum": all_to_all_and_sum,
        "parameters: gloo's all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(size * n), mine),
        "parameters: direct all-gather, pieces sent into 14 parameters (ZeroOptimizer on gloo)": direct_ag,
        "parameters: the same, each piece one message (not segmented)": whole(direct_ag),
        "parameters: one broadcast per rank's chunk": broadcasts,
    }


def sent_on_the_wire() -> int | None:
    """This host's interface's transmitted bytes in the net lab (None on loopback)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface is None:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])
    return None


def measure(rank: int, world_size: int, reps: int) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torch 2.13 renames the *_tensor collectives
    ops = operations(rank, world_size)
    times, sent = {name: [] for name in ops}, {name: [] for name in ops}
    for name, op in ops.items():  # warm-up: connections, buffers
        op()
    for r in range(reps):
        names = list(ops)[r % len(ops):] + list(ops)[: r % len(ops)]  # rotate who goes first
        for name in names:
            dist.barrier()
            before, start = sent_on_the_wire(), time.perf_counter()
            ops[name]()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.barrier()
            if before is not None:
                sent[name].append(sent_on_the_wire() - before)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {name: {"ms": 1e3 * statistics.median(times[name]),
                   "sent_mib": statistics.median(sent[name]) / MiB if sent[name] else None} for name in ops}


def worker(args) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    result = measure(dist.get_rank(), dist.get_world_size(), args.reps)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "1"])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "zero_collectives.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    links = {}
    for link in args.links:
        if link == "loopback":
            from miniddp.launching.spawn import run_on_ranks

            links[link] = run_on_ranks(measure, 2, args=(args.reps,), timeout=600)
        else:
            from miniddp.testing import netlab

            why = netlab.unavailable()
            if why:
                sys.exit(f"benchmarks/zero_collectives.py: {why}")
            argv = [sys.executable, __file__, "--worker", "--reps", str(args.reps)]
            with netlab.net_lab(2, rate_gbit=float(link)) as lab:
                out = lab.run_ranks(argv, timeout=600, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
            links[link] = json.loads(out[0].strip().splitlines()[-1])
    print(f"2 gloo ranks, one bucket of {NUMEL:,} fp32 elements ({4 * NUMEL / MiB:.1f} MiB); median ms, the slower "
          "rank; on the lab's link also MiB each rank sent (rank 0 / rank 1) and the share of the line rate: the "
          "larger rank's bytes x 8 / rate, over the time\n")
    print("| operation | " + " | ".join("loopback" if k == "loopback" else f"{k} Gbit/s" for k in links) + " |")
    print("|---|" + "---|" * len(links))
    for name in links[args.links[0]][0]:
        cells = []
        for link, ranks in links.items():
            cell = f"{ranks[0][name]['ms']:.1f} ms"
            if ranks[0][name]["sent_mib"] is not None:
                most = max(r[name]["sent_mib"] for r in ranks) * MiB * 8 / (float(link) * 1e9)  # seconds at the rate
                cell += " · " + " / ".join(f"{r[name]['sent_mib']:.1f}" for r in ranks) + " MiB"
                cell += f" · {1e3 * most / ranks[0][name]['ms']:.2f} of line rate"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    args.json.write_text(json.dumps({"torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                     "load_average_1min": os.getloadavg()[0], "numel": NUMEL,
                                     "args": {k: str(v) for k, v in vars(args).items()}, "links": links},
                                    indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
