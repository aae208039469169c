"""An independent correct solution of ``static_graph``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: this backward's firings are a ``collections.Counter`` (reset to an
empty one at each synced forward), the first backward's are frozen into a list; ``fire`` answers
"complete" by comparing the count with that list, and the changed-graph flags are computed once in
``_flags`` and shipped in the used-counts all-reduce as two blocks appended with ``extend`` (per parameter,
then one slot per rank), which ``end`` slices back apart from the end. While learning, zeros are shipped
so every rank's message keeps the same length. ``fire`` itself admits one rule (count, then compare with
the first backward's count; never complete while learning): the reference's says the same.
"""


from __future__ import annotations

import warnings
from collections import Counter

from .readiness import Readiness
from .unused import unused_contribution


class StaticGraphChangedError(RuntimeError):
    """A backward after the first produced other gradients, or as many more times, than the first did."""

    def __init__(self, message: str, names: list[str], ranks: list[int]):
        super().__init__(message)
        self.names = names  # parameters whose gradients differed from the first backward
        self.ranks = ranks  # the ranks on which they differed


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
        self.fired: Counter[int] = Counter()  # this backward's firings so far (missing: 0)
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
        return unused_contribution(grad, True, accumulated)  # a parameter off the graph keeps its .grad

    # --8<-- [start:fire]
    def begin(self, outputs=None) -> list[int]:
        """At a synced forward: reset the firings; the parameters to mark unused when backward starts."""
        self.fired = Counter()
        if self.learning:
            return []  # nothing known yet: every gradient is waited for until backward ends
        return [i for i, times in enumerate(self.expected) if times == 0]

    def fire(self, i: int) -> bool:
        """Parameter i's hook fired: is its gradient complete now? (Never while learning.)"""
        self.fired[i] += 1
        return not self.learning and self.fired[i] == self.expected[i]  # its last firing: .grad is complete
    # --8<-- [end:fire]

    def before_finish(self, counts, mark_ready) -> None:
        """At the end of every synced backward, before the reducer marks the missing gradients unused. The
        first: ``mark_ready(i)`` for each parameter that got a gradient, so all buckets go out now. Every one:
        set ``counts.flags`` (this policy's own vector, summed with the used counts): per parameter, 1 if its
        firings differ from the first backward's; then per rank, 1 in this rank's own slot if any does."""
        if self.learning:
            for i in sorted(self.fired):  # every gradient that came goes out now
                mark_ready(i)
        per_param = self._flags()
        per_rank = [0] * self.world_size
        per_rank[self.rank] = int(any(per_param))
        counts.flags = [*per_param, *per_rank]

    def _flags(self) -> list[int]:
        """1 for each parameter whose firings differ from the first backward's (all 0 while learning)."""
        if self.learning:
            return [0] * len(self.names)
        return [int(self.fired[i] != times) for i, times in enumerate(self.expected)]

    def end(self, counts: list[int], expected: int = 0, local=(), flags: list[int] = ()) -> None:
        """After the all-reduce: ``flags`` summed over ranks, per parameter then per rank. Learns from the first
        backward (and counts it in ``ended``); raises ``self.changed(...)`` on every rank if a later one differs
        from it."""
        n = len(self.names)
        per_param, per_rank = flags[:-self.world_size], flags[-self.world_size:]
        self.ended += 1
        if self.learning:
            self.expected = [self.fired[i] for i in range(n)]
            return
        params = [i for i, summed in enumerate(per_param) if summed]
        if params:
            raise self.changed(params, [r for r, summed in enumerate(per_rank) if summed])

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
