"""What miniddp's guards against silent mistakes cost, measured.

    python benchmarks/guard_cost.py [--json OUT]

- The no_sync window check (``no_sync.ChangedInWindow``): one ``p._version`` read per parameter at
  the window's first no_sync forward and at the next synced forward. Timed per call for models of
  10, 100 and 1000 parameters, beside one forward + backward of the 6x1024 GELU MLP (14 parameters,
  batch 32, one thread) for scale.
- ShardSampler's agreement across ranks (``sharding.check_same_on_every_rank``): one store write and
  read per sampler, at its first pass, on 2 gloo ranks.
"""

import argparse
import json
import statistics
import time

import torch

from miniddp.engine.no_sync import ChangedInWindow
from miniddp.launching.spawn import run_on_ranks


def check_per_call(num_params: int, reps: int = 2000) -> float:
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(4))) for i in range(num_params)]
    window = ChangedInWindow(params)
    start = time.perf_counter()
    for _ in range(reps):
        window.local_forward()
        window.synced_forward()
    return (time.perf_counter() - start) / reps / 2  # per call


def _sampler_agreement(rank, world_size, reps):
    import miniddp
    from miniddp.data import sharding

    times = []
    for _ in range(reps):
        sampler = miniddp.ShardSampler(range(4096), seed=0)
        number, sampler._agreement = sampler._agreement, None
        start = time.perf_counter()
        sharding.check_same_on_every_rank(number, rank, world_size, {"seed": 0})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {f"window_check_us_per_call_{n}_params": check_per_call(n) * 1e6 for n in (10, 100, 1000)}
    from timeline import gelu_mlp  # the benchmarks' one definition of the workload

    model, x = gelu_mlp(), torch.randn(32, 256)
    steps = []
    for _ in range(10):
        start = time.perf_counter()
        model(x).square().mean().backward()
        steps.append(time.perf_counter() - start)
    result["gelu_mlp_forward_backward_ms"] = statistics.median(steps) * 1e3
    result["sampler_agreement_ms"] = max(run_on_ranks(_sampler_agreement, 2, args=(50,), timeout=120)) * 1e3
    for k, v in result.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
