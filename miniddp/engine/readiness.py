"""Readiness: when a parameter's gradient counts as ready, and what a missing one means. The reducer's first seam.

What
    One interface, three policies, chosen when DDP is built; the reducer calls the same five methods whatever
    the policy. ``begin(outputs)`` at a synced forward: the parameters to mark unused when backward starts.
    ``fire(i)``: parameter i's hook fired; is its gradient complete? ``contribution(grad, accumulated)``:
    what a parameter without a gradient puts in its bucket. ``before_finish(counts, mark_ready)``: at the end
    of backward, before the missing gradients are marked; a policy may set ``counts.flags``, its own vector
    that travels with the used counts. ``end(counts, expected, local, flags)``: after the used counts (and
    those flags) are summed over ranks, raise (on every rank) if the backward broke the policy.
    ``Strict`` (the default): every gradient, on every rank, every time. ``FindUnused``
    (``find_unused_parameters=True``): a graph walk at each forward, zeros for the missing. ``StaticGraph``
    (``static_graph.py``): learned in the first backward, then relied on.

Why
    The three policies differ in exactly these moments; the rest of a backward (buckets in order, the
    collective, the write-back) is the same. As an interface, the reducer's core reads without an ``if``
    per policy, and a fourth policy is a class, not a branch in four places.

How torch differs
    ``reducer.cpp`` keeps the policies as flags tested where they matter (``find_unused_parameters_``,
    ``static_graph_``, ``numGradHooksTriggeredMap_``), and checks a missing gradient without the flag only
    at the next iteration (``ensure_prior_reduction_finished``); here every policy checks at ``end``.
"""

from __future__ import annotations

from .unused import check_counts, unused_contribution, unused_parameters


# --8<-- [start:interface]
class Readiness:
    """The interface. Its answers are the default policy's (``Strict``); the others override what differs."""

    rebuilds = True  # may the buckets be rebuilt once, in the order gradients arrived?

    def __init__(self, params: list, names: list[str]):
        self.params, self.names = params, names

    @property
    def order_known(self) -> bool:
        """Has a backward recorded the order gradients arrive in (so the rebuild may happen)?"""
        return True

    def begin(self, outputs) -> list[int]:
        """At a synced forward: the parameters to mark unused when backward starts (ascending)."""
        return []

    def fire(self, i: int) -> bool:
        """Parameter i's hook fired: is its gradient complete now?"""
        return True

    def contribution(self, grad, accumulated: bool):
        """What a parameter without a gradient in this backward sends: ``(tensor or None for zeros, used?)``."""
        return unused_contribution(grad, False, accumulated)

    def before_finish(self, counts, mark_ready) -> None:
        """At the end of backward, before the reducer marks the missing gradients unused (``counts``:
        ``unused.UsedCounts``, whose ``flags`` the policy may set, to be summed with it)."""

    def end(self, counts: list[int], expected: int, local: list[int], flags: list[int] = ()) -> None:
        """``counts``: ranks that had each gradient; ``expected``: ranks that took part; ``local``: this rank's
        missing ones; ``flags``: the policy's own, summed. Raise ``unused.UnusedParameterError`` on every rank
        for a gradient some rank lacked."""
        check_counts(counts, expected, self.names, find_unused=False, local=local, params=self.params)
# --8<-- [end:interface]


class Strict(Readiness):
    """The default: every parameter's gradient on every rank in every synced backward, or an error naming it."""


class FindUnused(Readiness):
    """``find_unused_parameters=True``: walk the graph at each forward; a missing gradient sends zeros (or the
    ``.grad`` it holds); the buckets are never rebuilt, since the graph may change (torch: the same)."""

    rebuilds = False

    def __init__(self, params: list, names: list[str]):
        super().__init__(params, names)
        self.warned = False  # "nothing was unused": said once

    def begin(self, outputs) -> list[int]:
        return unused_parameters(outputs, self.params)

    def contribution(self, grad, accumulated: bool):
        return unused_contribution(grad, True, accumulated)

    def end(self, counts: list[int], expected: int, local: list[int], flags: list[int] = ()) -> None:
        self.warned |= check_counts(counts, expected, self.names, find_unused=True, local=local, params=self.params,
                                    warn_if_nothing_unused=not self.warned)
