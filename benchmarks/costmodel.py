"""The cost model against the clock: predicted vs measured DDP step time per bucket_cap_mb.

Run:  python benchmarks/costmodel.py [--steps 60] [--caps 0.25 1 4 8 16 25 100]   (about 2 minutes)

On 2 gloo ranks of this machine (1 thread each), with the 6x1024 GELU MLP of
``benchmarks/timeline.py`` (21.1 MiB of fp32 gradients, batch 32):

1. **The network**: ``measure_all_reduce`` on the live group, 4 KiB to 32 MiB,
   ``fit_alpha_beta``; and ``measure_overlap_cost`` (how much an all-reduce slows
   compute beside it: on a CPU, gloo's threads and the backward share the cores).
2. **Measure**: one ``miniddp.DistributedDataParallel`` per cap, each on a copy
   of the same model, each with a tracer; after a warm-up (which includes the
   one-time rebuild) the caps take turns, step after step, in a rotating order.
   A step runs from the forward's start to the optimizer step's end; its time is
   the slowest rank's. ``score`` pairs each step with the same round's step at
   the reference cap, which removes most of the noise of a shared machine.
3. **Predict**: the gradient-ready times come from the steps with the
   ``--profile-cap`` (100 MB: one bucket, so nothing communicates during backward
   and the ready times are the compute alone), ranks combined with
   ``StepProfile.slowest`` and each field's median over steps taken;
   ``predict_step_time`` then gives every cap's step with free overlap, with the
   measured ``overlap_cost``, and the no-overlap closed form beside them.

Writes ``benchmarks/results/costmodel.json`` (with the load average before and
after: other jobs on the machine show up in the numbers) and
``docs/img/costmodel.svg`` (step time vs bucket_cap_mb, measured and predicted,
and each model's error).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path

import torch

import miniddp
from miniddp.costmodel.alpha_beta import fit_alpha_beta, measure_all_reduce, measure_overlap_cost
from miniddp.costmodel.simulate import assignment_in_ready_order, naive_step_time, predict_step_time
from miniddp.costmodel.step_profile import StepProfile
from miniddp.diagnostics.trace import Tracer, step_summary
from miniddp.launching.spawn import run_on_ranks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from timeline import gelu_mlp, traced_step  # noqa: E402  (the same workload as the timeline)

SIZES = [2**12, 2**16, 2**18, 2**20, 2**22, 2**24, 2**25]  # bytes: 4 KiB .. 32 MiB


def bench(rank, world_size, caps, steps, warmup, batch, reps):
    points = measure_all_reduce(SIZES, reps=reps)
    overlap_cost = measure_overlap_cost(2**22, reps=reps)
    torch.manual_seed(0)
    model = gelu_mlp()
    runs = {}
    for cap in caps:
        tracer = Tracer(rank)
        ddp = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap, tracer=tracer)
        runs[cap] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), tracer)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    events = {cap: [] for cap in caps}
    for i in range(warmup + steps):
        order = caps[i % len(caps):] + caps[:i % len(caps)]  # rotate who goes first
        for cap in order:
            ev = traced_step(runs[cap][0], runs[cap][1], x, y, runs[cap][2])
            if i >= warmup:
                events[cap].append(ev)
    return {"points": points, "overlap_cost": overlap_cost, "events": events,
            "buckets": {cap: runs[cap][0].bucket_assignment for cap in caps}}


def median_profile(profiles: list[StepProfile]) -> StepProfile:
    """Each field's median over steps (one noisy step should not decide the prediction)."""
    med = statistics.median
    return StepProfile(med(p.forward_s for p in profiles), [med(r) for r in zip(*(p.ready_s for p in profiles))],
                       profiles[0].numels, profiles[0].dtypes, med(p.tail_s for p in profiles),
                       med(p.optimizer_s for p in profiles), med(p.compute_end_s for p in profiles))


def analyse(results, caps, profile_cap):
    points = results[0]["points"]
    ab = fit_alpha_beta([b for b, _ in points], [t for _, t in points], world_size=len(results))
    model = gelu_mlp()
    steps = len(results[0]["events"][profile_cap])
    profiles = [StepProfile.slowest([StepProfile.from_events(r["events"][profile_cap][i], model.named_parameters())
                                     for r in results]) for i in range(steps)]
    profile = median_profile(profiles)
    cost = results[0]["overlap_cost"]
    rows = []
    for cap in caps:
        per_step = [[step_summary(r["events"][cap][i]) for r in results] for i in range(steps)]
        measured = [max(s["step_s"] for s in ranks) for ranks in per_step]
        exposed = [min(s["exposed_comm_s"] for s in ranks) for ranks in per_step]  # vs the latest backward's end
        pred = predict_step_time(profile, ab, cap)
        shared = predict_step_time(profile, ab, cap, overlap_cost=cost)
        naive = naive_step_time(profile, assignment_in_ready_order(profile, cap), ab)
        rows.append({"bucket_cap_mb": cap, "buckets": len(pred.launch_s),
                     "buckets_ddp": len(results[0]["buckets"][cap]), "predicted_ms": pred.step_s * 1e3,
                     "shared_ms": shared.step_s * 1e3, "naive_ms": naive * 1e3,
                     "measured_exposed_ms": statistics.median(exposed) * 1e3,
                     "predicted_exposed_ms": pred.exposed_comm_s * 1e3, "predicted_comm_ms": pred.comm_s * 1e3,
                     "measured_ms_per_step": [t * 1e3 for t in measured]})
    grad_bytes = sum(profile.nbytes)
    one_bucket = next(e for e in results[0]["events"][profile_cap][0] if e["name"] == "bucket launched")
    return {
        "alpha_beta": {"alpha_us": ab.alpha_us, "beta_ns_per_byte": ab.beta_s_per_byte * 1e9,
                       "algbw_GBps": ab.algbw_GBps, "busbw_GBps": ab.busbw_GBps,
                       "points": [{"bytes": b, "median_ms": t * 1e3, "fit_ms": ab.seconds(b) * 1e3}
                                  for b, t in points]},
        "profile_ms": {"forward": profile.forward_s * 1e3, "backward_compute": profile.backward_s * 1e3,
                       "tail": profile.tail_s * 1e3, "optimizer": profile.optimizer_s * 1e3,
                       "compute_only_step": (profile.forward_s + profile.backward_s + profile.tail_s
                                             + profile.optimizer_s) * 1e3,
                       "all_gradients_one_all_reduce": ab.seconds(grad_bytes) * 1e3},
        "grad_mb": grad_bytes / 2**20, "profile_cap": profile_cap, "one_bucket_bytes": one_bucket["bytes"],
        "overlap_cost": cost, "rows": rows,
    }


def score(report) -> dict:
    """The measured step per cap, robust to this machine's noise: each round's step over the same
    round's step at the profile cap (the caps take turns, so a busy moment hits a whole round), the
    median of those ratios times the profile cap's median step. Then each model's error and pick."""
    rows = report["rows"]
    ref = next(r for r in rows if r["bucket_cap_mb"] == report["profile_cap"])["measured_ms_per_step"]
    scale = statistics.median(ref)
    for r in rows:
        ratios = [t / u for t, u in zip(r["measured_ms_per_step"], ref)]
        q = statistics.quantiles(ratios, n=4)
        r["measured_median_ms"] = statistics.median(r["measured_ms_per_step"])  # unpaired, for the record
        r["measured_ms"], r["measured_iqr_ms"] = statistics.median(ratios) * scale, [q[0] * scale, q[2] * scale]
        for error, model in (("error", "predicted_ms"), ("shared_error", "shared_ms"), ("naive_error", "naive_ms")):
            r[error] = r[model] / r["measured_ms"] - 1
    for best, key in (("best_measured", "measured_ms"), ("best_predicted", "predicted_ms"),
                      ("best_shared", "shared_ms"), ("best_naive", "naive_ms")):
        report[best] = min(rows, key=lambda r: r[key])["bucket_cap_mb"]
    return report


def picks(report) -> dict:
    """Each model's best cap, and what it costs, measured, against the measured best."""
    rows = {r["bucket_cap_mb"]: r for r in report["rows"]}
    best = min(r["measured_ms"] for r in rows.values())
    return {name: (cap, rows[cap]["measured_ms"] / best - 1) for name, cap in
            (("free overlap", report["best_predicted"]), ("overlap_cost", report["best_shared"]),
             ("no overlap", report["best_naive"]))}


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    caps = [r["bucket_cap_mb"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    meas = [r["measured_ms"] for r in rows]
    err = [[m - r["measured_iqr_ms"][0] for m, r in zip(meas, rows)],
           [r["measured_iqr_ms"][1] - m for m, r in zip(meas, rows)]]
    left.errorbar(caps, meas, yerr=err, fmt="o-", color="black", capsize=3,
                  label="measured (median, IQR, paired with ref.)")
    left.plot(caps, [r["predicted_ms"] for r in rows], "s-", color="tab:blue", label="simulation, free overlap")
    left.plot(caps, [r["shared_ms"] for r in rows], "^-", color="tab:orange",
              label=f"simulation, overlap_cost={report['overlap_cost']:.2f} (measured)")
    left.plot(caps, [r["naive_ms"] for r in rows], "--", color="tab:gray", label="no overlap (compute + Σ comm)")
    left.axhline(report["profile_ms"]["compute_only_step"], color="tab:green", ls=":", label="compute alone")
    left.set_xscale("log")
    left.set_xticks(caps, [f"{c:g}" + ("\n(ref.)" if c == report["profile_cap"] else "") for c in caps])
    left.set_xlabel("bucket_cap_mb")
    left.set_ylabel("step time (ms)")
    left.set_ylim(bottom=0)
    chosen = ", ".join(f"{name} {cap:g} ({100 * lost:+.0f}%)" for name, (cap, lost) in picks(report).items())
    left.set_title(f"6x1024 GELU MLP, 2 gloo ranks: best cap measured {report['best_measured']:g}\n"
                   f"each model's pick (its measured step vs the best):\n{chosen}", fontsize=9)
    left.legend(fontsize=8, loc="lower left")
    left.grid(alpha=0.3)
    at = range(len(caps))
    right.axhspan(-15, 15, color="tab:green", alpha=0.1, label="±15% (the goal)", zorder=0)
    for shift, key, colour, label in ((-0.27, "error", "tab:blue", "free overlap"),
                                      (0, "shared_error", "tab:orange", "measured overlap_cost"),
                                      (0.27, "naive_error", "tab:gray", "no overlap")):
        right.bar([i + shift for i in at], [100 * r[key] for r in rows], width=0.27, color=colour, label=label)
    right.axhline(0, color="black", lw=0.8)
    right.set_xticks(range(len(caps)), [f"{c:g}" for c in caps])
    right.set_xlabel("bucket_cap_mb")
    right.set_ylabel("(predicted − measured) / measured, %")
    right.set_title("the model's error", fontsize=10)
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", type=float, nargs="+", default=[0.25, 1, 4, 8, 16, 25, 100])
    parser.add_argument("--profile-cap", type=float, default=100)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15, help="all-reduce repetitions per size")
    parser.add_argument("--svg", type=Path, default=HERE.parent / "docs" / "img" / "costmodel.svg")
    args = parser.parse_args()
    caps = sorted(set(args.caps) | {args.profile_cap})
    load_before = os.getloadavg()[0]  # other work on the machine: the numbers are only as quiet as it was
    results = run_on_ranks(bench, 2, args=(caps, args.steps, args.warmup, args.batch, args.reps), timeout=900)
    report = {"args": {**vars(args), "svg": str(args.svg)}, "torch": torch.__version__,
              "load_average_1min": [load_before, os.getloadavg()[0]], **analyse(results, caps, args.profile_cap)}
    score(report)
    (HERE / "results" / "costmodel.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.svg)

    ab, prof = report["alpha_beta"], report["profile_ms"]
    print(f"load average (1 min) before and after: {report['load_average_1min']}")
    print(f"alpha = {ab['alpha_us']:.0f} us, beta = {ab['beta_ns_per_byte']:.3f} ns/B "
          f"(algbw {ab['algbw_GBps']:.2f} GB/s, busbw {ab['busbw_GBps']:.2f} GB/s), 2 gloo ranks")
    print(f"profile (bucket_cap_mb={args.profile_cap:g}): forward {prof['forward']:.1f} ms, backward "
          f"{prof['backward_compute']:.1f} ms, copy-back {prof['tail']:.1f} ms, optimizer {prof['optimizer']:.1f} ms; "
          f"{report['grad_mb']:.1f} MiB of gradients, one all-reduce of all of them: "
          f"{prof['all_gradients_one_all_reduce']:.1f} ms\n")
    print(f"overlap_cost (measure_overlap_cost, 4 MiB): {report['overlap_cost']:.2f}\n")
    print("| bucket_cap_mb | buckets | measured (ms) | simulated, free overlap | error | with overlap_cost | error | "
          "no overlap | error | exposed measured (ms) | exposed simulated (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['bucket_cap_mb']:g} | {r['buckets']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
              f"{100 * r['error']:+.1f}% | {r['shared_ms']:.1f} | {100 * r['shared_error']:+.1f}% | "
              f"{r['naive_ms']:.1f} | {100 * r['naive_error']:+.1f}% | {r['measured_exposed_ms']:.1f} | "
              f"{r['predicted_exposed_ms']:.1f} |")
    print(f"\nbest measured: {report['best_measured']:g}; each model's pick, and its measured step against the "
          "best: " + ", ".join(f"{name} {cap:g} ({100 * lost:+.1f}%)" for name, (cap, lost) in picks(report).items()))
    print(f"wrote {HERE / 'results' / 'costmodel.json'} and {args.svg}")


if __name__ == "__main__":
    main()
