"""Past this machine, by simulation: ResNet50's DDP step on 1 to 256 GPUs, held against torch's own table.

Run:  python benchmarks/scaling.py      (seconds; no GPU, no network: the cost model alone)

The cost model (``miniddp.costmodel.simulate``) needs a backward (when each gradient is ready)
and a network (α, β). Here both are built, not traced:

- **ResNet50's gradients** from its architecture (torchvision's resnet50, v1.5: the stride on
  the 3x3 convolution), 25.6 M parameters, 97.5 MiB of fp32 gradients, written out layer by
  layer below. The backward takes ⅔ of a step that costs 0.097 s without DDP (torch's table:
  ResNet50, batch 32 per V100), spent on each layer in proportion to its multiply-adds;
  gradients are ready in reverse order, and a layer's parameters when its compute is done.
- **A ring all-reduce**: a launch (``LAUNCH_S``), then 2(n−1) steps, each paying ``HOP_S``; each rank sends
  2(n−1)/n of the bytes over the slowest link of the ring (``AlphaBeta.on_link``). How much GPU
  time NCCL's kernels take from the backward beside them is not known here: ``overlap_cost`` 0
  (free), 0.5 (the sweep) and 1 (none) side by side.

Then, for 1 to 256 ranks at 10 and 100 Gbit/s per rank: the step, the scaling efficiency
(the step without DDP over the step with it), and ``bucket_cap_mb=1`` against 25. And the
published table (pytorch/pytorch ``benchmarks/distributed/ddp/README.md``: ResNet50, batch
32, V100s, 8 per machine over NVLink, machines joined by 4x100 Gbit/s InfiniBand) beside the
model with those links. Writes ``benchmarks/results/scaling.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miniddp.costmodel.alpha_beta import AlphaBeta
from miniddp.costmodel.simulate import predict_step_time
from miniddp.costmodel.step_profile import StepProfile

HERE = Path(__file__).resolve().parent
STEP_NO_DDP_S = 0.097  # torch's table: ResNet50, batch 32, one V100, no DDP
LAUNCH_S = 20e-6  # per all-reduce: the reducer's work and NCCL's kernel launch (an assumption)
HOP_S = 5e-6  # latency per ring step (NVLink / InfiniBand, NCCL): an assumption, not a measurement
NVLINK_GBIT = 1200  # per GPU inside a DGX-1 class machine (about 150 GB/s): an assumption
IB_GBIT = 400  # 4x100 Gbit/s InfiniBand per machine: NCCL's rings, one per NIC, cross it together
OVERLAP_COSTS = (0.0, 0.5, 1.0)  # how much GPU time NCCL's kernels take from the backward beside them: unknown
SWEEP_OVERLAP = 0.5
PUBLISHED = {  # world size -> (seconds per iteration with DDP, throughput change of bucket_cap_mb=1 vs 25)
    1: (0.100, -0.003), 2: (0.103, -0.010), 4: (0.103, -0.016), 8: (0.104, -0.026), 16: (0.104, -0.038)}


def resnet50_layers() -> list[tuple[str, tuple, int]]:
    """(name, weight shape, output pixels) in registration order; each conv and the fc is followed
    by its batch norm (weight, bias) and the fc by its bias, as torchvision's ``resnet50``."""
    layers = [("conv1", (64, 3, 7, 7), 112 * 112)]
    inplanes = 64
    for stage, (planes, blocks, side) in enumerate(((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)), 1):
        for block in range(blocks):
            first_side = side * 2 if stage > 1 and block == 0 else side  # the 1x1 before the strided 3x3
            name = f"layer{stage}.{block}"
            layers += [(f"{name}.conv1", (planes, inplanes, 1, 1), first_side**2),
                       (f"{name}.conv2", (planes, planes, 3, 3), side**2),
                       (f"{name}.conv3", (planes * 4, planes, 1, 1), side**2)]
            if block == 0:
                layers.append((f"{name}.downsample", (planes * 4, inplanes, 1, 1), side**2))
            inplanes = planes * 4
    layers.append(("fc", (1000, 2048), 1))
    return layers


def resnet50_profile(step_s: float = STEP_NO_DDP_S) -> StepProfile:
    """The backward as the cost model sees it: each layer's weight, then its norm's (or the fc's bias)."""
    shapes, work = [], []  # per parameter, in registration order; work: multiply-adds of its layer
    for name, shape, pixels in resnet50_layers():
        macs = pixels * torch.Size(shape).numel()
        extra = [(shape[0],)] if name == "fc" else [(shape[0],), (shape[0],)]  # bias, or the norm's two
        shapes += [shape, *extra]
        work += [macs] + [0] * len(extra)
    backward_s = step_s * 2 / 3
    ready, done = [0.0] * len(shapes), 0.0
    for i in reversed(range(len(shapes))):  # the backward runs from the last layer to the first
        done += work[i] / sum(work) * backward_s
        ready[i] = done
    numels = [torch.Size(s).numel() for s in shapes]
    return StepProfile(forward_s=step_s / 3, ready_s=ready, numels=numels, dtypes=[torch.float32] * len(shapes),
                       shapes=shapes)


def ring(world_size: int, link_gbit: float) -> AlphaBeta:
    """A ring all-reduce over ``world_size`` ranks whose slowest link carries ``link_gbit``: a launch, then
    2(n-1) steps (one rank: the launch alone, as torch's DDP still all-reduces each bucket)."""
    return AlphaBeta(LAUNCH_S + 2 * (world_size - 1) * HOP_S, 0.0, world_size, "nccl").on_link(link_gbit)


def step_s(profile: StepProfile, world_size: int, link_gbit: float, cap: float | None,
           overlap_cost: float = SWEEP_OVERLAP) -> float:
    return predict_step_time(profile, ring(world_size, link_gbit), cap, overlap_cost=overlap_cost).step_s


def main() -> None:
    profile = resnet50_profile()
    grad_mib = sum(profile.nbytes) / 2**20
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sweep = {}
    for gbit in (10, 100):
        sweep[gbit] = [{"world_size": n, "step_s": step_s(profile, n, gbit, None),
                        "efficiency": STEP_NO_DDP_S / step_s(profile, n, gbit, None),
                        "cap1_vs_cap25": step_s(profile, n, gbit, 25) / step_s(profile, n, gbit, 1) - 1}
                       for n in sizes]
    published = []
    for n, (seconds, change) in PUBLISHED.items():
        link = NVLINK_GBIT if n <= 8 else IB_GBIT  # past one machine the ring crosses InfiniBand
        row = {"world_size": n, "published_s": seconds, "published_cap1_vs_cap25": change}
        for c in OVERLAP_COSTS:
            row[f"predicted_s_overlap_{c:g}"] = step_s(profile, n, link, None, c)
            row[f"predicted_cap1_vs_cap25_overlap_{c:g}"] = (step_s(profile, n, link, 25, c)
                                                             / step_s(profile, n, link, 1, c) - 1)
        published.append(row)
    report = {"grad_mib": grad_mib, "params": sum(profile.numels), "launch_s": LAUNCH_S, "hop_s": HOP_S,
              "sweep_overlap_cost": SWEEP_OVERLAP, "nvlink_gbit": NVLINK_GBIT, "ib_gbit": IB_GBIT,
              "sweep": {str(k): v for k, v in sweep.items()}, "published": published}
    (HERE / "results" / "scaling.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"ResNet50: {report['params'] / 1e6:.1f} M parameters, {grad_mib:.1f} MiB of fp32 gradients\n")
    print("| ranks | " + " | ".join(f"{g} Gbit/s: step, efficiency, cap 1 vs 25" for g in sweep) + " |")
    print("|---|---|---|")
    for i, n in enumerate(sizes):
        cells = [f"{1e3 * r['step_s']:.0f} ms, {r['efficiency']:.2f}, {100 * r['cap1_vs_cap25']:+.1f}%"
                 for r in (sweep[g][i] for g in sweep)]
        print(f"| {n} | " + " | ".join(cells) + " |")
    head = " | ".join(f"overlap_cost {c:g}" for c in OVERLAP_COSTS)
    print(f"\n| GPUs | published: s/iter, cap 1 vs 25 | predicted, {head} |")
    print("|---|---|" + "---|" * len(OVERLAP_COSTS))
    for r in published:
        cells = [f"{r[f'predicted_s_overlap_{c:g}']:.4f}, {100 * r[f'predicted_cap1_vs_cap25_overlap_{c:g}']:+.1f}%"
                 for c in OVERLAP_COSTS]
        print(f"| {r['world_size']} | {r['published_s']:.3f}, {100 * r['published_cap1_vs_cap25']:+.1f}% | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
