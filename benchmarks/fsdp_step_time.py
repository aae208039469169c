"""FSDP's step time: ``miniddp.fully_shard`` against torch's ``fully_shard`` (FSDP2), with DDP and ZeRO-2 beside.

Run:  python benchmarks/fsdp_step_time.py [--links loopback 1] [--rounds 12] [--chunk 4] [--candidate DIR]
      (the 1 Gbit/s link needs root: ``miniddp.testing.netlab``; about 3 minutes for both links)

Two gloo ranks train five copies of the 6x1024 GELU MLP of ``benchmarks/timeline.py`` (5.5 M fp32 parameters,
7 linear layers, batch 32 per rank, AdamW), one per variant, on the same batches:

* ``torch DDP + AdamW``: ``torch.nn.parallel.DistributedDataParallel`` (the yardstick of every ratio);
* ``miniddp DDP + AdamW``: ``miniddp.DistributedDataParallel``;
* ``ZeroOptimizer stage 2``: miniddp's DDP with ``miniddp.ZeroOptimizer(ddp, AdamW, stage=2)``;
* ``torch fully_shard``: ``torch.distributed.fsdp.fully_shard`` on each ``nn.Linear``, then on the root
  ``nn.Sequential`` (which holds no parameter of its own); defaults (``reshard_after_forward=True``), AdamW over
  its ``DTensor`` shards;
* ``miniddp fully_shard``: ``miniddp.fully_shard`` wrapped the same way, AdamW over its shards.

After a warm-up (3 steps each: both FSDPs record their order or their prefetch plan in the first) the variants take
turns in chunks of ``--chunk`` steps, in an order that rotates every round. A step is forward + backward + ``step()``
+ ``zero_grad()``, timed as ``benchmarks/zero_step_time.py`` times it (``chunk_times``: a barrier and one untimed
step, then each step from the end of the one before, so what a step leaves in flight is paid by the next; the
slower rank's time). Per round, a variant's time is the median of its chunk; a ratio is the median over rounds of
the per-round ratio, with its quartiles: every variant against torch DDP, and miniddp's ``fully_shard`` against
torch's. ``--links loopback`` runs the two ranks on this machine's loopback; ``1`` runs them in two network
namespaces joined by a veth shaped to 1 Gbit/s (tbf), and then measures what rank 0's interface sent per step of
each variant (``tx_bytes``, headers included, over 4 consecutive steps after the rounds). Each rank calls
``torch.set_num_threads(1)``. ``--candidate DIR`` adds ``fully_shard`` of another checkout's ``miniddp`` to the
same interleaving, to measure a change against this one; ``--leave-out`` drops reference variants. Sanity, not a
claim: after the run every variant's full parameters are compared with torch DDP's (the same steps on the same
batches), beside how far those moved from the initial ones.
Writes ``benchmarks/results/fsdp_step_time.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zero_bytes import sent_on_the_wire  # noqa: E402  (one way to read the lab's interface)
from zero_step_time import chunk_times, quartiles, step  # noqa: E402  (one timing rule, one quartile rule)

VARIANTS = ["torch DDP + AdamW", "miniddp DDP + AdamW", "ZeroOptimizer stage 2", "torch fully_shard",
            "miniddp fully_shard"]
REFERENCE = "torch DDP + AdamW"
PAIR = ("miniddp fully_shard", "torch fully_shard")  # the claim: the first's step at most the second's
LR = 1e-4
WIRE_STEPS = 4  # consecutive steps over which the net lab's bytes per step are averaged


def variants(candidate: str | None, leave_out: list[str] = ()) -> list[str]:
    return [v for v in VARIANTS if v not in leave_out] + (["candidate miniddp fully_shard"] if candidate else [])


def build(name: str, model: torch.nn.Module, candidate: str | None = None):
    """``(module, optimizer)`` of variant ``name`` on a copy of ``model`` (``candidate ...``: that checkout's)."""
    miniddp, name = miniddp_of(name, candidate), name.removeprefix("candidate ")
    model = copy.deepcopy(model)
    if name == "torch DDP + AdamW":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)
    if name == "miniddp DDP + AdamW":
        ddp = miniddp.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)
    if name == "ZeroOptimizer stage 2":
        ddp = miniddp.DistributedDataParallel(model)
        return ddp, miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=2, lr=LR)
    if name == "torch fully_shard":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = miniddp.fully_shard
    for layer in model:  # each Linear a unit, then the root (GELUs have no parameters)
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def miniddp_of(name: str, candidate: str | None):
    """This checkout's ``miniddp``, or the candidate checkout's for a ``candidate ...`` variant."""
    import miniddp

    if not name.startswith("candidate"):
        return miniddp
    from ddp_vs_torch import load_baseline

    return sys.modules.get("miniddp_baseline") or load_baseline(candidate)


def full_parameters(name: str, module: torch.nn.Module, candidate: str | None = None) -> dict:
    """Every parameter of ``module`` as one full tensor, by its name in the plain model (a collective for FSDP)."""
    if name.endswith("miniddp fully_shard"):
        return dict(miniddp_of(name, candidate).full_state_dict(module))
    if name == "torch fully_shard":
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
    return {k.removeprefix("module."): v for k, v in module.state_dict().items()}


def train(rank: int, world_size: int, rounds: int, chunk: int, warmup: int, batch: int,
          candidate: str | None = None, leave_out: list[str] = ()) -> dict:
    """On each rank: every variant on one copy of the model, chunks taking turns; per-round times."""
    from timeline import gelu_mlp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gelu_mlp()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    names = variants(candidate, leave_out)
    runs = {name: build(name, model, candidate) for name in names}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    for name in names:
        for _ in range(warmup):
            step(*runs[name], x, y)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            times[name].append(chunk_times(*runs[name], x, y, chunk))
    wire = {}  # in the net lab: what this rank's interface sent per step, headers included
    if "GLOO_SOCKET_IFNAME" in os.environ:
        for name in names:  # consecutive steps: what one leaves in flight for the next is counted once, roughly
            step(*runs[name], x, y)
            before = sent_on_the_wire()
            for _ in range(WIRE_STEPS):
                step(*runs[name], x, y)
            wire[name] = (sent_on_the_wire() - before) / WIRE_STEPS
    full = {name: full_parameters(name, module, candidate) for name, (module, _) in runs.items()}
    reference = full[REFERENCE]
    drift = {name: max((p[k] - reference[k]).abs().max().item() for k in reference) for name, p in full.items()}
    moved = max((reference[k] - initial[k]).abs().max().item() for k in initial)  # not a vacuous match
    return {"times": times, "wire_bytes": wire, "max_abs_diff_from_torch_ddp": drift, "moved_from_init": moved,
            "numel": sum(p.numel() for p in model.parameters())}


def ratio(times: dict, a: str, b: str) -> dict:
    """The per-round ratios a / b of the chunks' medians: their median and quartiles."""
    per_round = {name: [statistics.median(c) for c in times[name]] for name in (a, b)}
    ratios = [x / y for x, y in zip(per_round[a], per_round[b])]
    q1, q2, q3 = quartiles(ratios)
    return {"median": q2, "q1": q1, "q3": q3, "ratios": ratios}


def summarise(result: dict) -> dict:
    """Per variant: median step (ms) and its ratio to torch DDP; and the pair miniddp / torch ``fully_shard``."""
    times = result["times"]
    out = {name: {"step_ms": 1e3 * statistics.median(s for c in times[name] for s in c),
                  "vs_torch_ddp": ratio(times, name, REFERENCE),
                  "wire_mib": result["wire_bytes"][name] / 2**20 if name in result["wire_bytes"] else None,
                  "max_abs_diff_from_torch_ddp": result["max_abs_diff_from_torch_ddp"][name]} for name in times}
    out["pair"] = ratio(times, *PAIR)
    if "candidate miniddp fully_shard" in times:
        out["candidate pair"] = ratio(times, "candidate miniddp fully_shard", PAIR[0])
    return out


def worker(args) -> None:
    """One rank in the net lab (torchrun's variables set by the lab): rank 0 prints the result as JSON."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    result = train(dist.get_rank(), 2, args.rounds, args.chunk, args.warmup, args.batch, args.candidate,
                   args.leave_out)
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "1"],
                        help="loopback, and/or link rates in Gbit/s through the net lab")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per variant before the rounds")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--candidate", metavar="DIR", help="a checkout whose fully_shard runs beside this one")
    parser.add_argument("--leave-out", nargs="+", default=[], help="variants not to run (not the reference, the pair)",
                        choices=[v for v in VARIANTS if v not in PAIR + (REFERENCE,)])
    parser.add_argument("--json", type=Path, default=HERE / "results" / "fsdp_step_time.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    links = {}
    for link in args.links:
        if link == "loopback":
            from miniddp.launching.spawn import run_on_ranks

            result = run_on_ranks(train, 2, args=(args.rounds, args.chunk, args.warmup, args.batch, args.candidate,
                                                  args.leave_out), timeout=900)[0]
        else:
            from miniddp.testing import netlab

            why = netlab.unavailable()
            if why:
                sys.exit(f"benchmarks/fsdp_step_time.py: {why}")
            argv = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--chunk", str(args.chunk),
                    "--warmup", str(args.warmup), "--batch", str(args.batch)]
            argv += ["--candidate", args.candidate] if args.candidate else []
            argv += ["--leave-out", *args.leave_out] if args.leave_out else []
            with netlab.net_lab(2, rate_gbit=float(link)) as lab:
                out = lab.run_ranks(argv, timeout=900, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
            result = json.loads(out[0].strip().splitlines()[-1])
        links[link] = {**summarise(result), "numel": result["numel"], "moved_from_init": result["moved_from_init"],
                       "times": result["times"]}
        load.append(os.getloadavg()[0])
        print(f"{link}: done at {time.perf_counter() - started:.0f} s", flush=True)
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"torch": torch.__version__, "date": datetime.date.today().isoformat(), "commit": commit, "world_size": 2,
              "model": "gelu_mlp(1024, 6)", "args": {k: str(v) for k, v in vars(args).items()},
              "load_average_1min": load, "wall_s": time.perf_counter() - started, "links": links}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n2 gloo ranks, gelu_mlp 6x1024 ({next(iter(links.values()))['numel']:,} parameters), AdamW, "
          f"{args.rounds} rounds x {args.chunk} steps; ratio = median of per-round ratios (IQR)\n")
    label = lambda k: "loopback" if k == "loopback" else f"{k} Gbit/s"  # noqa: E731
    print("| variant | " + " | ".join(f"{label(k)}: step ms, ratio to torch DDP (IQR)" for k in links) + " |")
    print("|---|" + "---|" * len(links))
    cell = lambda r: f"**{r['median']:.3f}** ({r['q1']:.3f} – {r['q3']:.3f})"  # noqa: E731
    for name in variants(args.candidate, args.leave_out):
        print(f"| {name} | " + " | ".join(f"{s[name]['step_ms']:.1f} · {cell(s[name]['vs_torch_ddp'])}"
                                          + (f" · {s[name]['wire_mib']:.1f} MiB" if s[name]["wire_mib"] else "")
                                          for s in links.values()) + " |")
    print(f"| {PAIR[0]} / {PAIR[1]} | " + " | ".join(cell(s["pair"]) for s in links.values()) + " |")
    if args.candidate:
        print(f"| candidate {PAIR[0]} / {PAIR[0]} | " + " | ".join(cell(s["candidate pair"]) for s in links.values())
              + " |")
    names = variants(args.candidate, args.leave_out)
    drift = max(s[name]["max_abs_diff_from_torch_ddp"] for s in links.values() for name in names)
    moved = min(s["moved_from_init"] for s in links.values())
    print(f"\nlargest parameter difference from torch DDP after the run: {drift:.2e} (its parameters moved up to "
          f"{moved:.2e} from the initial ones); load average {load}")
    print(f"wrote {args.json} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
