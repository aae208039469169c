"""``benchmarks/network.py``'s analysis: medians, the cost model's predictions, the crossover, ``"auto"``'s pick.

Kept apart from the measurement, which needs root: ``python benchmarks/network_analysis.py [JSON]``
re-analyses the raw samples recorded in ``benchmarks/results/network.json`` (its ``links``),
prints the table and redraws the plot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from miniddp.engine.alpha_beta import AlphaBeta, fit_alpha_beta  # noqa: E402
from miniddp.engine.costmodel import Compression, predict_step_time, with_bucket_copies  # noqa: E402
from miniddp.engine.step_profile import StepProfile  # noqa: E402

PSGD = "PowerSGD r4"


def _fit(points) -> AlphaBeta:
    return fit_alpha_beta([b for b, _ in points], [t for _, t in points])


def _profile(events_by_rank, named) -> StepProfile:
    """The plain model's traced steps, ranks combined into the slowest, each field's median."""
    med = statistics.median
    steps = [StepProfile.slowest([StepProfile.from_events(ev[i], named) for ev in events_by_rank])
             for i in range(len(events_by_rank[0]))]
    return dataclasses.replace(steps[0], forward_s=med(p.forward_s for p in steps),
                               ready_s=[med(r) for r in zip(*(p.ready_s for p in steps))],
                               tail_s=med(p.tail_s for p in steps), optimizer_s=med(p.optimizer_s for p in steps),
                               compute_end_s=med(p.compute_end_s for p in steps))


HOOKS = ("miniddp fp16", "miniddp bf16", f"miniddp {PSGD}", f"torch {PSGD}")


def _model(name: str, compute: dict, auto_cap):
    """(bucket_cap_mb, Compression) of a configuration, as the simulation sees it; ``compute[name]``: a
    hook's compute per gradient byte."""
    if name.startswith("miniddp fp32 cap "):
        return float(name.rsplit(" ", 1)[1]), None
    per_byte = compute.get(name, 0.0)
    fp16 = Compression("fp16", wire_ratio=0.5, compute_s_per_byte=per_byte)
    return {"torch fp32": (None, None), "miniddp fp32": (None, None), "miniddp fp32 auto": (auto_cap, None),
            "miniddp fp16": (None, fp16), "miniddp bf16": (None, dataclasses.replace(fp16, name="bf16")),
            f"miniddp {PSGD}": (None, Compression("powersgd", powersgd_rank=4, collectives=2,
                                                  compute_s_per_byte=per_byte)),
            f"torch {PSGD}": (100, Compression("powersgd", powersgd_rank=4, collectives=3,
                                               compute_s_per_byte=per_byte)),
            }[name]


def _predict(name, profile, ab, overlap, compute, auto_cap) -> float:
    """``profile``: the plain model's step (compute alone)."""
    if name == "no communication":
        return profile.forward_s + profile.backward_s + profile.tail_s + profile.optimizer_s
    cap, hook = _model(name, compute, auto_cap)
    return predict_step_time(with_bucket_copies(profile, compute["copy_s_per_byte"]), ab, cap, overlap, hook).step_s


def calibrate_hooks(res: dict, profile, ab, compute: dict) -> dict:
    """Each hook's compute per gradient byte, measured once, in its steps on one link: the measured step
    beyond the replay with no hook compute. (The hook's arithmetic timed alone, ``compute_costs``, is
    a fraction of it: in a step it also waits for the other rank, its threads and the GIL.)"""
    grad_bytes = sum(profile.nbytes)
    out = dict(compute)
    for name in HOOKS:
        zero = _predict(name, profile, ab, res["overlap_cost"], {**compute, name: 0.0}, None)
        out[name] = max(0.0, statistics.median(res["times"][name]) - zero) / grad_bytes
    return out


def _crossing(rates, values) -> float | None:
    """Where ``values`` (PowerSGD / torch fp32, by rate) first crosses 1 going up, log-interpolated."""
    for (r0, v0), (r1, v1) in zip(zip(rates, values), zip(rates[1:], values[1:])):
        if v0 <= 1 < v1:
            return math.exp(math.log(r0) + (1 - v0) / (v1 - v0) * (math.log(r1) - math.log(r0)))
    return None


def analyse(links: dict) -> dict:
    """``links``: each link's raw results from the ranks (``network.py``'s worker), by rate."""
    from timeline import gelu_mlp

    named = list(gelu_mlp().named_parameters())
    host = _fit(links["None"]["points"])  # unshaped: what the hosts themselves cost per byte
    # DDP's copies (timed alone) and each hook's compute (in its steps), measured once: on the unshaped link
    compute = calibrate_hooks(links["None"], _profile(links["None"]["events"], named), host, links["None"]["compute"])
    rows, auto, fits, profiles = [], {}, {}, {}
    for key, res in links.items():
        gbit = None if key == "None" else float(key)
        ab, profile = _fit(res["points"]), _profile(res["events"], named)
        fits[key], profiles[key] = ab, profile
        base = res["times"]["torch fp32"]
        for name, ts in res["times"].items():
            predicted = _predict(name, profile, ab, res["overlap_cost"], compute, res["auto_cap_mb"])
            measured = statistics.median(ts)
            cap = _model(name, compute, res["auto_cap_mb"])[0] if name != "no communication" else None
            rows.append({"link_gbit": gbit, "config": name, "bucket_cap_mb": cap, "measured_ms": 1e3 * measured,
                         "predicted_ms": 1e3 * predicted, "error": predicted / measured - 1,
                         "ratio_vs_torch_fp32": statistics.median(a / b for a, b in zip(ts, base)),
                         "bytes_per_step": res["bytes"].get(name), "samples_ms": [1e3 * t for t in ts]})
        sweep = {r["bucket_cap_mb"]: r["measured_ms"] for r in rows
                 if r["link_gbit"] == gbit and r["config"].startswith("miniddp fp32 cap ")}
        best = min(sweep, key=sweep.get)
        chosen = next(r for r in rows if r["link_gbit"] == gbit and r["config"] == "miniddp fp32 auto")
        auto[key] = {"chosen_cap_mb": res["auto_cap_mb"], "chosen_measured_ms": chosen["measured_ms"],
                     "best_cap_mb": best, "best_measured_ms": sweep[best],
                     "chosen_over_best": chosen["measured_ms"] / sweep[best]}
    shaped = [float(k) for k in links if k != "None"]
    ratio = {r["link_gbit"]: r["ratio_vs_torch_fp32"] for r in rows if r["config"] == f"miniddp {PSGD}"}
    # the link's efficiency (payload over rate), from the slowest link's fit; then any rate is predictable
    slow = min(shaped)
    efficiency = 8 / (slow * 1e9 * fits[str(slow)].beta_s_per_byte)

    def predicted_ratio(rate: float) -> float:
        near = min(shaped, key=lambda r: abs(math.log(r / rate)))  # the overlap cost of the nearest link
        ab, cost = host.on_link(rate, efficiency), links[str(near)]["overlap_cost"]
        steps = [_predict(n, profiles[str(near)], ab, cost, compute, None) for n in (f"miniddp {PSGD}", "torch fp32")]
        return steps[0] / steps[1]

    grid = [0.25 * 2 ** (i / 8) for i in range(8 * 10)]  # 0.25 .. 256 Gbit/s
    return {"rows": rows, "auto": auto, "compute": compute, "link_efficiency": efficiency,
            "profile_ms": {k: {"forward": 1e3 * p.forward_s, "backward": 1e3 * p.backward_s, "tail": 1e3 * p.tail_s,
                               "optimizer": 1e3 * p.optimizer_s} for k, p in profiles.items()},
            "alpha_beta": {k: {"alpha_us": ab.alpha_us, "beta_ns_per_byte": 1e9 * ab.beta_s_per_byte,
                               "algbw_Gbit": 8 * ab.algbw_GBps, "overlap_cost": links[k]["overlap_cost"]}
                           for k, ab in fits.items()},
            "crossover_gbit": {"measured": _crossing(shaped, [ratio[r] for r in shaped]),
                               "predicted": _crossing(grid, [predicted_ratio(r) for r in grid]),
                               # no crossing among the shaped links, but PowerSGD loses unshaped: above the fastest
                               "measured_above": max(shaped) if ratio[max(shaped)] <= 1 < ratio[None] else None},
            "predicted_powersgd_ratio": {f"{r:g}": predicted_ratio(r) for r in (0.5, 1, 2, 3, 5, 10, 25, 100)}}


def print_table(report: dict) -> None:
    links = sorted({r["link_gbit"] or math.inf for r in report["rows"]})
    print("| configuration | " + " | ".join("unshaped" if g == math.inf else f"{g:g} Gbit/s" for g in links) + " |")
    print("|---|" + "---|" * len(links))
    for name in dict.fromkeys(r["config"] for r in report["rows"]):
        cells = []
        for g in links:
            r = next(r for r in report["rows"] if r["config"] == name and (r["link_gbit"] or math.inf) == g)
            cells.append(f"{r['measured_ms']:.0f} ms, {r['ratio_vs_torch_fp32']:.3f}x, pred. {r['error']:+.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\ncrossover (PowerSGD r4 = torch fp32): {report['crossover_gbit']}")
    print("auto: " + json.dumps(report["auto"]))
    worst = max(report["rows"], key=lambda r: abs(r["error"]))
    print(f"largest prediction error: {worst['error']:+.1%} ({worst['config']}, {worst['link_gbit']} Gbit/s)")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    plt.rcParams["svg.fonttype"] = "none"
    rows = report["rows"]
    unshaped_x = 8 * report["alpha_beta"]["None"]["algbw_Gbit"] / 8  # the veth's own rate, as gloo got it
    x_of = lambda g: g if g is not None else unshaped_x  # noqa: E731
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    shown = ["torch fp32", "miniddp fp32", "miniddp fp16", "miniddp bf16", f"miniddp {PSGD}", f"torch {PSGD}",
             "no communication"]
    for i, name in enumerate(shown):
        rs = sorted((r for r in rows if r["config"] == name), key=lambda r: x_of(r["link_gbit"]))
        xs = [x_of(r["link_gbit"]) for r in rs]
        line, = left.plot(xs, [r["measured_ms"] for r in rs], "o-", label=name, color=f"C{i}")
        left.plot(xs, [r["predicted_ms"] for r in rs], "x--", color=line.get_color(), alpha=0.7)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("link rate (Gbit/s; rightmost: the unshaped veth, as gloo measured it)")
    left.set_ylabel("step time (ms)")
    left.set_title("2 gloo ranks, 6x1024 GELU MLP: measured (o), predicted (x, dashed)", fontsize=10)
    left.legend(fontsize=7)
    left.grid(alpha=0.3, which="both")
    for j, g in enumerate(sorted({r["link_gbit"] or math.inf for r in rows})):
        sweep = sorted((r for r in rows if r["config"].startswith("miniddp fp32 cap ")
                        and (r["link_gbit"] or math.inf) == g), key=lambda r: r["bucket_cap_mb"])
        label = "unshaped" if g == math.inf else f"{g:g} Gbit/s"
        line, = right.plot([r["bucket_cap_mb"] for r in sweep], [r["measured_ms"] for r in sweep], "o-", label=label)
        right.plot([r["bucket_cap_mb"] for r in sweep], [r["predicted_ms"] for r in sweep], "x--",
                   color=line.get_color(), alpha=0.7)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("bucket_cap_mb")
    right.set_title("the bucket-size trade-off per link: measured (o), predicted (x)", fontsize=10)
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":  # re-analyse a recorded run
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "network.json"
    recorded = json.loads(path.read_text())
    recorded.update(analyse(recorded["links"]))
    path.write_text(json.dumps(recorded, indent=1) + "\n")
    print_table(recorded)
    plot(recorded, HERE.parent / "docs" / "img" / "network.svg")
