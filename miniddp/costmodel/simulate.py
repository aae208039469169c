"""The cost model: a DDP step simulated from one traced backward, for any bucket size.

What
    ``simulate`` replays a ``StepProfile``'s backward with a bucket assignment and **one
    communication stream**: buckets in order, each starting at max(its last gradient ready,
    the previous one's finish), each taking α + β·bytes (``AlphaBeta``). Step = forward +
    max(backward end, last finish) + tail + optimizer; what runs after the backward is the
    *exposed* communication. ``predict_step_time`` simulates the buckets DDP builds after its
    rebuild (``assignment_in_ready_order``); ``best_bucket_cap_mb`` sweeps caps;
    ``naive_step_time`` is the closed form without overlap, kept to check the simulation.
    ``Compression`` describes a comm hook (wire bytes, all-reduces and compute per bucket) and
    ``AlphaBeta.on_link`` a link of a given rate, so the same replay predicts fp16 or PowerSGD
    over 1 Gbit/s; ``with_bucket_copies`` adds DDP's copies to a plain model's backward.

Why
    ``bucket_cap_mb`` trades α, paid once per bucket, against overlap: a bucket can only start
    when it is full, and whatever is still in flight when backward ends is exposed. Li et al.
    measure this trade-off ("PyTorch Distributed", VLDB 2020, arXiv 2006.15704: §5, the
    "Bucket Size" experiments); the model lets a reader reason about *their* model and network.

How torch differs
    torch has no cost model: ``bucket_cap_mb`` is a number you pick (Hugging Face:
    ``ddp_bucket_cap_mb``). Overlap is free only if communication takes nothing from the
    backward: on CPU gloo's threads need the backward's cores, which ``overlap_cost`` models.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.bucketing import bucket_size_limits, compute_bucket_assignment
from .alpha_beta import AlphaBeta
from .step_profile import StepProfile


def assignment_in_ready_order(profile: StepProfile, bucket_cap_mb: float | None) -> list[list[int]]:
    """The buckets DDP uses after its one-time rebuild: filled in gradient-arrival order,
    reduced in that order (``Reducer.rebuild``; torch's ``rebuild_buckets``)."""
    order = sorted(range(len(profile.ready_s)), key=lambda i: profile.ready_s[i])
    meta = [torch.empty(profile.numels[i], dtype=profile.dtypes[i], device="meta") for i in order]
    return [[order[j] for j in bucket] for bucket in compute_bucket_assignment(meta, bucket_size_limits(bucket_cap_mb))]


# --8<-- [start:copies]
def with_bucket_copies(profile: StepProfile, copy_s_per_byte: float) -> StepProfile:
    """``profile`` (a plain model's backward: compute alone) with what DDP adds on the backward's own
    thread: each gradient copied into its bucket as it arrives (a later gradient waits for the copies
    before it), and the averages copied back into ``.grad`` after the last bucket (the tail)."""
    order = sorted(range(len(profile.ready_s)), key=lambda i: profile.ready_s[i])
    ready, spent = list(profile.ready_s), 0.0
    for i in order:
        spent += copy_s_per_byte * profile.nbytes[i]
        ready[i] += spent
    return dataclasses.replace(profile, ready_s=ready, tail_s=profile.tail_s + copy_s_per_byte * sum(profile.nbytes))
# --8<-- [end:copies]


# --8<-- [start:compression]
@dataclasses.dataclass(frozen=True)
class Compression:
    """A comm hook as the simulation sees it: per bucket, ``collectives`` all-reduces (α each), the bytes
    it puts on the wire (β each) and its compute (``compute_s_per_byte`` of the bucket's gradients,
    measured once: casting, or PowerSGD's products and orthogonalisation)."""

    name: str = "fp32"
    wire_ratio: float = 1.0  # wire bytes per gradient byte: 0.5 for fp16 / bf16
    powersgd_rank: int = 0  # > 0: each matrix worth it travels as P and Q, (n + m) r numbers
    collectives: int = 1
    compute_s_per_byte: float = 0.0
    min_compression_rate: float = 2  # PowerSGDState's: compress only if n m > rate (n + m) r

    def wire_bytes(self, profile: StepProfile, bucket: list[int]) -> int:
        if not self.powersgd_rank:
            return int(self.wire_ratio * sum(profile.nbytes[i] for i in bucket))
        total = 0
        for i in bucket:  # as powersgd._shape_rank views each gradient: (shape[0], -1)
            shape = profile.shapes[i] if profile.shapes else (profile.numels[i],)
            n = shape[0] if shape else 1
            m = profile.numels[i] // max(n, 1)
            r = min(n, m, self.powersgd_rank)
            element = profile.nbytes[i] // max(profile.numels[i], 1)
            worth = (n + m) * r * self.min_compression_rate < n * m
            total += (n + m) * r * element if worth else profile.nbytes[i]
        return total

    def seconds(self, ab: AlphaBeta, profile: StepProfile, bucket: list[int]) -> float:
        compute = self.compute_s_per_byte * sum(profile.nbytes[i] for i in bucket)
        return self.collectives * ab.alpha_s + ab.beta_s_per_byte * self.wire_bytes(profile, bucket) + compute


FP32 = Compression()
# --8<-- [end:compression]


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
             overlap_cost: float = 0.0, hook: Compression | None = None) -> Prediction:
    """One communication stream, buckets in order: each starts when it is full AND the previous
    one has finished (collectives are issued in bucket order; one runs at a time).
    ``overlap_cost``: the share of an all-reduce's time it takes from a backward running beside
    it. 0: overlap is free (a GPU's backward, NCCL on its own stream); 1: the two share the
    same cores (gloo on a saturated CPU): the backward pauses, and the step is the closed form's.
    ``hook``: a compression comm hook's bytes, collectives and compute per bucket (None: fp32)."""
    hook = hook or FP32
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

    sizes = [hook.wire_bytes(profile, bucket) for bucket in assignment]
    took = [hook.seconds(ab, profile, bucket) for bucket in assignment]
    for bucket, seconds in zip(assignment, took):
        start = max(wall(max(profile.ready_s[i] for i in bucket)), busy[-1][1] if busy else 0.0)
        busy.append((start, start + seconds))
    backward_end = wall(profile.backward_s)
    end = max(backward_end, busy[-1][1])
    step = profile.forward_s + end + profile.tail_s + profile.optimizer_s
    return Prediction(step, end - backward_end, sum(took), [s for s, _ in busy], [f for _, f in busy], sizes)


def naive_step_time(profile: StepProfile, assignment: list[list[int]], ab: AlphaBeta) -> float:
    """No overlap at all: compute, then every bucket's all-reduce, one after the other."""
    comm = sum(ab.seconds(sum(profile.nbytes[i] for i in bucket)) for bucket in assignment)
    return profile.forward_s + profile.backward_s + comm + profile.tail_s + profile.optimizer_s
# --8<-- [end:simulate]


# --8<-- [start:predict]
def predict_step_time(profile: StepProfile, ab: AlphaBeta, bucket_cap_mb: float | None = None,
                      overlap_cost: float = 0.0, hook: Compression | None = None) -> Prediction:
    """The step time DDP would take with ``bucket_cap_mb`` (``None``: torch's 1 MiB + 25 MiB)."""
    return simulate(profile, assignment_in_ready_order(profile, bucket_cap_mb), ab, overlap_cost, hook)


def best_bucket_cap_mb(profile: StepProfile, ab: AlphaBeta, caps=(0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100),
                       overlap_cost: float = 0.0) -> tuple[float, dict]:
    """The cap with the smallest predicted step (the first one on a tie), and every prediction."""
    predictions = {cap: predict_step_time(profile, ab, cap, overlap_cost) for cap in caps}
    return min(caps, key=lambda cap: predictions[cap].step_s), predictions
# --8<-- [end:predict]
