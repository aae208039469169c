"""Communication hooks side by side: step time, bytes on the wire, and what each costs in accuracy.

Run:  python benchmarks/comm_hooks.py [--steps 30] [--rank 4] [--accuracy-steps 300]

Speed. On 2 gloo ranks (1 thread each), every configuration below trains its
own copy of the 6x1024 GELU MLP (22 MB of fp32 gradients) on the same batches;
after a warm-up (past PowerSGD's ``start_powerSGD_iter`` and DDP's bucket
rebuild) the configurations take turns, one step each, in an order that rotates
every round (so machine noise hits all alike). A step is forward + backward +
optimizer step, timed as the slowest rank's. Ratios are medians of per-round
ratios against torch DDP's default fp32 all-reduce (and against torch's own
PowerSGD, run with ``bucket_cap_mb=100`` because with several buckets it hangs
on gloo). "no communication" is the same step inside ``no_sync()``: the floor.

Bytes. ``miniddp.comm_hooks.count_bytes`` counts what miniddp's hooks hand to
collectives in one step (payload; a ring sends 2(n-1)/n of it per rank).

Accuracy. The trainer's built-in task (``--model mlp``), same seed and steps,
once per ``--ddp_comm_hook`` (PowerSGD from step 10): final eval loss and
accuracy. Writes ``benchmarks/results/comm_hooks.json`` and, with matplotlib,
``docs/img/comm-hooks.svg``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp import comm_hooks
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.tasks import make_task

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from timeline import gelu_mlp  # noqa: E402  (the timeline's workload: 6x1024 GELU MLP, 22 MB of gradients)

START = 2  # start_powerSGD_iter (the smallest torch allows); the warm-up runs past it


def configurations(rank: int) -> dict:
    """name -> (wrapper class, DDP keyword arguments, hook factory or None, skip the all-reduce?)."""
    group = dist.group.WORLD
    ours_psgd = lambda: comm_hooks.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=START)  # noqa: E731
    theirs_psgd = lambda: torch_psgd.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=START)  # noqa: E731
    return {
        "torch fp32": (TorchDDP, {}, None, False),
        "no communication": (TorchDDP, {}, None, True),
        "miniddp fp32": (miniddp.DistributedDataParallel, {}, None, False),
        "torch fp16": (TorchDDP, {}, lambda: (group, torch_default.fp16_compress_hook), False),
        "miniddp fp16": (miniddp.DistributedDataParallel, {}, lambda: (group, comm_hooks.fp16_compress_hook), False),
        "miniddp bf16": (miniddp.DistributedDataParallel, {}, lambda: (group, comm_hooks.bf16_compress_hook), False),
        f"torch PowerSGD r{rank} (100 MB bucket)": (TorchDDP, {"bucket_cap_mb": 100},
                                                    lambda: (theirs_psgd(), torch_psgd.powerSGD_hook), False),
        f"miniddp PowerSGD r{rank}": (miniddp.DistributedDataParallel, {},
                                      lambda: (ours_psgd(), comm_hooks.powerSGD_hook), False),
        f"miniddp PowerSGD r{rank}, bucket views": (miniddp.DistributedDataParallel, {"gradient_as_bucket_view": True},
                                                    lambda: (ours_psgd(), comm_hooks.powerSGD_hook), False),
        "miniddp batched PowerSGD r1": (miniddp.DistributedDataParallel, {}, lambda: (
            comm_hooks.PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=START),
            comm_hooks.batched_powerSGD_hook), False),
    }


def timed_step(ddp, opt, local_only: bool, x, y) -> float:
    dist.barrier()  # start together: time this step, not the previous one's stragglers
    start = time.perf_counter()
    with ddp.no_sync() if local_only else nullcontext():
        F.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return elapsed.item()


def speed(rank, world_size, psgd_rank, steps, warmup, batch):
    torch.manual_seed(0)
    model = gelu_mlp()
    runs = {}
    for name, (wrapper, options, hook, local_only) in configurations(psgd_rank).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 deprecates broadcast_buffers
            ddp = wrapper(copy.deepcopy(model), **options)
        if hook is not None:
            ddp.register_comm_hook(*hook())
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), local_only)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    names, times = list(runs), {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
            t = timed_step(*runs[name], x, y)
            if i >= warmup:
                times[name].append(t)
    sent = {}
    for name, (ddp, opt, local_only) in runs.items():
        if name.startswith("miniddp"):
            with comm_hooks.count_bytes() as counted:
                timed_step(ddp, opt, local_only, x, y)
            sent[name] = counted.by_op
    return {"times": times, "bytes": sent, "buckets": {n: len(d.bucket_assignment) for n, (d, _, _) in runs.items()
                                                       if hasattr(d, "bucket_assignment")}}


def accuracy(rank, world_size, hook, psgd_rank, steps, out):
    cfg = miniddp.TrainingConfig(output_dir=out, model="mlp", max_steps=steps, per_device_train_batch_size=16,
                                 learning_rate=3e-3, logging_steps=steps, disable_tqdm=True, ddp_comm_hook=hook,
                                 ddp_comm_powersgd_rank=psgd_rank, ddp_comm_powersgd_start_iter=10)
    trainer = miniddp.Trainer(args=cfg, **make_task(cfg))
    with comm_hooks.count_bytes() as counted:
        metrics = trainer.train()
    return {k: metrics[k] for k in ("eval_loss", "eval_accuracy", "train_loss")} | {"bytes": counted.total / steps}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank")
    parser.add_argument("--accuracy-steps", type=int, default=300)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    [result, _] = run_on_ranks(speed, 2, args=(args.rank, args.steps, args.warmup, args.batch), timeout=3600)
    times = result["times"]
    base, theirs_psgd = times["torch fp32"], times[f"torch PowerSGD r{args.rank} (100 MB bucket)"]
    rows = []
    for name, ts in times.items():
        rows.append({"config": name, "median_step_ms": 1e3 * statistics.median(ts),
                     "ratio_vs_torch_fp32": statistics.median(a / b for a, b in zip(ts, base)),
                     "ratio_vs_torch_powersgd": statistics.median(a / b for a, b in zip(ts, theirs_psgd)),
                     "bytes_per_step": sum(result["bytes"].get(name, {}).values()) or None,
                     "buckets": result["buckets"].get(name)})
    pairs = {"miniddp fp32": "torch fp32", "miniddp fp16": "torch fp16"}
    same_hook = {a: statistics.median(x / y for x, y in zip(times[a], times[b])) for a, b in pairs.items()}
    acc = []
    for hook in ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd"):
        for r in ((1, args.rank) if hook == "power_sgd" else (1,)):
            with tempfile.TemporaryDirectory() as out:
                [res, _] = run_on_ranks(accuracy, 2, args=(hook, r, args.accuracy_steps, out), init=False, timeout=900)
            acc.append({"hook": hook, "rank": r if "power" in hook else None, **res})
    report = {"args": vars(args), "torch": torch.__version__, "load_average_1min": [load_before, os.getloadavg()[0]],
              "speed": rows, "same_hook_ratio": same_hook, "accuracy": acc}
    (HERE / "results" / "comm_hooks.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"2 gloo ranks, torch {torch.__version__}, 6x1024 GELU MLP, {args.steps} rotating rounds, "
          f"load average before/after {report['load_average_1min']}\n")
    print("| configuration | buckets | step (ms) | vs torch fp32 | vs torch PowerSGD | bytes/step (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mib = f"{r['bytes_per_step'] / 2**20:.3f}" if r["bytes_per_step"] else "-"
        print(f"| {r['config']} | {r['buckets'] or '-'} | {r['median_step_ms']:.1f} | {r['ratio_vs_torch_fp32']:.3f} "
              f"| {r['ratio_vs_torch_powersgd']:.3f} | {mib} |")
    print("\nsame hook, miniddp / torch: " + ", ".join(f"{k}: {v:.3f}" for k, v in same_hook.items()))
    print(f"\nbuilt-in task, {args.accuracy_steps} steps, 2 ranks:\n")
    print("| hook | PowerSGD rank | eval loss | eval accuracy | bytes per step (mean over the run) |")
    print("|---|---|---|---|---|")
    for a in acc:
        print(f"| {a['hook']} | {a['rank'] or '-'} | {a['eval_loss']:.4f} | {a['eval_accuracy']:.4f} "
              f"| {a['bytes']:.0f} |")
    plot(report, HERE.parent / "docs" / "img" / "comm-hooks.svg")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    plt.rcParams["svg.fonttype"] = "none"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    rows = report["speed"]
    names = [r["config"] for r in rows]
    colours = ["#888888" if n.startswith("torch") else "#bbbbbb" if n == "no communication" else "#3f51b5"
               for n in names]
    left.barh(names, [r["median_step_ms"] for r in rows], color=colours)
    for i, r in enumerate(rows):
        left.text(r["median_step_ms"], i, f" {r['ratio_vs_torch_fp32']:.2f}x", va="center", fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("median step (ms); label: ratio to torch fp32")
    left.set_title("step time, 2 gloo ranks (grey: torch, blue: miniddp)", fontsize=10)
    acc = report["accuracy"]
    labels = [a["hook"] + (f" r{a['rank']}" if a["rank"] else "") for a in acc]
    right.bar(labels, [a["eval_accuracy"] for a in acc], color="#3f51b5")
    for i, a in enumerate(acc):
        right.text(i, a["eval_accuracy"], f"{a['eval_accuracy']:.3f}\nloss {a['eval_loss']:.3f}", ha="center",
                   va="bottom", fontsize=7)
    right.set_ylim(0, 1.1)
    right.tick_params(axis="x", labelrotation=30, labelsize=8)
    right.set_title(f"built-in task: eval accuracy after {report['args']['accuracy_steps']} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
