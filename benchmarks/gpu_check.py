"""GPU checks that need more than a test: run by ``benchmarks/gpu_check.sh`` on a machine with a GPU.

    python benchmarks/gpu_check.py parity      # miniddp == torch DDP on CUDA tensors, 2 gloo ranks on one GPU
    python benchmarks/gpu_check.py timeline    # the tracer on CUDA: events in order, step timed with CUDA events

Each prints one line and exits 0 on success, 1 on a wrong result.
``GPU_CHECK_DEVICE=cpu`` runs the same code on the CPU (to check the script itself). One GPU cannot
hold two NCCL ranks ("Duplicate GPU detected"), so the two-rank checks use gloo,
which moves CUDA tensors through host memory; NCCL is checked at world size 1 by
the tests that ``gpu_check.sh`` runs.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.diagnostics.trace import Tracer
from miniddp.launching.spawn import run_on_ranks

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script on a machine without GPU


def _on_device():
    """This rank's device: every rank shares GPU 0 (gloo copies through host memory)."""
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    return torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")


def _model(batchnorm: bool) -> torch.nn.Module:
    norm = torch.nn.BatchNorm1d(64) if batchnorm else torch.nn.Identity()
    return torch.nn.Sequential(torch.nn.Linear(32, 64), norm, torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _parity(rank, world_size, options, batchnorm, accumulation):
    device = _on_device()
    torch.manual_seed(100 + rank)  # different on every rank: the wrap's broadcast must fix that
    mine = _model(batchnorm).to(device)
    theirs = copy.deepcopy(mine)
    ids = [0] if device.type == "cuda" else None
    ours = miniddp.DistributedDataParallel(mine, device_ids=ids, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = TorchDDP(theirs, device_ids=ids, **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    worst = 0.0
    for step in range(4):
        for micro in range(accumulation):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)  # CPU: device_ids moves them
            for model in (ours, ref):
                with model.no_sync() if micro < accumulation - 1 else torch.enable_grad():
                    F.mse_loss(model(x), y.to(device)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst = max(worst, max((a.double() - b.double()).abs().max().item()
                               for a, b in zip(mine.state_dict().values(), theirs.state_dict().values())))
    flat = torch.cat([p.detach().double().flatten() for p in mine.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return worst, max((e - flat).abs().max().item() for e in everyone)


def parity() -> bool:
    cases = {"mlp": ({}, False, 1), "batchnorm": ({}, True, 1), "tiny buckets": ({"bucket_cap_mb": 0.001}, False, 1),
             "bucket views": ({"gradient_as_bucket_view": True}, False, 1),
             "accumulation": ({"bucket_cap_mb": 0.001}, False, 3)}
    worst = {}
    for name, (options, batchnorm, accumulation) in cases.items():
        results = run_on_ranks(_parity, 2, args=(options, batchnorm, accumulation), timeout=300)
        worst[name] = max(max(r) for r in results)
    ok = max(worst.values()) < 1e-5
    print(f"{'PASS' if ok else 'FAIL'} parity with torch DDP on CUDA tensors, 2 gloo ranks: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return ok


def _timeline(rank, world_size):
    device = _on_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)]).to(device)
    tracer = Tracer(rank)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=4, tracer=tracer)
    x = torch.randn(256, 1024, device=device)
    for _ in range(2):  # the second step runs on rebuilt buckets
        tracer.clear()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        ddp(x).square().mean().backward()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) if device.type == "cuda" else float("nan")
    names = [e["name"] for e in tracer.events]
    launched = [e["bucket"] for e in tracer.events if e["name"] == "bucket launched"]
    finished = {e["bucket"]: e["t"] for e in tracer.events if e["name"] == "bucket finished"}
    launch_t = {e["bucket"]: e["t"] for e in tracer.events if e["name"] == "bucket launched"}
    span = max(e["t"] for e in tracer.events) - min(e["t"] for e in tracer.events)
    in_order = launched == sorted(launched) and all(finished[b] >= launch_t[b] for b in launched)
    return in_order and names[0] == "backward start" and "backward end" in names, span * 1e3, step_ms


def timeline() -> bool:
    results = run_on_ranks(_timeline, 2, timeout=300)
    ok = all(r[0] for r in results)
    print(f"{'PASS' if ok else 'FAIL'} timeline on CUDA: events in order on both ranks; traced backward "
          + ", ".join(f"rank {i} {span:.1f} ms (CUDA events: whole step {cuda:.1f} ms)"
                      for i, (_, span, cuda) in enumerate(results)))
    return ok


if __name__ == "__main__":
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("SKIP no CUDA device")
        raise SystemExit(0)
    checks = {"parity": parity, "timeline": timeline}
    raise SystemExit(0 if all(checks[name]() for name in sys.argv[1:] or checks) else 1)
