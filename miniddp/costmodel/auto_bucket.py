"""``bucket_cap_mb="auto"``: the cost model picks the bucket size at the one-time rebuild.

What
    ``AutoBucketCap`` observes the reducer (``observers.ReducerObserver``): during the first
    synced backward it records when each gradient became ready. At the rebuild DDP calls
    ``choose`` on every rank: a short all-reduce sweep on the live group (4 KiB..16 MiB) fitted
    to α–β, the ranks' ready times combined (``StepProfile.slowest``), ``best_bucket_cap_mb``
    over ``CANDIDATE_CAPS``, and rank 0's pick broadcast. ``choose_bucket_cap_mb`` is the pure
    part (a profile and a fit in, an ``AutoChoice`` out), so a test can feed it made-up numbers.
    ``miniddp.DistributedDataParallel`` (``miniddp/composed.py``) builds one for ``bucket_cap_mb="auto"``;
    this module registers nothing when imported.

Why
    The best cap depends on the model (how gradients arrive), the network (α, β) and whether
    communication really overlaps the backward (``docs/costmodel.md`` measures all three). On a
    CPU gloo's threads and the backward share the cores: the overlap cost is the share of an
    all-reduce's time the CPU works for it, measured (near 1 over loopback, under 0.1 over a
    1 Gbit/s link); CUDA tensors assume free overlap (NCCL runs on its own stream).

How torch differs
    torch has no such option: ``bucket_cap_mb`` is a number you pick (Hugging Face:
    ``ddp_bucket_cap_mb``). torch's reducer records ready times too (``backward_stats_``) but
    only reports them (``_get_ddp_logging_data``).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..engine.observers import ReducerObserver
from ..process_group.fingerprint import issued_as
from .alpha_beta import AlphaBeta, fit_alpha_beta, measure_all_reduce, measure_cpu_share
from .simulate import best_bucket_cap_mb
from .step_profile import StepProfile

CANDIDATE_CAPS = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100)  # MiB
TIE = 0.01  # predicted steps this close are a tie, won by the larger cap
SWEEP_BYTES = (2**12, 2**16, 2**20, 2**22, 2**24)  # the all-reduce sizes the fit sees: 4 KiB .. 16 MiB
SWEEP_REPS = 3  # repetitions per size (median of the slowest rank)


def default_overlap_cost(device: torch.device, group=None) -> float:
    """0: NCCL beside a GPU backward (free overlap). On a CPU, measured: the share of an all-reduce's time
    the process's CPU works for it (``measure_cpu_share``), which is what it takes from the backward."""
    return 0.0 if device.type == "cuda" else measure_cpu_share(2**22, reps=SWEEP_REPS, group=group)


# --8<-- [start:choose]
@dataclasses.dataclass
class AutoChoice:
    """What ``bucket_cap_mb="auto"`` chose, and why."""

    cap_mb: float  # the cap the buckets were rebuilt with
    overlap_cost: float  # what simulate was told about overlap
    alpha_beta: AlphaBeta | None  # the fit on the live group (None: restored from a checkpoint)
    predicted_ms: dict  # cap -> predicted backward + exposed communication (ms), from the backward's start
    buckets: dict  # cap -> how many buckets it gives
    measure_s: float = 0.0  # what measuring and choosing cost this rank (seconds)

    def report(self) -> dict:
        ab = self.alpha_beta
        return {"bucket_cap_mb": self.cap_mb, "overlap_cost": self.overlap_cost, "measure_s": self.measure_s,
                "alpha_us": ab.alpha_us if ab else None, "algbw_GBps": ab.algbw_GBps if ab else None,
                "predicted_ms": dict(self.predicted_ms), "buckets": dict(self.buckets)}


def choose_bucket_cap_mb(profile: StepProfile, ab: AlphaBeta, *, overlap_cost: float,
                         caps=CANDIDATE_CAPS) -> AutoChoice:
    """The cap ``best_bucket_cap_mb`` predicts fastest for this profile and fit (pure: no communication); on a
    near-tie (``TIE``) the largest: fewer collectives, each with costs the model does not see (a launch)."""
    best, predictions = best_bucket_cap_mb(profile, ab, caps=caps, overlap_cost=overlap_cost)
    best = max(c for c in caps if predictions[c].step_s <= predictions[best].step_s * (1 + TIE))
    return AutoChoice(best, overlap_cost, ab, {c: p.step_s * 1e3 for c, p in predictions.items()},
                      {c: len(p.launch_s) for c, p in predictions.items()})


def profile_from_ready(ready_by_rank: list, params) -> StepProfile:
    """One profile from each rank's ``{parameter index: ready seconds}`` (``None``: a rank that saw no synced
    backward, e.g. joined before it): the latest rank at each parameter; one that never arrived is ready last.
    No rank with times (a resume from a checkpoint without them): every gradient ready at once."""
    seen = [r for r in ready_by_rank if r] or [{}]
    end = max((t for r in seen for t in r.values()), default=0.0)
    profiles = [StepProfile(0.0, [r.get(i, end) for i in range(len(params))], [p.numel() for p in params],
                            [p.dtype for p in params]) for r in seen]
    return StepProfile.slowest(profiles)
# --8<-- [end:choose]


class AutoBucketCap(ReducerObserver):
    """``bucket_cap_mb="auto"``: observes the first synced backward's ready times, then chooses once."""

    def __init__(self, overlap_cost: float | None = None, caps=CANDIDATE_CAPS):
        self.overlap_cost = overlap_cost  # None: default_overlap_cost of the parameters' device
        self.caps = tuple(caps)  # the candidates
        self.t0: float | None = None  # perf_counter at the first synced backward's start
        self.ready_s: dict[int, float] = {}  # parameter index -> seconds from t0 to its gradient
        self.recording = True  # until the first synced backward ends
        self.choice: AutoChoice | None = None  # set by choose (or restore)

    def backward_started(self) -> None:
        if self.recording and self.t0 is None:
            self.t0 = time.perf_counter()

    def grad_ready(self, index: int, name: str) -> None:
        if self.recording and self.t0 is not None:
            self.ready_s.setdefault(index, time.perf_counter() - self.t0)

    def backward_ended(self) -> None:
        self.recording = False

    def restore(self, cap_mb: float) -> None:
        """A resumed run: the cap the interrupted run chose, no measurement."""
        self.choice = AutoChoice(cap_mb, float("nan"), None, {}, {})

    def layout_state(self) -> dict:
        """What a resumed run needs: the cap chosen, else the ready times recorded so far."""
        return {"auto_bucket_cap_mb": self.choice.cap_mb if self.choice is not None else None,
                "auto_ready_s": sorted(self.ready_s.items())}

    def load_layout_state(self, state: dict) -> None:
        if state.get("auto_bucket_cap_mb") is not None:
            self.restore(state["auto_bucket_cap_mb"])  # the interrupted run's choice: no re-measuring
        elif state.get("auto_ready_s"):
            self.ready_s = {int(i): float(t) for i, t in state["auto_ready_s"]}  # saved before the rebuild
            self.recording = False

    # --8<-- [start:collective]
    @issued_as("bucket order broadcast")  # part of the rebuild, as a desync message names it
    def choose(self, params, group) -> float:
        """Every rank of ``group`` together (a joined rank too, shadowing the rebuild): the agreed cap."""
        if self.choice is not None:
            return self.choice.cap_mb
        start, device = time.perf_counter(), params[0].device
        points = measure_all_reduce(SWEEP_BYTES, reps=SWEEP_REPS, group=group, device=device)
        ab = fit_alpha_beta(*zip(*points), world_size=dist.get_world_size(group), backend=dist.get_backend(group))
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.ready_s or None, group=group)
        overlap = default_overlap_cost(device, group) if self.overlap_cost is None else self.overlap_cost
        choice = choose_bucket_cap_mb(profile_from_ready(everyone, params), ab, overlap_cost=overlap, caps=self.caps)
        agreed = torch.tensor([choice.cap_mb], dtype=torch.float64, device=device)
        dist.broadcast(agreed, src=dist.get_global_rank(group, 0), group=group)  # rank 0's pick, everywhere
        choice.cap_mb = agreed.item()
        choice.measure_s = time.perf_counter() - start
        self.choice, self.ready_s = choice, {}
        return choice.cap_mb
    # --8<-- [end:collective]
