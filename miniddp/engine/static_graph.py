"""Static graph: learn in the first backward which gradients come and how often, then rely on it.

What
    ``DistributedDataParallel(static_graph=True)`` (Hugging Face: ``ddp_static_graph``). In the first
    synced backward the reducer only counts each parameter's hook firings; when that backward ends
    every bucket goes out at once (``before_finish``). Afterwards a parameter whose hook never fired is
    marked ready when backward starts (no graph walk), and one whose hook fired k times is ready
    at its k-th firing, when its ``.grad`` is complete. Every later backward is checked against the
    first on every rank: a graph that changed raises ``StaticGraphChangedError`` naming the
    parameters and the ranks.

Why
    Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs a
    segment's forward without a graph and its backward as a nested one: the graph walk of
    ``find_unused_parameters`` cannot see the segment's parameters, and a layer checkpointed twice
    gets two hook calls in one backward, so the default reducer would send its bucket after the first
    half of its gradient. Counting once, instead of walking every time, handles both.

How torch differs
    ``reducer.cpp`` does the same (``numGradHooksTriggeredMap_``, ``delay_all_reduce``, enqueued by
    ``_DDPSink``'s backward in ``torch/nn/parallel/distributed.py``) and also rebuilds its buckets
    from the second backward's order. A changed graph there raises on its own rank only (a
    ``REDUCER_CHECK`` at the unexpected hook, or at the next forward when a hook did not fire), the
    others waiting until that process exits; here the firings are compared after the used-counts
    all-reduce, so every rank raises at the end of the same backward.
"""

from __future__ import annotations

import warnings

from .readiness import Readiness
from .unused import unused_contribution


class StaticGraphChangedError(RuntimeError):
    """A backward after the first produced other gradients, or as many more times, than the first did."""

    def __init__(self, message: str, names: list[str], ranks: list[int]):
        super().__init__(message)
        self.names = names  # parameters whose gradients differed from the first backward, on some rank
        self.ranks = ranks  # the ranks on which they differed, ascending (the same list on every rank)


def check_flags(static_graph: bool, find_unused_parameters: bool) -> None:
    if static_graph and find_unused_parameters:  # torch warns the same, and skips the walk too
        warnings.warn("static_graph=True finds unused parameters in the first backward by itself: "
                      "find_unused_parameters=True adds nothing (no graph walk is done)", stacklevel=3)


class StaticGraph(Readiness):
    """One reducer's knowledge of the graph: learned in the first synced backward, then fixed (a ``Readiness``)."""

    def __init__(self, names: list[str], rank: int, world_size: int):
        self.names = names
        self.rank, self.world_size = rank, world_size
        self.expected: list[int] | None = None  # hook firings per parameter in the first backward (None: learning)
        self.fired = [0] * len(names)  # this backward's firings so far
        self.ended = 0  # synced backwards ended

    @property
    def learning(self) -> bool:
        return self.expected is None

    @property
    def order_known(self) -> bool:
        """The buckets can be rebuilt: a backward after the first recorded the order gradients completed in
        (torch: the same; in the first, hooks only count)."""
        return self.ended > 1

    def contribution(self, grad, accumulated: bool):
        """A parameter the graph does not reach keeps its ``.grad``, as with ``find_unused_parameters``."""
        return unused_contribution(grad, True, accumulated)

    # --8<-- [start:fire]
    def begin(self, outputs=None) -> list[int]:
        """At a synced forward: reset the firings; the parameters to mark unused when backward starts ([] while
        learning, then those the first backward never fired, ascending). No graph walk: ``outputs`` is unused."""
        ### BEGIN SOLUTION
        self.fired = [0] * len(self.names)
        return [] if self.learning else [i for i, n in enumerate(self.expected) if n == 0]
        ### END SOLUTION

    def fire(self, i: int) -> bool:
        """Parameter i's hook fired: is its gradient complete now, at as many firings as in the first backward?
        (Never while learning.)"""
        ### BEGIN SOLUTION
        self.fired[i] += 1
        return not self.learning and self.fired[i] == self.expected[i]
        ### END SOLUTION
    # --8<-- [end:fire]

    def before_finish(self, counts, mark_ready) -> None:
        """At the end of every synced backward, before the reducer marks the missing gradients unused. The
        first: ``mark_ready(i)`` for each parameter that got a gradient, so all buckets go out now. Every one:
        set ``counts.flags`` (this policy's own vector, summed with the used counts): per parameter, 1 if its
        firings differ from the first backward's; then per rank, 1 in this rank's own slot if any does."""
        ### BEGIN SOLUTION
        if self.learning:
            for i in [i for i, n in enumerate(self.fired) if n > 0]:
                mark_ready(i)
        changed = [0] * len(self.names) if self.learning else [int(f != e) for f, e in zip(self.fired, self.expected)]
        counts.flags = changed + [int(any(changed) and r == self.rank) for r in range(self.world_size)]
        ### END SOLUTION

    def end(self, counts: list[int], expected: int = 0, local=(), flags: list[int] = ()) -> None:
        """After the all-reduce of the flags ``before_finish`` set, summed over ranks: for n parameters,
        ``flags[:n]`` per parameter the ranks whose firings changed, ``flags[n:]`` per rank 1 if its did. Adds 1
        to ``ended`` each time; learns ``expected`` (the firings) from the first backward; after it, raises
        ``self.changed(params, ranks)`` (parameters changed on some rank, ranks that changed, ascending) on every
        rank if any changed. (``counts``, ``expected`` and ``local``, the strict check's, are not needed here.)"""
        ### BEGIN SOLUTION
        n, self.ended = len(self.names), self.ended + 1
        if self.learning:
            self.expected = list(self.fired)
            return
        ranks = [r for r, f in enumerate(flags[n:]) if f]
        if ranks:
            raise self.changed([i for i in range(n) if flags[i]], ranks)
        ### END SOLUTION

    def changed(self, params: list[int], ranks: list[int]) -> StaticGraphChangedError:
        """The error for parameters ``params`` whose calls changed on ``ranks``, with this rank's own counts."""
        names = [self.names[i] for i in params]
        here = "".join(f"\n  {self.names[i]}: {self.fired[i]} gradient(s) on this rank, {self.expected[i]} in the "
                       "first backward" for i in range(len(self.names)) if self.fired[i] != self.expected[i])
        return StaticGraphChangedError(
            f"static_graph=True, but this backward's gradients differ from the first backward's on rank(s) "
            f"{ranks}: {', '.join(names)}.{here}\nWith static_graph, which parameters get gradients, and how many "
            "times each does, must stay as in the first iteration on every rank. For a graph that changes use "
            "find_unused_parameters=True (and use_reentrant=False if you checkpoint).", names, ranks)
