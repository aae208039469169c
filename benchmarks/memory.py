"""DDP's memory per rank, measured on CPU, and what ZeRO / FSDP would shard instead.

Run:  python benchmarks/memory.py [--steps 3] [--batch 32]
      python benchmarks/memory.py --zero [zero_memory.py's options]   (ZeRO stages 0-2 on 1-4 ranks instead)

DDP keeps a *full* copy of everything on every rank: parameters, gradients,
optimizer state, plus the flat bucket buffers the all-reduce works on. This
script measures that, per rank, on 2 gloo ranks and the 6x1024 GELU MLP of
``benchmarks/timeline.py`` (5.5 M fp32 parameters, 22 MB), with Adam (two
states per parameter), for:

* ``miniddp.DistributedDataParallel`` and ``torch.nn.parallel.DistributedDataParallel``,
* each with ``gradient_as_bucket_view`` False and True,
* torch's DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1).

How, with no ``torch.cuda.max_memory_allocated`` on a CPU:

1. **Count storages.** After ``optimizer.step()`` (gradients still set), walk
   what Python can reach: parameters, their ``.grad``, the optimizer's state
   and miniddp's ``reducer.buckets[i].buffer``. Each distinct storage is counted
   once, in the first category that reaches it (buckets before gradients, so a
   ``.grad`` that is a view into a bucket costs nothing extra).
2. **Ask malloc.** torch's CPU allocator takes its memory from glibc's malloc, so
   ``mallinfo2()`` (bytes in use: ``uordblks + hblkhd``, all arenas), read before
   the model is built and after the step, is everything the rank holds for it,
   *including* what Python cannot reach: torch DDP's bucket buffers live in C++
   (``reducer.cpp``). Their size comes from torch's own log
   (``_get_ddp_logging_data()["rebuilt_bucket_sizes"]``) unless ``.grad`` views
   reach them; ``other`` = malloc's total minus every counted category. It is
   the same few MB (autograd, gloo, Python objects) for every variant, so the
   bucket bytes that malloc sees in torch's C++ are what the log says.

Writes ``benchmarks/results/memory.json`` and ``docs/img/memory.svg``. ``--zero`` runs
``benchmarks/zero_memory.py`` instead: ZeRO stages 0, 1 and 2 (miniddp's ``ZeroOptimizer``) and torch's
stage 1 on 1 to 4 ranks, counted with ``count_storages`` beside ``zero_bytes_per_rank``, and the peak during
training from malloc's high-water mark. It is a script of its own (another model, another axis: world size,
one process pair per variant since the mark only rises); this file keeps what the tests import.
Activations are not included: they are freed by the end of the step, and
depend on the batch, not on DDP.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).parent
ROOT = HERE.parent
MB = 1e6  # decimal megabytes, as the ZeRO paper's GB

VARIANTS = [  # (label, implementation, gradient_as_bucket_view, optimizer)
    ("miniddp", "miniddp", False, "adam"),
    ("miniddp, gradient_as_bucket_view", "miniddp", True, "adam"),
    ("torch DDP", "torch", False, "adam"),
    ("torch DDP, gradient_as_bucket_view", "torch", True, "adam"),
    ("torch DDP + ZeroRedundancyOptimizer", "torch", False, "zero1"),
]


def gelu_mlp(hidden: int = 1024, layers: int = 6, inputs: int = 256, classes: int = 10) -> torch.nn.Module:
    """The model of ``benchmarks/timeline.py``: 5.5 M parameters with the defaults."""
    blocks = [torch.nn.Linear(inputs, hidden), torch.nn.GELU()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_info() -> _Mallinfo2:
    """glibc's ``mallinfo2()``: ``uordblks`` heap bytes in use, ``hblkhd`` mmapped bytes in use (all arenas)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back: heap chunks in use + mmapped chunks."""
    info = malloc_info()
    return info.uordblks + info.hblkhd


# --8<-- [start:count]
def count_storages(categories: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category, each distinct storage counted once, in the first category that reaches it.

    A tensor that views another's memory (a ``.grad`` inside a bucket buffer) shares its
    storage: ``untyped_storage().data_ptr()`` is the same, so it adds nothing.
    """
    seen, out = set(), {}
    for name, tensors in categories.items():
        out[name] = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out[name] += storage.nbytes()
    return out
# --8<-- [end:count]


def breakdown(model, optimizer, buckets=()) -> dict[str, int]:
    """This rank's parameters / bucket buffers / gradients (own storage) / optimizer state, in bytes.

    ``buckets``: the bucket buffers Python can reach (miniddp's). A ``.grad`` whose storage is
    larger than itself is a view into a flat buffer (torch's ``gradient_as_bucket_view``): that
    storage is a bucket too, reached through the gradient.
    """
    params = list(model.parameters())
    state = optimizer.optim.state if hasattr(optimizer, "optim") else optimizer.state  # ZeroRedundancyOptimizer
    opt_tensors = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    views = [g for g in grads if g.untyped_storage().nbytes() > g.numel() * g.element_size()]
    counted = count_storages({"parameters": params, "buckets": [*buckets, *views], "gradients": grads,
                              "optimizer": opt_tensors})
    counted["grads_in_buckets"] = len(views)
    return counted


def measure(rank, world_size, impl: str, as_view: bool, optimizer: str = "adam", steps: int = 3,
            batch: int = 32, hidden: int = 1024, layers: int = 6) -> dict:
    """On each rank: build, wrap, train ``steps`` Adam steps; the breakdown after the last step."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import miniddp

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    gc.collect()
    before = malloc_in_use()
    torch.manual_seed(0)
    model = gelu_mlp(hidden, layers)
    if impl == "miniddp":
        ddp = miniddp.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = TorchDDP(model, gradient_as_bucket_view=as_view)
    after_wrap = malloc_in_use()
    if optimizer == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # a 2 s import: only when used

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    for step in range(steps):  # >= 2: both DDPs rebuild their buckets after the first backward
        if step:
            opt.zero_grad()  # set_to_none=True, torch's default
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        del loss
    gc.collect()
    total = malloc_in_use() - before
    buckets = [b.buffer for b in ddp.reducer.buckets] if impl == "miniddp" else []
    out = breakdown(model, opt, buckets)
    out["buckets_source"] = "counted"
    if impl == "torch":  # torch's own record of its (rebuilt) buckets, in bytes
        logged = ddp._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes", logged.get("bucket_sizes", ""))
        out["torch_bucket_bytes_logged"] = sum(int(s) for s in str(sizes).split(",") if s.strip())
        if out["buckets"] == 0:  # held in C++, out of Python's reach: torch's figure, checked by malloc below
            out["buckets"], out["buckets_source"] = out["torch_bucket_bytes_logged"], "torch's log"
    out["malloc_total"] = total
    out["malloc_after_wrap"] = after_wrap - before
    # what malloc holds beyond everything above: Python objects, autograd, gloo (the cross-check)
    out["other"] = total - sum(out[k] for k in ("parameters", "gradients", "optimizer", "buckets"))
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


# --8<-- [start:zero]
def zero_bytes_per_rank(numel: int, ranks: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                        k: int = 12) -> float:
    """Model-state bytes per rank under ZeRO ``stage`` (0 = DDP): Rajbhandari et al. 2019, arXiv 1910.02054, Fig. 1.

    Each rank holds ``numel`` parameters (``param_bytes`` each), gradients (``grad_bytes``)
    and ``k`` bytes of optimizer state per parameter. Mixed-precision Adam, the paper's
    case: fp16 parameters and gradients (2 + 2) and K = 12 (an fp32 copy of the
    parameters, momentum and variance). Stage 1 shards the optimizer state over the
    ``ranks``, stage 2 the gradients too, stage 3 the parameters too (FSDP's FULL_SHARD).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0 (DDP), 1, 2 or 3")
    sharded = lambda nbytes, from_stage: nbytes / ranks if stage >= from_stage else nbytes  # noqa: E731
    return numel * (sharded(param_bytes, 3) + sharded(grad_bytes, 2) + sharded(k, 1))
# --8<-- [end:zero]


def zero_table(numel: int, ranks=(2, 8, 64), **bytes_per_param) -> list[dict]:
    """Per-rank bytes for stages 0-3 at each ``ranks``, and what each saves over DDP."""
    rows = []
    for n in ranks:
        per_stage = [zero_bytes_per_rank(numel, n, s, **bytes_per_param) for s in range(4)]
        rows.append({"ranks": n, "bytes": per_stage, "saving": [1 - b / per_stage[0] for b in per_stage]})
    return rows


def plot(results: list[dict], path: Path, ranks=(2, 8)) -> None:
    """Top: measured, stacked per variant (one row per rank where the ranks differ). Bottom: the same
    model under ZeRO stages 0-3 at ``ranks`` ranks (fp32 Adam: 4 + 4 + 8 bytes per parameter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG
    parts = [("parameters", "parameters", "#3182bd"), ("gradients", "gradients (own storage)", "#fd8d3c"),
             ("optimizer", "Adam state (exp_avg, exp_avg_sq)", "#74c476"),
             ("buckets", "bucket buffers (hold .grad with gradient_as_bucket_view)", "#9e9ac8"),
             ("other", "other (malloc total minus the rest)", "#d9d9d9")]
    measured = []  # (label, breakdown)
    for r in results:
        a, b = r["ranks"][0], r["ranks"][-1]
        if all(abs(a[k] - b[k]) < 0.05 * MB for k, _, _ in parts[:4]):
            measured.append((f"{r['label']} (every rank)", a))
        else:
            measured += [(f"{r['label']}, rank {i}", x) for i, x in enumerate(r["ranks"])]
    numel = results[0]["ranks"][0]["numel"]
    names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP"]
    predicted = []
    for n in ranks:
        for stage in range(4):
            shard = lambda nbytes, from_stage: numel * nbytes / (n if stage >= from_stage else 1)  # noqa: E731
            predicted.append((f"{names[stage]}, {n} ranks",
                              {"parameters": shard(4, 3), "gradients": shard(4, 2), "optimizer": shard(8, 1)}))
    fig, axes = plt.subplots(2, 1, figsize=(9, 0.42 * (len(measured) + len(predicted)) + 2.6),
                             height_ratios=[len(measured), len(predicted)], sharex=True)
    for ax, rows, title in ((axes[0], measured, "measured after optimizer.step(), 2 gloo ranks"),
                            (axes[1], predicted, "the same model if ZeRO sharded it (formula, model states only)")):
        for y, (label, row) in enumerate(rows):
            left = 0.0
            for key, name, colour in parts:
                width = max(0.0, row.get(key, 0)) / MB
                ax.barh(y, width, left=left, color=colour, edgecolor="white", linewidth=0.6, height=0.72,
                        label=name if y == 0 and ax is axes[0] else None)
                left += width
            ax.text(left + 1.5, y, f"{left:.1f} MB", va="center", fontsize=9)
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
        model_mb = numel * 4 / MB
        for k in range(1, 6):
            ax.axvline(k * model_mb, color="0.7", linewidth=0.6, linestyle=":", zorder=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel(f"MB per rank (dotted lines: multiples of the fp32 model, {numel * 4 / MB:.1f} MB)", fontsize=9)
    axes[1].set_xlim(0, max(sum(r[k] for k, _, _ in parts) for _, r in measured) / MB * 1.15)
    fig.suptitle("Memory per rank: 6x1024 GELU MLP (5.5 M parameters), fp32, Adam", fontsize=11, x=0.02, ha="left")
    fig.legend(loc="lower center", ncol=2, fontsize=9, frameon=False, bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    from miniddp.launching.spawn import run_on_ranks

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--zero" in argv:  # ZeRO's stages on 1-4 ranks: benchmarks/zero_memory.py, with the remaining options
        sys.path.insert(0, str(HERE))
        import zero_memory

        return zero_memory.main([a for a in argv if a != "--zero"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--zero", action="store_true", help="run benchmarks/zero_memory.py (ZeRO stages 0-2)")
    args = parser.parse_args(argv)
    results = []
    for label, impl, as_view, optimizer in VARIANTS:
        ranks = run_on_ranks(measure, 2, args=(impl, as_view, optimizer, args.steps, args.batch), timeout=300)
        results.append({"label": label, "impl": impl, "gradient_as_bucket_view": as_view, "optimizer": optimizer,
                        "ranks": ranks})
    numel = results[0]["ranks"][0]["numel"]
    zero = {"mixed_precision_k12": {"bytes_per_param": {"param_bytes": 2, "grad_bytes": 2, "k": 12},
                                    "this_model": zero_table(numel, param_bytes=2, grad_bytes=2, k=12),
                                    "paper_7.5B": zero_table(7_500_000_000, param_bytes=2, grad_bytes=2, k=12)},
            "fp32_adam_k8": {"bytes_per_param": {"param_bytes": 4, "grad_bytes": 4, "k": 8},
                             "this_model": zero_table(numel, param_bytes=4, grad_bytes=4, k=8)}}
    report = {"torch": torch.__version__, "world_size": 2, "backend": "gloo", "model": "gelu_mlp(1024, 6)",
              "numel": numel, "args": vars(args), "load_average_1min": os.getloadavg()[0], "variants": results,
              "zero": zero}
    (HERE / "results" / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, ROOT / "docs" / "img" / "memory.svg")

    print(f"gelu_mlp: {numel:,} parameters = {numel * 4 / MB:.1f} MB fp32; 2 gloo ranks; MB per rank\n")
    print("| variant | rank | parameters | gradients (own storage) | Adam state | bucket buffers | other "
          "| total (malloc) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for rank, b in enumerate(r["ranks"]):
            src = " (torch's log)" if b["buckets_source"] != "counted" else ""
            print(f"| {r['label']} | {rank} | {b['parameters'] / MB:.1f} | {b['gradients'] / MB:.1f} | "
                  f"{b['optimizer'] / MB:.1f} | {b['buckets'] / MB:.1f}{src} | {b['other'] / MB:.1f} | "
                  f"{b['malloc_total'] / MB:.1f} |")
    print("\nZeRO, mixed precision (K=12), GB per rank for the paper's 7.5 B parameters:")
    for row in zero["mixed_precision_k12"]["paper_7.5B"]:
        print(f"  N={row['ranks']:>3}: " + ", ".join(f"stage {s}: {b / 1e9:.2f}" for s, b in enumerate(row["bytes"])))
    print("\nwrote benchmarks/results/memory.json and docs/img/memory.svg")


if __name__ == "__main__":
    sys.exit(main())
