"""FSDP's memory per rank on 1, 2 and 4 ranks, against DDP and ZeRO-2: counted between steps, and the peak.

Run:  python benchmarks/fsdp_memory.py [--world-sizes 1 2 4] [--layers 6] [--embd 256] [--vocab 8192]
                                       [--batch 2] [--tokens 64] [--steps 3]

What: a GPT-2 built from a Transformers config (``GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192,
n_positions=128)``, no download, ``use_cache=False``: Ψ = 6,868,992 parameters, 26.20 MiB in fp32; ``wte`` and
``lm_head`` tied), ``--batch`` sequences of ``--tokens`` random tokens per rank, ``--steps`` AdamW steps on 1, 2 and
4 gloo ranks, for

* DDP: ``miniddp.DistributedDataParallel`` with ``torch.optim.AdamW``;
* ZeRO-2: the same DDP with ``miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=2)``;
* FSDP: ``miniddp.fully_shard`` on each ``model.transformer.h[i]``, then on the root (which keeps ``wte``, the
  tie to ``lm_head``, ``wpe`` and ``ln_f``), AdamW over its shards;
* torch's FSDP2: ``torch.distributed.fsdp.fully_shard`` wrapped the same way, its ``DTensor`` shards' local
  tensors counted, for comparison;

beside the Ultra-Scale Playbook's formula with fp32 everywhere, as run here: parameters 4Ψ (4Ψ/N for FSDP),
gradients 4Ψ (4Ψ/N for ZeRO-2 and FSDP), AdamW's two moments 8Ψ (8Ψ/N for both): DDP 16Ψ, ZeRO-2 4Ψ + 12Ψ/N,
ZeRO-3 16Ψ/N.
The Playbook's (2 + 2 + K)Ψ with K = 12 is mixed precision (bf16 parameters and gradients, an fp32 master copy
inside K); this run keeps no master copy, so K = 8 and the 2s are 4s. ``memory.zero_bytes_per_rank`` is the formula.

How, counted: after the last ``step()`` (before ``zero_grad``), ``memory.count_storages`` walks what each rank
references: parameters (the shards, for FSDP), DDP's bucket buffers, every ``.grad``, ZeRO-2's gradient shard,
the optimizer's state (the 0-d ``step`` counters left out), and for FSDP each unit's full tensors, gathered
buffers and accumulated gradients (all empty between steps: the check that nothing stays gathered). Each storage
once, in the first category that reaches it.

How, peak: as ``benchmarks/zero_memory.py`` does it. torch's CPU allocator keeps no statistics and ``tracemalloc``
does not see it; it takes its memory from glibc's malloc. Each rank fixes malloc's mmap threshold at 64 KiB
(``mallopt``), so every allocation of 64 KiB or more, on any thread (gloo's and the reduce-scatter's included), is
a mapping of its own, and glibc's ``max mmap bytes`` is their high-water mark, which only rises. Peak = that mark
after training minus the mapped bytes before the model was built (after a throwaway forward and backward of a
1-layer GPT-2, for MKL's workspace); "at rest" = mapped bytes after the step minus the same. Building the model
(the full model exists on every rank before ``fully_shard`` cuts it) sets a mark too: the run checks that training
raised the mark above the one left by building and wrapping, else the training peak would be hidden (it fails
loudly). Tensors under 64 KiB (biases, LayerNorms: 0.3% of Ψ here) are counted but not mapped. One process group
per variant and world size; the table shows the largest rank. Ranks call ``torch.set_num_threads(1)``.
Writes ``benchmarks/results/fsdp_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from memory import count_storages, malloc_info, zero_bytes_per_rank  # noqa: E402  (one count, one formula)
from zero_memory import M_MMAP_THRESHOLD, max_mapped  # noqa: E402  (one peak method)

MiB = 2**20
VARIANTS = {  # label -> ZeRO stage, for the formula
    "DDP + AdamW": 0,
    "ZeRO-2 (ZeroOptimizer stage 2)": 2,
    "FSDP (miniddp.fully_shard)": 3,
    "torch's FSDP2 (fully_shard)": 3,
}
CATEGORIES = ("parameters", "buckets", "grads", "shard", "gathered", "state", "buffers")


def gpt2(layers: int, embd: int, vocab: int, positions: int = 128) -> torch.nn.Module:
    """A GPT-2 from a config (no download): ``layers`` blocks of width ``embd``, ``wte`` tied to ``lm_head``."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # the config's default token ids lie outside a small vocabulary
    config = GPT2Config(n_layer=layers, n_embd=embd, n_head=4, vocab_size=vocab, n_positions=positions,
                        use_cache=False)
    return GPT2LMHeadModel(config)


def build(name: str, model: torch.nn.Module):
    """``(module to call, optimizer, local optimizer)`` of variant ``name``; the local optimizer holds the state."""
    import miniddp

    if name.startswith("FSDP") or name.startswith("torch's"):
        if name.startswith("torch's"):
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = miniddp.fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)  # the root: wte (tied to lm_head), wpe, ln_f
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, opt
    ddp = miniddp.DistributedDataParallel(model)
    if name.startswith("DDP"):
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return ddp, opt, opt
    opt = miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=2, lr=1e-3)
    return ddp, opt, opt.optim


def _local(t):
    """A ``DTensor``'s local shard (torch's FSDP2), else the tensor itself."""
    return getattr(t, "_local_tensor", t) if t is not None else None


def counted(name, wrapped, model, opt, local) -> dict:
    """Bytes per category, each storage once (``memory.count_storages``)."""
    params = [_local(p) for p in model.parameters()]
    state = [_local(v) for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    reducer = getattr(wrapped, "reducer", None)
    buckets = [b.buffer for b in reducer.buckets] if reducer is not None else []
    shard = [g for g in getattr(getattr(opt, "shards", None), "grad", []) if g is not None]
    gathered = []  # miniddp's FSDP: what a unit keeps between steps beside its shards (should be empty)
    for m in model.modules():
        unit = getattr(getattr(m, "_fsdp_state", None), "unit", None)
        if unit is not None:
            gathered += [t for p in unit.params for t in (p.unsharded, p.accumulated) if t is not None]
            gathered += [x[1] for x in (unit.pending_gather, unit.pending_reduce) if x is not None]
    return count_storages({"parameters": params, "buckets": buckets, "shard": shard, "gathered": gathered,
                           "grads": [_local(p.grad) for p in model.parameters()], "state": state,
                           "buffers": list(model.buffers())})


def measure(rank, world_size, name, layers, embd, vocab, batch, tokens, steps) -> dict:
    torch.set_num_threads(1)
    if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused")
    control = malloc_info().hblkhd
    transient = torch.ones(8 * MiB, dtype=torch.uint8)  # the control: a known transient the mark must see
    del transient
    assert max_mapped() - control >= 8 * MiB, "malloc's high-water mark missed an 8 MiB tensor"
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    small = gpt2(1, embd, 256)
    small(ids % 256, labels=ids % 256).loss.backward()  # MKL's workspace, from a model far below the real one
    del small
    gc.collect()
    before = malloc_info().hblkhd
    torch.manual_seed(0)
    model = gpt2(layers, embd, vocab)
    numel = sum(p.numel() for p in model.parameters())  # the tie counted once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped, opt, local = build(name, model)
    gc.collect()
    built = {"mark": max_mapped() - before, "mapped": malloc_info().hblkhd - before}
    for step in range(steps):  # >= 2: DDP rebuilds its buckets after the first backward
        if step:
            opt.zero_grad(set_to_none=True)
        wrapped(ids, labels=ids).loss.backward()
        opt.step()
    dist.barrier()  # every rank done, so every collective's tensors are released
    gc.collect()
    out = counted(name, wrapped, model, opt, local)
    out["at_rest"] = malloc_info().hblkhd - before
    out["peak"] = max_mapped() - before
    out["built"] = built
    if out["peak"] <= built["mark"]:
        raise AssertionError(f"{name}, {world_size} ranks: the high-water mark ({out['peak'] / MiB:.2f} MiB) is "
                             "building's, not training's: no training peak measured")
    out["numel"] = numel
    return out


def main(argv=None) -> None:
    from miniddp.launching.spawn import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--json", type=Path, default=HERE / "results" / "fsdp_memory.json")
    args = parser.parse_args(argv)
    rows = []
    for n in args.world_sizes:
        for name in args.variants:
            stage = VARIANTS[name]
            ranks = run_on_ranks(measure, n, args=(name, args.layers, args.embd, args.vocab, args.batch,
                                                   args.tokens, args.steps), timeout=300)
            psi = ranks[0]["numel"]
            each = lambda param_bytes, grad_bytes, k: zero_bytes_per_rank(  # noqa: E731
                psi, n, stage, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
            formula = {"parameters": each(4, 0, 0), "gradients": each(0, 4, 0), "state": each(0, 0, 8)}
            largest = max(ranks, key=lambda r: r["peak"])
            rows.append({"variant": name, "stage": stage, "ranks": n, "numel": psi, "per_rank": ranks,
                         "largest": largest, "formula": formula})
            print(f"{n} ranks, {name}: done", file=sys.stderr, flush=True)
    psi = rows[0]["numel"]
    print(f"torch {torch.__version__}, gloo, fp32 GPT-2 {args.layers} layers x {args.embd}, vocabulary {args.vocab}, "
          f"Ψ = {psi:,} parameters ({4 * psi / MiB:.2f} MiB), AdamW, batch {args.batch} x {args.tokens} tokens per "
          f"rank, {args.steps} steps; MiB per rank, the rank with the highest peak; (formula)\n")
    print("| ranks | variant | parameters | gradients: `.grad` + buckets + shard | optimizer state "
          "| counted total | at rest (malloc) | peak (malloc) | peak − at rest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, f = r["largest"], r["formula"]
        grads = [f"{m[k] / MiB:.2f}" for k in ("grads", "buckets", "shard")]
        total = sum(m[k] for k in CATEGORIES)
        extra = "".join(f" + {k} {m[k] / MiB:.2f}" for k in ("gathered", "buffers") if m[k])
        print(f"| {r['ranks']} | {r['variant']} | **{m['parameters'] / MiB:.2f}** ({f['parameters'] / MiB:.2f}) | "
              f"{' + '.join(grads)} = **{(m['grads'] + m['buckets'] + m['shard']) / MiB:.2f}** "
              f"({f['gradients'] / MiB:.2f}) | **{m['state'] / MiB:.2f}** ({f['state'] / MiB:.2f}) | "
              f"{total / MiB:.2f}{extra} ({sum(f.values()) / MiB:.2f}) | {m['at_rest'] / MiB:.2f} | "
              f"**{m['peak'] / MiB:.2f}** | {(m['peak'] - m['at_rest']) / MiB:.2f} |")
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                     "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                     "commit": commit,
                                     "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
