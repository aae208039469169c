"""One rank's error is every rank's: file work done on one rank, with its failure raised on all.

What
    ``on_every_rank(fn, what)`` runs ``fn`` on this rank (ranks that have nothing to do pass None),
    then all-gathers whether it raised one of ``errors``. If any rank did, every rank raises the
    first such rank's error, of the same type, so callers catch it by type. The all-gather is also
    a barrier, and its timeout names the rank still working (``naming_stalled_ranks``).

Why
    Rank 0 writes the checkpoint, the final model and the metrics. When its disk is full, rank 0
    raises and the other ranks wait in their next collective until ``ddp_timeout``, then fail with
    "Timed out" and no cause. Gathering the outcome turns that into one clear error on every rank.

How torch and Hugging Face differ
    A ``dist.barrier()`` after rank-0 work leaves the others waiting until the timeout when rank 0
    fails; ``dist.monitored_barrier`` names the missing rank, not its error. Accelerate's
    ``main_process_first()`` and ``on_main_process`` choose *where* code runs, not what the other
    ranks learn when it fails.
"""

from __future__ import annotations

import torch.distributed as dist

from ..process_group.stalled_ranks import naming_stalled_ranks
from .output_dir import OutputDirError


# --8<-- [start:on_every_rank]
def on_every_rank(fn, what: str, errors=(OutputDirError, OSError)):
    """Run ``fn`` (or nothing, if None) on this rank; if it raised ``errors`` on any rank, raise the first
    such rank's error on every rank. It is also a barrier whose timeout names the rank still working
    (a slow disk) instead of "Timed out". Without it, a full disk on rank 0 is a hang on the others."""
    try:
        result, problem = (fn() if fn is not None else None), None
    except errors as err:
        result, problem = None, err
    problems = [None] * dist.get_world_size()
    with naming_stalled_ranks(what):
        dist.all_gather_object(problems, None if problem is None else (type(problem), str(problem)))
    first = next((r for r, p in enumerate(problems) if p is not None), None)
    if first is None:
        return result
    if first == dist.get_rank():
        raise problem
    kind, message = problems[first]
    raise kind(f"rank {first}: {message}")  # the same type: callers catch it by type
# --8<-- [end:on_every_rank]
