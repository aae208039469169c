"""Uneven inputs: ranks that ran out of data shadow the collectives of those still training.

What
    ``ddp.join()`` (``Join`` here) is a context manager around the training loop.
    Every grad-enabled forward of a rank that still has data starts with one small
    all-reduce, the *round*: which ranks are still active, will this backward
    all-reduce gradients, is the one-time bucket rebuild due. A rank that leaves
    the loop (its data is exhausted) enters ``__exit__`` and keeps answering
    rounds: for each one it issues exactly the collectives the active ranks are
    about to issue (the rebuild broadcast, the buffer broadcast, each bucket's
    comm hook on zeros, the used counts) until a round finds nobody active.
    Then every rank copies the model of the last rank to finish, so all end
    identical.

Why
    Collectives match by order, not by name. With 10 batches on rank 0 and 9 on
    rank 1, rank 0's tenth backward all-reduces its buckets while rank 1 has
    moved on to the barrier or the checkpoint after the loop: a hang until the
    timeout, a "Connection reset by peer", or gloo summing a bucket with a
    differently sized message (SIGABRT "op.preamble.length <= op.nbytes"). Data
    sharding makes uneven inputs common: ``drop_last=False`` with a dataset that
    does not divide, a ``DataLoader`` that filters samples, variable-length
    batches packed per rank.

    Gradients: a joined rank contributes zeros. ``divide_by_initial_world_size
    =True`` divides by the world size anyway (the joined ranks count as zeros:
    smaller steps, the same rule as torch's default); ``False`` divides by the
    number of ranks still active (the average of those that really have data).

How torch differs
    Same semantics as ``DistributedDataParallel.join`` built on
    ``torch/distributed/algorithms/join.py`` (``Join``, ``Joinable``, and DDP's
    ``_DDPJoinHook``): torch's active ranks announce themselves with an
    all-reduce of ones (plus one to say whether they sync, plus a MAX all-reduce
    to pick the buffer source); we fold all of that into one all-reduce of a
    ``world_size + 2`` vector. As in torch, buffers are broadcast from the
    highest active rank while the context is open, and the final model comes
    from the highest rank among the last to finish. torch's ``Join`` can also
    drive other ``Joinable`` objects (``ZeroRedundancyOptimizer``); ours only
    drives ``miniddp.DistributedDataParallel``. Inside the context, only DDP's
    own collectives are shadowed: a ``dist.all_reduce`` of your own (a metric)
    on an active rank has no partner on a joined rank (torch: the same).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..process_group.desync import issued_as
from .unused import UsedCounts

WARN_AFTER_ROUNDS = 1000  # torch warns when joined ranks shadow this many iterations


class EarlyTerminationError(RuntimeError):
    """``throw_on_early_termination=True`` and some rank ran out of inputs; raised on every rank."""


# --8<-- [start:round]
@dataclass(frozen=True)
class Round:
    """What one grad-enabled forward will do, agreed by every rank (active or joined)."""

    active: tuple[int, ...]  # group ranks that still have data in this iteration
    will_sync: bool  # does the coming backward all-reduce gradients (not under no_sync)?
    rebuild: bool  # is the one-time bucket rebuild due before this forward?

    @property
    def source(self) -> int:
        """Where buffers come from: the highest active rank (rank 0 may have joined)."""
        return max(self.active)


@issued_as("join round")
def exchange_round(world_size: int, rank: int, device, group, *, active: bool, will_sync: bool,
                   rebuild: bool) -> Round:
    """One all-reduce of ``[active one-hot..., will_sync, rebuild]``: a joined rank sends zeros."""
    flags = torch.zeros(world_size + 2, device=device)
    if active:
        flags[rank] = 1
        flags[world_size] = float(will_sync)
        flags[world_size + 1] = float(rebuild)
    dist.all_reduce(flags, group=group)
    counts = flags.tolist()
    return Round(active=tuple(r for r in range(world_size) if counts[r] > 0),
                 will_sync=counts[world_size] > 0, rebuild=counts[world_size + 1] > 0)
# --8<-- [end:round]


class Join:
    """Context manager returned by ``DistributedDataParallel.join(...)``; see the module docstring."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
                 throw_on_early_termination: bool = False):
        self.ddp = ddp  # the wrapper whose collectives we shadow
        self.divide_by_initial_world_size = divide_by_initial_world_size  # divisor: world size or active ranks
        self.enable = enable  # False: a plain no-op context (torch's flag)
        self.throw = throw_on_early_termination  # raise everywhere as soon as one rank runs out
        self.world_size = dist.get_world_size(ddp.process_group)
        self.rank = dist.get_rank(ddp.process_group)  # our rank inside the DDP group
        self.last_active: tuple[int, ...] = ()  # who was active in the latest round with anyone active

    def __enter__(self):
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("DistributedDataParallel.join() is already open for this model; do not nest it")
            self.ddp._join = self
        return self

    # --8<-- [start:notify]
    def notify(self, will_sync: bool, rebuild: bool) -> Round:
        """Called by an active rank's grad-enabled forward: take part in this iteration's round."""
        plan = exchange_round(self.world_size, self.rank, self.ddp.device, self.ddp.process_group,
                              active=True, will_sync=will_sync, rebuild=rebuild)
        self.last_active = plan.active
        if self.throw and len(plan.active) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(plan.active))
            raise EarlyTerminationError(f"rank(s) {missing} exhausted their inputs (throw_on_early_termination=True); "
                                        f"raising on every rank, rank {self.rank} included")
        return plan

    def divisor(self, plan: Round) -> int:
        """What the gradients are divided by in this round's backward."""
        return self.world_size if self.divide_by_initial_world_size else len(plan.active)
    # --8<-- [end:notify]

    # --8<-- [start:exit]
    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        self.ddp._join = None
        if exc_type is not None:  # an error inside the loop: propagate it, do not shadow anything
            return False
        rounds = 0
        while True:  # this rank is out of data: answer rounds until nobody is active
            plan = exchange_round(self.world_size, self.rank, self.ddp.device, self.ddp.process_group,
                                  active=False, will_sync=False, rebuild=False)
            if not plan.active:
                break
            self.last_active = plan.active
            if self.throw:
                raise EarlyTerminationError(f"rank {self.rank} exhausted its inputs (throw_on_early_termination=True)")
            rounds += 1
            if rounds == WARN_AFTER_ROUNDS:
                warnings.warn(f"rank {self.rank} has shadowed {rounds} iterations of the other ranks: the inputs are "
                              "very uneven; consider balancing the shards", stacklevel=2)
            self.shadow(plan)
        self.sync_final_model()
        return False

    @issued_as("join's zeros for each bucket")
    def shadow(self, plan: Round) -> None:
        """Issue what an active rank issues in one iteration, in the same order, with nothing to say."""
        self.ddp._sync_before_forward(rebuild=plan.rebuild, source=plan.source)  # rebuild + buffer broadcast
        if plan.will_sync:
            shadow_backward(self.ddp.reducer)

    def sync_final_model(self) -> None:
        """Everyone takes the model of the highest rank among the last to finish."""
        source = max(self.last_active) if self.last_active else self.world_size - 1
        self.ddp._sync_module_states(source)
    # --8<-- [end:exit]


def shadow_backward(reducer) -> None:
    """A joined rank's share of a backward it sits out: each bucket's comm hook on zeros, then the used
    counts (all zero), in the order the active ranks issue them (``reducer.py``). torch runs the hook
    on zeros too (``DistributedDataParallel._match_all_reduce_for_bwd_pass``)."""
    for b in reducer.buckets:
        zeros = b.for_hook(is_last=b.index == len(reducer.buckets) - 1, pre_divided=not reducer.custom_hook,
                           buffer=torch.zeros_like(b.buffer))
        reducer.hook(reducer.hook_state, zeros).wait()  # the next bucket only after this one, as active ranks do
    UsedCounts(len(reducer.params), used=0).all_reduce(reducer.group, reducer.buckets[0].buffer.device).wait()
