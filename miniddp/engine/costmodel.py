"""The cost model: predict a DDP step from an all-reduce fit and one traced backward.

What
    ``fit_alpha_beta`` fits the α–β (Hockney) model of one all-reduce,
    ``seconds = α + β·bytes``, to ``measure_all_reduce``'s timings on the live
    group. ``StepProfile.from_events`` reads one step traced by ``miniddp.diagnostics.trace``:
    forward, when each gradient became ready, the tail of ``loss.backward()``
    (copying the averages back), the optimizer. ``simulate`` replays that backward
    with a bucket assignment and **one communication stream**: buckets in order,
    each starting at max(its last gradient ready, the previous one's finish), each
    taking α + β·bytes. Step = forward + max(backward end, last finish) + tail +
    optimizer; what runs after the backward is the *exposed* communication.
    ``best_bucket_cap_mb`` sweeps caps; ``naive_step_time`` is the closed form
    without overlap (compute + Σ per-bucket cost), kept to check the simulation.

Why
    ``bucket_cap_mb`` trades α, paid once per bucket, against overlap: a bucket can
    only start when it is full, and whatever is still in flight when backward ends
    is exposed. Li et al. measure this trade-off ("PyTorch Distributed", VLDB 2020,
    arXiv 2006.15704: §5, the "Bucket Size" experiments) on two models and two
    backends; the model lets a reader reason about *their* model and network.

How torch differs
    torch has no cost model: ``bucket_cap_mb`` is a number you pick (Hugging Face:
    ``ddp_bucket_cap_mb``); ``DistributedDataParallel._get_ddp_logging_data()``
    reports what happened (``avg_backward_comm_time``,
    ``avg_backward_compute_comm_overlap_time``, ns). Overlap is free only if
    communication takes nothing from the backward: on CPU gloo's threads need the
    backward's cores, which ``overlap_cost`` (``measure_overlap_cost``) models.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from .bucketing import bucket_size_limits, compute_bucket_assignment


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


# --8<-- [start:profile]
@dataclasses.dataclass
class StepProfile:
    """One step as the model sees it; times in seconds, ``ready_s`` from the backward's start."""

    forward_s: float
    ready_s: list[float]  # per parameter (registration order): when its gradient was ready
    numels: list[int]  # per parameter
    dtypes: list[torch.dtype]  # per parameter: buckets never mix dtypes
    tail_s: float = 0.0  # after compute and communication, until backward returns (copy-back)
    optimizer_s: float = 0.0
    compute_end_s: float = 0.0  # backward computing past the last gradient (an input's gradient, say)

    @property
    def backward_s(self) -> float:  # backward's compute: until the last gradient, or later
        return max(self.compute_end_s, *self.ready_s)

    @property
    def nbytes(self) -> list[int]:
        return [n * torch.empty((), dtype=d).element_size() for n, d in zip(self.numels, self.dtypes)]

    @classmethod
    def from_events(cls, events: list[dict], named_params) -> StepProfile:
        """From one rank's events of one step (forward / optimizer spans recorded with
        ``Tracer.span``); ``named_params``: the wrapped module's ``named_parameters()``."""
        t = {}
        for e in sorted(events, key=lambda e: e["t"]):
            t.setdefault(e.get("param", e["name"]), e["t"])  # a gradient by its parameter's name
        named = [(n, p) for n, p in named_params if p.requires_grad]
        bw, end = t["backward start"], t["backward end"]
        ready = [t[n] - bw for n, _ in named]
        finished = [e["t"] - bw for e in events if e["name"] == "bucket finished"]
        forward = bw - t.get("forward start", bw)  # forward, and the loss: everything before backward
        optimizer = t.get("optimizer end", t.get("optimizer step", end)) - end
        tail = max(0.0, end - bw - max(ready + finished))
        return cls(forward, ready, [p.numel() for _, p in named], [p.dtype for _, p in named], tail, optimizer)

    @classmethod
    def slowest(cls, profiles: list[StepProfile]) -> StepProfile:
        """Ranks start a step together and a bucket finishes when the *last* rank launched it:
        combine per-rank profiles into one that is, at each point, the latest rank."""
        fwd = max(p.forward_s for p in profiles)
        ready = [max(p.forward_s + p.ready_s[i] for p in profiles) - fwd for i in range(len(profiles[0].ready_s))]
        return cls(fwd, ready, profiles[0].numels, profiles[0].dtypes, max(p.tail_s for p in profiles),
                   max(p.optimizer_s for p in profiles), max(p.forward_s + p.compute_end_s for p in profiles) - fwd)
# --8<-- [end:profile]


def rebuilt_assignment(profile: StepProfile, bucket_cap_mb: float | None) -> list[list[int]]:
    """The buckets DDP uses after its one-time rebuild: filled in gradient-arrival order,
    reduced in that order (``Reducer.rebuild``; torch's ``rebuild_buckets``)."""
    order = sorted(range(len(profile.ready_s)), key=lambda i: profile.ready_s[i])
    meta = [torch.empty(profile.numels[i], dtype=profile.dtypes[i], device="meta") for i in order]
    return [[order[j] for j in bucket] for bucket in compute_bucket_assignment(meta, bucket_size_limits(bucket_cap_mb))]


# --8<-- [start:simulate]
@dataclasses.dataclass
class Prediction:
    """What ``simulate`` returns: seconds, bucket times from the backward's start."""

    step_s: float
    exposed_comm_s: float  # communication still running after backward's compute ended
    comm_s: float  # the sum of every bucket's α + β·bytes
    launch_s: list[float]  # per bucket, from the backward's start
    finish_s: list[float]
    bucket_bytes: list[int]


def simulate(profile: StepProfile, assignment: list[list[int]], ab: AlphaBeta,
             overlap_cost: float = 0.0) -> Prediction:
    """One communication stream, buckets in order: each starts when it is full AND the previous
    one has finished (collectives are issued in bucket order; one runs at a time).
    ``overlap_cost``: the share of an all-reduce's time it takes from a backward running beside
    it. 0: overlap is free (a GPU's backward, NCCL on its own stream); 1: the two share the
    same cores (gloo on a saturated CPU): the backward pauses, and the step is the closed form's."""
    if not 0 <= overlap_cost <= 1:
        raise ValueError(f"overlap_cost={overlap_cost!r} must be between 0 (free overlap) and 1 (none)")
    busy: list[tuple[float, float]] = []  # all-reduces so far, (start, end): the backward slows in them

    def wall(c: float) -> float:  # when the backward reaches ``c`` seconds of its own compute
        t = 0.0
        for start, end in busy:
            if start >= t + c:
                break
            c, t = c - (start - t), start  # full speed until this all-reduce starts
            done = (1 - overlap_cost) * (end - start)  # compute done beside it
            if done >= c:
                return t + c / (1 - overlap_cost)
            c, t = c - done, end
        return t + c

    sizes = [sum(profile.nbytes[i] for i in bucket) for bucket in assignment]
    for bucket, nbytes in zip(assignment, sizes):
        start = max(wall(max(profile.ready_s[i] for i in bucket)), busy[-1][1] if busy else 0.0)
        busy.append((start, start + ab.seconds(nbytes)))
    backward_end = wall(profile.backward_s)
    end = max(backward_end, busy[-1][1])
    step = profile.forward_s + end + profile.tail_s + profile.optimizer_s
    return Prediction(step, end - backward_end, sum(ab.seconds(b) for b in sizes), [s for s, _ in busy],
                      [f for _, f in busy], sizes)


def naive_step_time(profile: StepProfile, assignment: list[list[int]], ab: AlphaBeta) -> float:
    """No overlap at all: compute, then every bucket's all-reduce, one after the other."""
    comm = sum(ab.seconds(sum(profile.nbytes[i] for i in bucket)) for bucket in assignment)
    return profile.forward_s + profile.backward_s + comm + profile.tail_s + profile.optimizer_s
# --8<-- [end:simulate]


# --8<-- [start:predict]
def predict_step_time(profile: StepProfile, ab: AlphaBeta, bucket_cap_mb: float | None = None,
                      overlap_cost: float = 0.0) -> Prediction:
    """The step time DDP would take with ``bucket_cap_mb`` (``None``: torch's 1 MiB + 25 MiB)."""
    return simulate(profile, rebuilt_assignment(profile, bucket_cap_mb), ab, overlap_cost)


def best_bucket_cap_mb(profile: StepProfile, ab: AlphaBeta, caps=(0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100),
                       overlap_cost: float = 0.0) -> tuple[float, dict]:
    """The cap with the smallest predicted step (the first one on a tie), and every prediction."""
    predictions = {cap: predict_step_time(profile, ab, cap, overlap_cost) for cap in caps}
    return min(caps, key=lambda cap: predictions[cap].step_s), predictions
# --8<-- [end:predict]
