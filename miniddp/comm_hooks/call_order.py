"""When the reducer may hand the next bucket to a comm hook: at once, or once the previous future is done.

What
    ``issues_everything_in_call(hook)``: does ``hook`` issue all its collectives before it returns?
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

from .default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook


# --8<-- [start:in_call]
def issues_everything_in_call(hook) -> bool:
    """Does ``hook`` issue all its collectives before it returns (none from a future's callback)? Then the
    reducer may hand bucket k+1 over while bucket k still travels: the order of issue is the order of calls.
    True for the compression hooks and ``allreduce_hook`` (ours and torch's); PowerSGD is not."""
    if hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
        return True
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as theirs
    except ImportError:  # a torch without comm hooks
        return False
    return hook in (theirs.allreduce_hook, theirs.fp16_compress_hook)


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
