"""ZeRO stages 0, 1 and 2, memory per rank on 1 to 4 ranks: counted after a step, and the peak during training.

Run:  python benchmarks/zero_memory.py [--world-sizes 1 2 3 4] [--hidden 512] [--layers 4] [--steps 3]
      python benchmarks/memory.py --zero [the same options]        (the same run, from DDP's memory benchmark)

What: a fp32 GELU MLP (``benchmarks/timeline.py``'s, 4 hidden layers of 512 by default: Ψ = 924,682 parameters,
3.53 MiB), batch 32 per rank, ``--steps`` AdamW steps on 1, 2, 3 and 4 gloo ranks, for

* stage 0: ``miniddp.DistributedDataParallel`` with ``torch.optim.AdamW``;
* stage 1 and stage 2: the same DDP with ``miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage)``;
* stage 1, torch's design: the same DDP with ``miniddp.ZeroRedundancyOptimizer`` (DDP's all-reduce, then one
  broadcast per parameter), and torch's own ``ZeroRedundancyOptimizer`` under torch's DDP;

beside the Ultra-Scale Playbook's formula with fp32 everywhere, as run here: parameters 4Ψ, gradients 4Ψ (4Ψ/N
from stage 2), Adam state 8Ψ (8Ψ/N from stage 1). (The Playbook's 2Ψ + 2Ψ + 12Ψ is mixed precision, with an fp32
master copy inside the 12Ψ; this run has none.) ``memory.zero_bytes_per_rank`` is the formula.

How, counted: after the last ``step()`` (before ``zero_grad``), ``memory.count_storages`` walks the live tensors:
parameters, DDP's bucket buffers (``reducer.buckets[i].buffer``; torch's DDP keeps them in C++, so its own log
gives their size), every ``.grad``, ``ZeroOptimizer``'s averaged gradient shard (``shards.grad``) and the
optimizer's state (the local optimizer's, for ZeRO: this rank's share), the 0-d ``step`` counters left out. Each
storage is counted once, in the first category that reaches it (a piece's ``.grad`` is a view of the shard).

How, peak: torch's CPU allocator keeps no statistics and ``tracemalloc`` does not see it, but it takes its memory
from glibc's malloc. Each rank fixes malloc's mmap threshold at 64 KiB (``mallopt``), so every allocation of 64
KiB or more (every tensor here but the 2 KiB biases), on any thread (gloo's included), is a mapping of its own,
and glibc's ``max mmap bytes`` (``malloc_stats``) is their high-water mark. Peak = that mark after training minus
the mapped bytes before the model was built (after a throwaway forward and backward: MKL keeps about 4.5 MiB of
workspace from its first matrix product on); "at rest" = mapped bytes after the step minus the same. One process
pair per variant and world size, since the mark never goes down. A control checks the method on a known 8 MiB
transient first. The table shows the largest rank. Ranks call ``torch.set_num_threads(1)``. Writes
``benchmarks/results/zero_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from memory import count_storages, malloc_info, zero_bytes_per_rank  # noqa: E402  (one count, one formula)

MiB = 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
VARIANTS = {  # label -> ZeRO stage, for the formula
    "stage 0 (DDP + AdamW)": 0,
    "stage 1 (ZeroOptimizer)": 1,
    "stage 2 (ZeroOptimizer)": 2,
    "stage 1, torch's design (miniddp.ZeroRedundancyOptimizer)": 1,
    "torch's ZeroRedundancyOptimizer (torch DDP)": 1,
}
CATEGORIES = ("parameters", "buckets", "grads", "shard", "state")


def max_mapped() -> int:
    """glibc's high-water mark of mmapped bytes (``malloc_stats`` prints it to stderr: read it from there)."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            libc.malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return int(re.search(rb"max mmap bytes\s*=\s*(\d+)", f.read()).group(1))


def build(name: str, model: torch.nn.Module):
    """``(ddp, optimizer, local optimizer)`` of variant ``name``; the local optimizer holds this rank's state."""
    import miniddp

    if name.startswith("torch's"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
        return ddp, opt, opt.optim
    ddp = miniddp.DistributedDataParallel(model)
    if name.startswith("stage 0"):
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return ddp, opt, opt
    if "ZeroRedundancyOptimizer" in name:
        opt = miniddp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
        return ddp, opt, opt.optim
    opt = miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=VARIANTS[name], lr=1e-3)
    return ddp, opt, opt.optim


def counted(ddp, model, opt, local) -> dict:
    """Bytes per category, each storage once (``memory.count_storages``)."""
    params = list(model.parameters())
    buckets = [b.buffer for b in ddp.reducer.buckets] if hasattr(ddp.reducer, "buckets") else []
    state = [v for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    shard = [g for g in getattr(getattr(opt, "shards", None), "grad", []) if g is not None]
    out = count_storages({"parameters": params, "buckets": buckets, "shard": shard,
                          "grads": [p.grad for p in params], "state": state})
    if not buckets:  # torch's DDP: its buckets live in C++; its log has their sizes
        logged = ddp._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes", logged.get("bucket_sizes", ""))
        out["buckets"] = sum(int(s) for s in str(sizes).split(",") if s.strip())
    return out


def measure(rank, world_size, name, hidden, layers, batch, steps) -> dict:
    from timeline import gelu_mlp

    torch.set_num_threads(1)
    if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused")
    control = malloc_info().hblkhd
    transient = torch.ones(8 * MiB, dtype=torch.uint8)  # the control: a known transient the mark must see
    del transient
    assert max_mapped() - control >= 8 * MiB, "malloc's high-water mark missed an 8 MiB tensor"
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    torch.manual_seed(0)
    F.cross_entropy(gelu_mlp(hidden=hidden, layers=layers)(x), y).backward()  # MKL keeps ~4.5 MiB from its 1st GEMM
    before, mark = malloc_info().hblkhd, max_mapped()
    torch.manual_seed(0)
    model = gelu_mlp(hidden=hidden, layers=layers)
    ddp, opt, local = build(name, model)
    for step in range(steps):  # >= 2: DDP rebuilds its buckets after the first backward
        if step:
            opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    dist.barrier()  # both ranks done, so every collective's tensors are released (gloo's and the waiters')
    gc.collect()
    out = counted(ddp, model, opt, local)
    out["at_rest"] = malloc_info().hblkhd - before
    out["peak"] = max_mapped() - before
    assert out["peak"] > mark - before, "the high-water mark is the warm-up's, not training's: no peak measured"
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


def main(argv=None) -> None:
    from miniddp.launching.spawn import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "zero_memory.json")
    args = parser.parse_args(argv)
    rows = []
    for n in args.world_sizes:
        for name, stage in VARIANTS.items():
            ranks = run_on_ranks(measure, n, args=(name, args.hidden, args.layers, args.batch, args.steps),
                                 timeout=300)
            psi = ranks[0]["numel"]
            formula = {"parameters": 4 * psi, "gradients": zero_bytes_per_rank(psi, n, stage, param_bytes=0,
                                                                                  grad_bytes=4, k=0),
                       "state": zero_bytes_per_rank(psi, n, stage, param_bytes=0, grad_bytes=0, k=8)}
            largest = max(ranks, key=lambda r: sum(r[k] for k in CATEGORIES))  # whole tensors: ranks differ
            rows.append({"variant": name, "stage": stage, "ranks": n, "numel": psi, "per_rank": ranks,
                         "largest": largest, "formula": formula})
            print(f"{n} ranks, {name}: done", file=sys.stderr, flush=True)
    psi = rows[0]["numel"]
    print(f"torch {torch.__version__}, gloo, fp32 GELU MLP {args.layers}x{args.hidden}, Ψ = {psi:,} parameters "
          f"({4 * psi / MiB:.2f} MiB), AdamW, {args.steps} steps; MiB per rank, the largest rank; (formula)\n")
    print("| ranks | variant | parameters | gradients: `.grad` + buckets + shard | optimizer state "
          "| counted total | at rest (malloc) | peak (malloc) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, f = r["largest"], r["formula"]
        grads = [f"{m[k] / MiB:.2f}" for k in ("grads", "buckets", "shard")]
        total = sum(m[k] for k in CATEGORIES)
        print(f"| {r['ranks']} | {r['variant']} | {m['parameters'] / MiB:.2f} | {' + '.join(grads)} = "
              f"**{(m['grads'] + m['buckets'] + m['shard']) / MiB:.2f}** ({f['gradients'] / MiB:.2f}) "
              f"| **{m['state'] / MiB:.2f}** ({f['state'] / MiB:.2f}) | {total / MiB:.2f} "
              f"({sum(f.values()) / MiB:.2f}) | {m['at_rest'] / MiB:.2f} | {m['peak'] / MiB:.2f} |")
    args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                     "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                     "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
