"""When the reducer may hand the next bucket to a comm hook: at once, or once the previous future is done.

What
    ``issues_everything_in_call(hook)``: has ``hook`` declared that it issues all its collectives before it
    returns? A hook declares it with ``@issues_collectives_in_call`` (an attribute, ``IN_CALL``); miniddp's
    default and compression hooks do, and torch's are declared here.
    ``CallOrder(hook).wait_for(futures)``: the future that must complete before the reducer hands
    the next bucket over (or issues its used counts), ``None`` when it may go now.

Why
    Collectives pair up by order of issue, so every rank must issue them in bucket order. A hook
    that issues everything inside the call (the default path, the compression hooks) keeps that
    order by itself: several buckets may travel at once. A hook may also issue collectives
    *later*, from its future's callbacks on a communication thread (PowerSGD sends Q once P is
    summed): for such a hook bucket k goes in only once bucket k-1's future is done, so every rank
    issues all of bucket 0's collectives, then bucket 1's, whatever the hook does inside.

How torch differs
    torch's reducer (``reducer.cpp``) calls each bucket's hook as soon as the bucket is ready: on
    gloo, where a future completes with its collective, torch's PowerSGD then issues the P and Q
    all-reduces of different buckets in a different order on each rank, and hangs. On NCCL a
    future completes at *enqueue*, so the wait costs nothing there; on gloo a PowerSGD bucket
    communicates after the previous one, still overlapping backward.
"""

from __future__ import annotations

import functools

IN_CALL = "issues_collectives_in_call"  # the attribute by which a hook declares its contract


# --8<-- [start:in_call]
def issues_collectives_in_call(hook):
    """Declare that ``hook`` issues every collective before it returns, none from a future's callback
    (``@issues_collectives_in_call`` on a user's hook). The reducer may then hand it bucket k+1 while
    bucket k still travels: the order of calls is the order of issue. Returns ``hook``."""
    setattr(hook, IN_CALL, True)
    return hook


def issues_everything_in_call(hook) -> bool:
    """Has ``hook`` declared that it issues all its collectives in the call? An undeclared hook may issue
    more from its future's callbacks (PowerSGD does), so it is handed one bucket at a time. A
    ``functools.partial`` inherits the declaration of the function it wraps."""
    while True:
        if getattr(hook, IN_CALL, False):
            return True
        if not isinstance(hook, functools.partial):
            return False
        hook = hook.func


def _declare_torchs_hooks() -> None:
    """torch's own in-call hooks, declared by miniddp, which read their source: each issues one
    ``dist.all_reduce`` and only decompresses in its ``then``."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as theirs
    except ImportError:  # a torch without comm hooks
        return
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        if hasattr(theirs, name):
            issues_collectives_in_call(getattr(theirs, name))


_declare_torchs_hooks()


class CallOrder:
    """The reducer's rule for one hook (``None``: its default path, a plain all-reduce in the call)."""

    def __init__(self, hook=None):
        self.overlap = hook is None or issues_everything_in_call(hook)  # buckets may travel concurrently

    def wait_for(self, futures: list):
        """The future to see completed before the next collective goes out; ``None``: it may go now."""
        if self.overlap or not futures or futures[-1].done():
            return None
        return futures[-1]  # the hook may still issue collectives from its callbacks
# --8<-- [end:in_call]
