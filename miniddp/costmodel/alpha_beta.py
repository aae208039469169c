"""What communication costs on the live group: the α–β fit of an all-reduce, and its overlap cost.

What
    ``measure_all_reduce`` times ``dist.all_reduce`` of a few sizes on the live group (after a
    barrier, the slowest rank's median); ``fit_alpha_beta`` fits the α–β (Hockney) model
    ``seconds = α + β·bytes`` to those timings. ``measure_overlap_cost`` measures the one other
    number the simulation (``miniddp.costmodel.simulate``) needs from the machine: how much of an
    all-reduce's time it takes from compute running beside it.

Why
    α is paid once per bucket and β per byte: the two numbers that ``bucket_cap_mb`` trades
    against overlap (Li et al., "PyTorch Distributed", VLDB 2020, arXiv 2006.15704, §5).
    Measured, not assumed: the same code runs on gloo over loopback and NCCL over NVLink.

How torch differs
    torch measures nothing up front: ``DistributedDataParallel._get_ddp_logging_data()`` reports
    what a run took (``avg_backward_comm_time``, ns). nccl-tests report the same two bandwidths
    as ``AlphaBeta``: algorithm bandwidth (1/β) and bus bandwidth (× 2(n−1)/n).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist


# --8<-- [start:fit]
@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """All-reduce time = alpha_s + beta_s_per_byte * bytes, for one backend and world size."""

    alpha_s: float  # latency: what an all-reduce of 0 bytes costs
    beta_s_per_byte: float  # inverse bandwidth
    world_size: int = 2
    backend: str = "gloo"

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def alpha_us(self) -> float:
        return self.alpha_s * 1e6

    @property
    def algbw_GBps(self) -> float:  # bytes / time for a large message
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")

    @property
    def busbw_GBps(self) -> float:  # nccl-tests' bus bandwidth: algbw x 2(n-1)/n
        return self.algbw_GBps * 2 * (self.world_size - 1) / self.world_size

    # --8<-- [start:on_link]
    def on_link(self, rate_gbit: float, efficiency: float = 1.0) -> AlphaBeta:
        """This fit (the hosts' own cost per byte) over a link of ``rate_gbit``: a ring all-reduce puts
        2(n-1)/n of the bytes on each rank's link, and gloo pipelines its chunks, so the slower of the
        hosts and the wire sets the pace; ``efficiency``: the share of the rate the payload gets."""
        wire = 2 * (self.world_size - 1) / self.world_size * 8 / (rate_gbit * 1e9 * efficiency)
        return dataclasses.replace(self, beta_s_per_byte=max(self.beta_s_per_byte, wire))
    # --8<-- [end:on_link]


def fit_alpha_beta(sizes, seconds, *, world_size: int = 2, backend: str = "gloo") -> AlphaBeta:
    """Least squares on *relative* errors (weights 1/t²): sizes span decades, and plain least
    squares would let the largest message decide α. A negative α (noise) is refitted as 0."""
    w = [1 / t**2 for t in seconds]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, sizes)), sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if alpha < 0:
        alpha, beta = 0.0, sxy / sxx
    return AlphaBeta(alpha, beta, world_size, backend)
# --8<-- [end:fit]


def _timed(fn, reps: int, group, cuda: bool = False) -> float:
    """The slowest rank's median time of ``fn()``, each run after a barrier (``fn`` may return its own
    duration). On CUDA with CUDA events: an NCCL call returns once its work is *enqueued*."""
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            took = fn()
            times.append(took if took is not None else time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def measure_all_reduce(sizes, *, reps: int = 15, group=None, device=None) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of ``dist.all_reduce`` of float32 tensors, per size: the same on every rank."""
    device, result = torch.device(device or "cpu"), []
    for nbytes in sizes:
        x = torch.zeros(max(1, int(nbytes) // 4), device=device)
        dist.all_reduce(x, group=group)  # warm-up: first-call allocations and connections
        result.append((x.numel() * 4, _timed(lambda: dist.all_reduce(x, group=group), reps, group,
                                             device.type == "cuda")))
    return result


# --8<-- [start:cpu_share]
def measure_cpu_share(nbytes: int = 2**22, *, reps: int = 3, group=None) -> float:
    """The share of an all-reduce's time this process's CPU works for it (``time.process_time``, every
    thread, over the wall clock), the slowest rank's median: on a CPU, the part of the communication
    that takes a core from the backward. Over loopback gloo's threads copy and reduce the whole time;
    over a slow link they mostly wait for the wire, and a backward beside them runs at full speed."""
    x = torch.zeros(nbytes // 4)
    dist.all_reduce(x, group=group)  # warm-up: connections and buffers

    def share() -> float:
        cpu, wall = time.process_time(), time.perf_counter()
        dist.all_reduce(x, group=group)
        return (time.process_time() - cpu) / (time.perf_counter() - wall)

    return min(1.0, _timed(share, reps, group))
# --8<-- [end:cpu_share]


# --8<-- [start:overlap]
def measure_overlap_cost(nbytes: int = 2**23, *, reps: int = 5, group=None) -> float:
    """``simulate``'s ``overlap_cost`` on this machine (CPU): matrix products timed alone and beside
    an all-reduce of ``nbytes``; their delay as a share of the all-reduce's time, clipped to 0..1."""
    x, a = torch.zeros(nbytes // 4), torch.randn(192, 192)

    def products(n: int) -> None:
        for _ in range(n):
            a @ a

    def beside(n: int) -> float:  # the products' time while the all-reduce runs in the background
        work = dist.all_reduce(x, group=group, async_op=True)
        t0 = time.perf_counter()
        products(n)
        took = time.perf_counter() - t0
        work.wait()
        return took

    comm = _timed(lambda: dist.all_reduce(x, group=group), reps, group)
    n = max(1, round(comm / _timed(lambda: products(10), reps, group) * 10))  # as long as one all-reduce
    delay = _timed(lambda: beside(n), reps, group) - _timed(lambda: products(n), reps, group)
    return min(1.0, max(0.0, delay / comm))
# --8<-- [end:overlap]
