"""DDP's join hook (``DDPJoinHook``): what a joined rank shadows of one DDP iteration, and the active ranks' mean.

What
    ``DDPJoinHook`` is DDP's ``JoinHook`` for the generic ``Join`` (``join.py``). Its ``round_flags`` are DDP's
    part of each round: ``will_sync`` (does the coming backward sync) and ``rebuild`` (is the one-time bucket
    rebuild due), which DDP's forward passes to ``Join.notify``. On a joined rank, ``main_hook`` does what every rank
    does before a grad-enabled forward (the one-time rebuild, the buffer broadcast) and, when the active ranks'
    backward syncs, a backward without gradients through ``ZerosForEachBucket``: the active ranks' bucket
    collective, in bucket order, on zeros, landing nowhere. On an active rank, ``active_collective`` is the
    reducer's collective over the right number of ranks: the world size (joined ranks count as zeros), or
    only the active ranks (``divide_by_initial_world_size=False``). What join asks of a collective beyond the
    reducer's interface is the ``JoinAware`` protocol: ``dividing_by(n)`` and ``land_joined``; a collective
    without them (a comm hook, which divides by itself) is used unchanged and lands nothing on a joined rank.

Why
    Join's shadow is not part of a backward's core; here it is two implementations of the reducer's collective
    seam (``bucket_collective.py``), owned by join's code, and the reducer has no joined-rank state.

How torch differs
    torch's ``_DDPJoinHook`` (``torch/nn/parallel/distributed.py``) calls ``_match_all_reduce_for_bwd_pass``:
    one all-reduce of zeros per bucket, matching the default path only; with a comm hook it runs the hook on
    zeros, as here. Its ``divide_by_initial_world_size=False`` sets the reducer's ``div_factor_`` per iteration.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..process_group.fingerprint import issued_as
from .bucket_collective import BucketCollective
from .join import JoinHook, Round


# --8<-- [start:join_aware]
@runtime_checkable
class JoinAware(Protocol):
    """What join asks of a bucket collective that divides on the way in (the default path, ZeRO-2's)."""

    def dividing_by(self, n: int) -> BucketCollective:
        """This collective for a backward whose mean is over ``n`` ranks (join: the active ones)."""

    def land_joined(self, bucket, result: torch.Tensor, counts: list[int]) -> None:
        """On a joined rank (its zeros went in): what lands, if this rank owns part of the result (ZeRO)."""
# --8<-- [end:join_aware]


# --8<-- [start:zeros]
class ZerosForEachBucket(BucketCollective):
    """A joined rank's share of a bucket: the active ranks' collective (``inner``), on zeros of the bucket's
    layout (the bucket itself may be ``.grad``'s storage), its result kept nowhere."""

    def __init__(self, inner: BucketCollective):
        self.inner = inner
        self.name = inner.name  # the active ranks' name: a stalled collective is named alike on every rank
        self.call_order = inner.call_order  # the active ranks' ordering rule: the same collectives, the same order

    def issue(self, bucket, flat, is_last, group):
        with issued_as(f"join's zeros for bucket {bucket.index}"):
            return self.inner.issue(bucket, torch.zeros_like(flat), is_last, group)

    def result(self, bucket, value):
        return self.inner.result(bucket, value)

    def land(self, bucket, result, counts, as_view) -> None:
        """The joined rank's ``.grad`` stays as it was (torch: the same); a shard it owns still lands (ZeRO-2)."""
        if isinstance(self.inner, JoinAware):
            self.inner.land_joined(bucket, result, counts)
# --8<-- [end:zeros]


# --8<-- [start:join_hook]
class DDPJoinHook(JoinHook):
    """What a joined rank shadows of one DDP iteration (torch: ``_DDPJoinHook``), and the collective of the
    active ranks' mean: over the world size (joined ranks count as zeros), or only the ranks still active."""

    round_flags = ("will_sync", "rebuild")  # DDP's part of a round: will the backward sync, is the rebuild due

    def __init__(self, ddp, divide_by_initial_world_size: bool = True):
        self.ddp = ddp  # the DistributedDataParallel it shadows
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def active_collective(self, plan: Round) -> BucketCollective:
        n = dist.get_world_size(self.ddp.process_group) if self.divide_by_initial_world_size else len(plan.active)
        collective = self.ddp.reducer.collective
        return collective.dividing_by(n) if isinstance(collective, JoinAware) else collective

    def main_hook(self, plan: Round) -> None:
        self.ddp.sync_before_forward(rebuild=plan.flags["rebuild"], source=plan.source)  # rebuild + buffer broadcast
        if plan.flags["will_sync"]:  # the active ranks' bucket collectives, on zeros
            self.ddp.reducer.backward_without_gradients(ZerosForEachBucket(self.ddp.reducer.collective))

    def post_hook(self, source: int) -> None:
        self.ddp.sync_module_states(source)
# --8<-- [end:join_hook]
