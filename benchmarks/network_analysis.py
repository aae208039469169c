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

from miniddp.costmodel.alpha_beta import AlphaBeta, fit_alpha_beta  # noqa: E402
from miniddp.costmodel.simulate import Compression, predict_step_time, with_bucket_copies  # noqa: E402
from miniddp.costmodel.step_profile import StepProfile  # noqa: E402

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


def _crossing(rates, values) -> float | None:
    """Where ``values`` (PowerSGD / torch fp32, by rate) first crosses 1 going up, log-interpolated."""
    for (r0, v0), (r1, v1) in zip(zip(rates, values), zip(rates[1:], values[1:])):
        if v0 <= 1 < v1:
            return math.exp(math.log(r0) + (1 - v0) / (v1 - v0) * (math.log(r1) - math.log(r0)))
    return None


EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, timestamps on): what tbf's rate carries


def link_model(host: AlphaBeta, rate_gbit: float | None) -> tuple[AlphaBeta, float]:
    """The α–β of a link of ``rate_gbit`` (None: unshaped) from the hosts' own cost, and its overlap cost:
    the share of an all-reduce's time the CPU works for it (the rest is waiting on the wire)."""
    ab = host if rate_gbit is None else host.on_link(rate_gbit, EFFICIENCY)
    return ab, host.beta_s_per_byte / ab.beta_s_per_byte


def calibrate(res: dict, profile, isolated: AlphaBeta, compute: dict) -> tuple[AlphaBeta, dict]:
    """Measured once, in steps on the unshaped link, where the CPU does all of the communication:
    the hosts' cost per byte *in a step* (the isolated sweep's, scaled until torch fp32's step is
    met: the ranks' backwards and the other's gloo threads share the cores and memory), and each
    hook's compute per gradient byte (its step beyond the replay with none). The hooks' arithmetic
    timed alone (``compute_costs``) is a fraction of that: in a step it also waits on threads."""
    measured = statistics.median(res["times"]["torch fp32"])
    lo, hi = 1.0, 4.0
    for _ in range(40):  # bisection on the scale of β
        mid = (lo + hi) / 2
        ab = dataclasses.replace(isolated, beta_s_per_byte=isolated.beta_s_per_byte * mid)
        lo, hi = (mid, hi) if _predict("torch fp32", profile, ab, 1.0, compute, None) < measured else (lo, mid)
    host = dataclasses.replace(isolated, beta_s_per_byte=isolated.beta_s_per_byte * lo)
    grad_bytes, out = sum(profile.nbytes), dict(compute, beta_scale_in_step=lo)
    for name in HOOKS:
        zero = _predict(name, profile, host, 1.0, {**compute, name: 0.0}, None)
        out[name] = max(0.0, statistics.median(res["times"][name]) - zero) / grad_bytes
    return host, out


def analyse(links: dict) -> dict:
    """``links``: each link's raw results from the ranks (``network.py``'s worker), by rate. Every shaped
    link is predicted from its rate and what was measured on the unshaped one (``calibrate``)."""
    from timeline import gelu_mlp

    named = list(gelu_mlp().named_parameters())
    isolated = _fit(links["None"]["points"])  # unshaped: what the hosts themselves cost per byte
    host, compute = calibrate(links["None"], _profile(links["None"]["events"], named), isolated,
                              links["None"]["compute"])
    rows, auto, fits = [], {}, {}
    for key, res in links.items():
        gbit = None if key == "None" else float(key)
        profile, (ab, overlap) = _profile(res["events"], named), link_model(host, gbit)
        fits[key] = _fit(res["points"])
        base = res["times"]["torch fp32"]
        for name, ts in res["times"].items():
            predicted = _predict(name, profile, ab, overlap, compute, res["auto_cap_mb"])
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
    profile = _profile(links["None"]["events"], named)

    def predicted_ratio(rate: float) -> float:
        ab, overlap = link_model(host, rate)
        steps = [_predict(n, profile, ab, overlap, compute, None) for n in (f"miniddp {PSGD}", "torch fp32")]
        return steps[0] / steps[1]

    grid = [0.25 * 2 ** (i / 8) for i in range(8 * 10)]  # 0.25 .. 256 Gbit/s
    return {"rows": rows, "auto": auto, "compute": compute, "link_efficiency": EFFICIENCY,
            "host_in_step": {"alpha_us": host.alpha_us, "beta_ns_per_byte": 1e9 * host.beta_s_per_byte},
            "alpha_beta": {k: {"alpha_us": ab.alpha_us, "beta_ns_per_byte": 1e9 * ab.beta_s_per_byte,
                               "algbw_Gbit": 8 * ab.algbw_GBps, "on_link_beta_ns_per_byte": 1e9 * link_model(
                                   isolated, None if k == "None" else float(k))[0].beta_s_per_byte,
                               "measured_overlap_cost": links[k]["overlap_cost"]}
                           for k, ab in fits.items()},
            "crossover_gbit": {"measured": _crossing(shaped, [ratio[r] for r in shaped]),
                               "predicted": _crossing(grid, [predicted_ratio(r) for r in grid]),
                               # no crossing among the shaped links, but PowerSGD loses unshaped: above the fastest
                               "measured_above": max(shaped) if ratio[max(shaped)] <= 1 < ratio[None] else None},
            "predicted_powersgd_ratio": {f"{r:g}": predicted_ratio(r) for r in (0.5, 1, 2, 3, 5, 10, 25, 100)}}


def markdown(report: dict) -> str:
    """The page's table: per configuration and link, the median step, its ratio to torch fp32 (median of
    per-round ratios) and the prediction's error."""
    links = sorted({r["link_gbit"] or math.inf for r in report["rows"]})
    out = ["| configuration | " + " | ".join("unshaped" if g == math.inf else f"{g:g} Gbit/s" for g in links) + " |",
           "|---|" + "---|" * len(links)]
    for name in dict.fromkeys(r["config"] for r in report["rows"]):
        cells = [next(f"{r['measured_ms']:.0f} ms · **{r['ratio_vs_torch_fp32']:.3f}** · {r['error']:+.0%}"
                      for r in report["rows"] if r["config"] == name and (r["link_gbit"] or math.inf) == g)
                 for g in links]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


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
    x_of = lambda g: g if g is not None else 30  # noqa: E731  (unshaped: drawn right of the fastest link)
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
    links = sorted({x_of(r["link_gbit"]) for r in rows})
    left.set_xticks(links, [f"{g:g}" if g != 30 else "unshaped" for g in links])
    left.minorticks_off()
    left.set_yticks([15, 20, 30, 50, 100, 200], ["15", "20", "30", "50", "100", "200"])
    left.set_xlabel("link rate (Gbit/s), tbf on both ends of a veth pair")
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
    right.minorticks_off()
    right.set_yticks([50, 70, 100, 150, 200], ["50", "70", "100", "150", "200"])
    right.set_xlabel("bucket_cap_mb")
    right.set_title("the bucket-size trade-off per link: measured (o), predicted (x)", fontsize=10)
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def at_rate(report: dict, rate_gbit: float) -> dict:
    """Every configuration's predicted step (ms) over a link of ``rate_gbit``, from a recorded run's
    unshaped link (its traced compute, and what ``calibrate`` measured there): no root, no new run."""
    from timeline import gelu_mlp

    links, named = report["links"], list(gelu_mlp().named_parameters())
    profile = _profile(links["None"]["events"], named)
    host, compute = calibrate(links["None"], profile, _fit(links["None"]["points"]), links["None"]["compute"])
    ab, overlap = link_model(host, rate_gbit)
    auto = links["None"]["auto_cap_mb"]
    return {name: 1e3 * _predict(name, profile, ab, overlap, compute, auto) for name in links["None"]["times"]}


if __name__ == "__main__":  # re-analyse a recorded run, or predict another link from it
    import argparse

    parser = argparse.ArgumentParser(description="re-analyse benchmarks/results/network.json")
    parser.add_argument("json", nargs="?", type=Path, default=HERE / "results" / "network.json")
    parser.add_argument("--rate", type=float, help="predict every configuration at this link rate (Gbit/s)")
    parser.add_argument("--markdown", action="store_true", help="print the table of docs/performance.md")
    args = parser.parse_args()
    recorded = json.loads(args.json.read_text())
    if args.markdown:
        print(markdown(recorded))
        sys.exit(0)
    if args.rate:
        measured = {r["config"]: r["measured_ms"] for r in recorded["rows"] if r["link_gbit"] == args.rate}
        print(f"| configuration | predicted at {args.rate:g} Gbit/s (ms) | measured there (ms) |\n|---|---|---|")
        for name, ms in at_rate(recorded, args.rate).items():
            print(f"| {name} | {ms:.0f} | {f'{measured[name]:.0f}' if name in measured else '-'} |")
        sys.exit(0)
    recorded.update(analyse(recorded["links"]))
    args.json.write_text(json.dumps(recorded, indent=1) + "\n")
    print_table(recorded)
    plot(recorded, HERE.parent / "docs" / "img" / "network.svg")
