"""The cost model: a DDP step simulated from one traced backward, for any bucket size.

What
    ``simulate`` replays a ``StepProfile``'s backward with a bucket assignment and **one
    communication stream**: buckets in order, each starting at max(its last gradient ready,
    the previous one's finish), each taking α + β·bytes (``AlphaBeta``). Step = forward +
    max(backward end, last finish) + tail + optimizer; what runs after the backward is the
    *exposed* communication. ``predict_step_time`` simulates the buckets DDP builds after its
    rebuild (``assignment_in_ready_order``); ``best_bucket_cap_mb`` sweeps caps;
    ``naive_step_time`` is the closed form without overlap, kept to check the simulation.

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

from .alpha_beta import AlphaBeta
from .bucketing import bucket_size_limits, compute_bucket_assignment
from .step_profile import StepProfile


def assignment_in_ready_order(profile: StepProfile, bucket_cap_mb: float | None) -> list[list[int]]:
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
    return simulate(profile, assignment_in_ready_order(profile, bucket_cap_mb), ab, overlap_cost)


def best_bucket_cap_mb(profile: StepProfile, ab: AlphaBeta, caps=(0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100),
                       overlap_cost: float = 0.0) -> tuple[float, dict]:
    """The cap with the smallest predicted step (the first one on a tie), and every prediction."""
    predictions = {cap: predict_step_time(profile, ab, cap, overlap_cost) for cap in caps}
    return min(caps, key=lambda cap: predictions[cap].step_s), predictions
# --8<-- [end:predict]
