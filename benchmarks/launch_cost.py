"""What does it cost to start N ranks? spawn vs fork vs forkserver, measured here.

Run:  python benchmarks/launch_cost.py [--world-size 2] [--repeats 5]

Each launch starts ``world_size`` processes through ``miniddp.launching.spawn.run_on_ranks``,
joins them in a gloo process group, runs one all-reduce and collects the result:
the fixed price every multi-rank test pays. ``forkserver`` is reported twice: its
first launch (which starts the server and imports torch in it) and the later ones.
Writes ``benchmarks/results/launch_cost.json``.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from miniddp.launching.spawn import run_on_ranks


def one_all_reduce(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def launch(method, world_size):
    start = time.perf_counter()
    results = run_on_ranks(one_all_reduce, world_size, start_method=method, timeout=120)
    assert results == [float(world_size)] * world_size
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ws = args.world_size
    rows = {"forkserver (first launch)": [launch("forkserver", ws)]}
    samples = {"spawn": [], "fork": [], "forkserver": []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits all three alike
        for method in samples:
            samples[method].append(launch(method, ws))
    rows.update(samples)
    result = {"world_size": ws, "torch": torch.__version__,
              "median_s": {k: statistics.median(v) for k, v in rows.items()}, "samples_s": rows}
    print(f"| start method ({ws} ranks) | median launch (s) |\n|---|---|")
    for name, value in result["median_s"].items():
        print(f"| {name} | {value:.2f} |")
    out = Path(__file__).parent / "results" / "launch_cost.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
