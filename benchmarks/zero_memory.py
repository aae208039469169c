"""ZeRO stage 0 and stage 1 bytes per rank, counted from the tensors, beside the formula and torch's ZeRO.

Run:  python benchmarks/zero_memory.py [--world-sizes 1 2 3 4] [--hidden 512] [--layers 4]

What: per rank, the bytes of parameters, gradients and optimizer state after one AdamW training step of a
small fp32 GELU MLP (the MLP of ``benchmarks/timeline.py``, 4 hidden layers of 512 by default: 0.92 M
parameters, 3.5 MB), on 1, 2, 3 and 4 gloo ranks of this machine, for

* stage 0: ``miniddp.DistributedDataParallel`` with ``torch.optim.AdamW`` (every rank holds all the state),
* stage 1: the same DDP with ``miniddp.ZeroRedundancyOptimizer(params, torch.optim.AdamW)``,
* beside it, torch's own ``torch.distributed.optim.ZeroRedundancyOptimizer`` (under torch's DDP), same model
  (same seed), same batch, same step,

and the Ultra-Scale Playbook's formula with fp32 everywhere, as run here: parameters 4Ψ, gradients 4Ψ, Adam
state 8Ψ (``exp_avg``, ``exp_avg_sq``) per rank for stage 0, 8Ψ/N for stage 1. The Playbook's 2Ψ + 2Ψ + 12Ψ is
for mixed precision (bf16 parameters and gradients, an fp32 master copy inside the 12Ψ of state); this run has
no master copy.

How: bytes are ``numel() * element_size()`` of the actual tensors: every parameter, every ``.grad`` that exists
(after the step, before ``zero_grad``), and every tensor in the optimizer's ``state`` (for ZeRO, the local
optimizer's: only the shard this rank owns), *excluding* the 0-d ``step`` counters (a few bytes each). Storages
shared (a ``.grad`` viewing a bucket) are not deduplicated: this counts what the formula counts, not malloc
(``benchmarks/memory.py`` does that). The table shows the maximum over ranks: ZeRO shards whole tensors, so the
largest rank holds more than 1/N. Ranks call ``torch.set_num_threads(1)``. Writes
``benchmarks/results/zero_memory.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from timeline import gelu_mlp  # noqa: E402  (one definition of the workload)

MB = 2**20


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(optimizer: torch.optim.Optimizer):
    """The tensors of ``optimizer.state``, without the 0-d ``step`` counters."""
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


def count(model: torch.nn.Module, state_optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "state": nbytes(state_tensors(state_optimizer))}


def one_step(ddp, optimizer, x, y) -> None:
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()  # measured before zero_grad: the gradients still exist


def measure(rank, world_size, hidden, layers, batch):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gelu_mlp(hidden=hidden, layers=layers)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    result = {}

    m0 = copy.deepcopy(model)
    ddp0 = miniddp.DistributedDataParallel(m0)
    adamw = torch.optim.AdamW(ddp0.parameters(), lr=1e-3)
    one_step(ddp0, adamw, x, y)
    result["stage0"] = count(m0, adamw)

    m1 = copy.deepcopy(model)
    ddp1 = miniddp.DistributedDataParallel(m1)
    zero = miniddp.ZeroRedundancyOptimizer(ddp1.parameters(), torch.optim.AdamW, lr=1e-3)
    one_step(ddp1, zero, x, y)
    result["stage1"] = count(m1, zero.optim)  # the local optimizer: this rank's shard

    mt = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddpt = TorchDDP(mt)
    tzero = TorchZero(ddpt.parameters(), torch.optim.AdamW, lr=1e-3)
    one_step(ddpt, tzero, x, y)
    result["torch_stage1"] = count(mt, tzero.optim)
    result["numel"] = sum(p.numel() for p in model.parameters())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for n in args.world_sizes:
        per_rank = run_on_ranks(measure, n, args=(args.hidden, args.layers, args.batch), timeout=600)
        psi = per_rank[0]["numel"]
        for stage, key in ((0, "stage0"), (1, "stage1")):
            rows.append({
                "stage": stage, "ranks": n, "numel": psi,
                "params_bytes": max(r[key]["params"] for r in per_rank),
                "grads_bytes": max(r[key]["grads"] for r in per_rank),
                "state_bytes_per_rank": [r[key]["state"] for r in per_rank],
                "state_bytes_max": max(r[key]["state"] for r in per_rank),
                "formula_state_bytes": 8 * psi if stage == 0 else 8 * psi / n,
                "torch_state_bytes_per_rank": ([r["torch_stage1"]["state"] for r in per_rank] if stage else None),
            })
    psi = rows[0]["numel"]
    print(f"torch {torch.__version__}, gloo, fp32 GELU MLP {args.layers}x{args.hidden}, Ψ = {psi:,} parameters, "
          f"AdamW, one step; state excludes the 0-d step counters; max over ranks\n")
    print("| stage | ranks | params MB | grads MB | optimizer state MB per rank (max) | formula state MB "
          "| torch ZeRO state MB (max) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        theirs = r["torch_state_bytes_per_rank"]
        theirs_mb = f"{max(theirs) / MB:.2f}" if theirs else "–"
        print(f"| {r['stage']} | {r['ranks']} | {r['params_bytes'] / MB:.2f} | {r['grads_bytes'] / MB:.2f} "
              f"| {r['state_bytes_max'] / MB:.2f} | {r['formula_state_bytes'] / MB:.2f} | {theirs_mb} |")
    out = Path(__file__).parent / "results" / "zero_memory.json"
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                               "date": datetime.date.today().isoformat(), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
