"""A monitored barrier: wait for every rank, or say which ones never came.

What
    ``monitored_barrier(timeout)`` returns once every rank of the group has arrived, or raises
    ``StalledRankError`` whose ``.missing`` names the ranks that did not, on every rank that
    waited; a latecomer raises too, learning that the others gave up on it.

Why
    A timeout alone says that *someone* was late, on the rank that waited. Before a step that
    may take long on one rank only (loading a model, writing a checkpoint), a barrier that
    names the absent rank points at the process to look at.

How torch differs
    ``torch.distributed.monitored_barrier`` (``torch/distributed/distributed_c10d.py``) is
    gloo-only, and only rank 0 learns who is missing. This one uses the group's key-value
    store: any backend, and every rank can name the missing ones.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .stalled_ranks import StalledRankError
from .timeouts import as_timedelta

_barrier_calls = 0  # how many monitored barriers this process has entered (keys are per call)


# --8<-- [start:monitored_barrier]
def monitored_barrier(timeout=60, store=None, group=None) -> None:
    """Wait until every rank arrives, or raise ``StalledRankError`` naming the absent ones.

    Each rank writes ``mb/<call>/<rank>`` to the store and waits for all the others'
    keys. On timeout it checks which keys are missing: those ranks are the stalled
    ones, and every rank that timed out can say so (torch's gloo-only version
    tells only rank 0). It also marks the call failed, so that a latecomer
    raises too instead of sailing through a barrier the others gave up on.
    """
    global _barrier_calls
    _barrier_calls += 1
    deadline = as_timedelta(timeout, name="timeout")
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = dist.get_rank()
    prefix = f"mb/{_barrier_calls}"
    store.set(f"{prefix}/{me}", "arrived")
    start = time.monotonic()
    try:
        store.wait([f"{prefix}/{r}" for r in ranks], deadline)
    except dist.DistStoreError:  # the store's wait timed out
        missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
        if not missing:  # the last one arrived just as we gave up: that is a pass
            return
        store.set(f"{prefix}/failed", ",".join(map(str, missing)))
        waited = time.monotonic() - start
        raise StalledRankError(
            f"rank {me}: rank(s) {missing} did not reach the barrier within {waited:.1f} s "
            f"(timeout {deadline.total_seconds():g} s). Look at what those ranks were doing: "
            "a slow load or save, a data loader stall, an exception, or a branch only some ranks take.",
            missing,
        ) from None
    if store.check([f"{prefix}/failed"]):
        missing = [int(r) for r in store.get(f"{prefix}/failed").decode().split(",") if r]
        raise StalledRankError(
            f"rank {me} reached the barrier late: the other ranks gave up waiting for rank(s) {missing}",
            missing,
        )
# --8<-- [end:monitored_barrier]
