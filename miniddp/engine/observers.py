"""Observers: the named events of a synced backward, for whoever wants to watch the reducer.

What
    ``ReducerObserver`` has one no-op method per event: ``backward_started``,
    ``grad_ready(index, name)``, ``bucket_launched(bucket, future)``, ``backward_ended``.
    Tracing (``miniddp.diagnostics.trace.Tracer``) and ``bucket_cap_mb="auto"``
    (``auto_bucket.AutoBucketCap``) subclass it and override what they need; ``Observers``
    hands every event to each of them, in the order they were given.

Why
    The reducer's core is one idea (hooks -> buckets in order -> the mean in ``.grad``); a
    timeline or a ready-time recorder is not part of it. Attached from outside, they cost the
    core one call per event and no ``if`` branch, and a new one needs no change to it.

How torch differs
    torch's reducer records the same moments into its own timer (``reducer_timer.hpp``: backward
    compute start and end, communication start and end) for the logging data that
    ``DistributedDataParallel._get_ddp_logging_data()`` returns, on sampled iterations; there is
    no way to subscribe to them. ``torch.profiler`` sees the collectives from the outside.
"""

from __future__ import annotations


class ReducerObserver:
    """What a synced backward tells its observers; every method does nothing unless overridden."""

    def backward_started(self) -> None:
        """A backward that reaches the parameters has started (the end-of-backward callback is queued)."""

    def grad_ready(self, index: int, name: str) -> None:
        """Parameter ``index`` (``name``) is in its bucket: its gradient, or its zeros if it got none."""

    def bucket_launched(self, bucket, future) -> None:
        """``bucket`` (``bucketing.Bucket``) went to communication; ``future`` completes with its mean."""

    def backward_ended(self) -> None:
        """Every bucket is done and every ``.grad`` written: ``loss.backward()`` is about to return."""


class Observers(ReducerObserver):
    """Every event to each observer, in order."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def backward_started(self) -> None:
        for o in self.observers:
            o.backward_started()

    def grad_ready(self, index: int, name: str) -> None:
        for o in self.observers:
            o.grad_ready(index, name)

    def bucket_launched(self, bucket, future) -> None:
        for o in self.observers:
            o.bucket_launched(bucket, future)

    def backward_ended(self) -> None:
        for o in self.observers:
            o.backward_ended()


# ``bucket_cap_mb="auto"``: the engine knows no named cap. The class that builds the reducer names its own
# (``DistributedDataParallel.bucket_cap_choosers``: name -> factory of an observer with ``choose(params, group)``);
# ``miniddp.DistributedDataParallel`` (``miniddp/composed.py``) names the cost model's for "auto". The engine
# never imports the cost model, as it never imports the tracer, and nothing registers itself at import.
def bucket_cap_chooser(bucket_cap_mb, choosers):
    """The chooser ``choosers`` builds for a named cap (``"auto"``), or None for a number (or None: torch's
    default)."""
    if not isinstance(bucket_cap_mb, str):
        return None
    if bucket_cap_mb not in choosers:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: this class knows no cap of that name (known: "
                         f"{sorted(choosers)}); miniddp.DistributedDataParallel knows 'auto' (the cost model)")
    return choosers[bucket_cap_mb]()
