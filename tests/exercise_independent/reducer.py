"""An independent correct solution of ``reducer``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: a bucket is complete when every one of its parameters is flagged
ready (``_complete`` reads ``Backward.ready``; the per-bucket ``pending`` counters are not used), so
``_mark_ready`` only records the gradient and asks ``_launch`` to go as far as it can; ``_launch`` is a
bounded ``for`` loop over the buckets not yet handed over instead of a ``while``; a parameter without a
gradient has its kept ``.grad`` noted before its bucket slot is written; the write-back pairs each
bucket with its result through a dict keyed by bucket index. The arithmetic (divide by N on the way
in, SUM, write back) and the order rules (bucket order, ``call_order``) are the exercise's contract.
The rest of the class is the skeleton's as ``miniddp exercise start reducer`` writes it today.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..process_group.clean_exit import group_or_default
from ..process_group.fingerprint import issued_as
from . import waiting
from .autograd_hooks import hook_once, on_backward_start
from .bucket_collective import BucketCollective, collective_for
from .bucketing import build_buckets, compute_bucket_assignment, rebuilt_assignment
from .no_sync import Accumulated
from .observers import Observers
from .readiness import FindUnused, Readiness, Strict
from .sparse_gradients import check_layout, each_sparse_alone, rebuilt_with_sparse
from .static_graph import StaticGraph
from .unused import UsedCounts, gradient_twice_message


def readiness_for(reducer, find_unused_parameters: bool, static_graph: bool) -> Readiness:
    """The readiness policy DDP's flags choose, once (``static_graph`` wins: it finds unused parameters itself)."""
    if static_graph:
        return StaticGraph(reducer.names, dist.get_rank(reducer.group), reducer.world_size)
    return (FindUnused if find_unused_parameters else Strict)(reducer.params, reducer.names)


@dataclass
class Backward:  # everything one synced backward knows; prepare_for_backward makes a fresh one
    collective: BucketCollective  # each complete bucket's (the reducer's; join: its active ranks' divisor)
    expected: int  # ranks that take part, each of which must produce each gradient (join: the active ones)
    local_unused: list[int]  # no gradient on this rank: the graph walk's, then the never-arrived
    pending: list[int]  # per bucket: gradients still missing
    counts: UsedCounts  # this rank's 1/0 per parameter, summed over ranks at the end
    ready: list[bool] = field(default_factory=list)  # per parameter: its gradient is in its bucket
    futures: list = field(default_factory=list)  # each launched bucket's future, in bucket order
    started: bool = False  # the end-of-backward callback is queued

    @property
    def next_bucket(self) -> int:
        return len(self.futures)


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters."""

    def __init__(self, params, names, process_group, size_limits, *, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, observers=(), expect_sparse_gradient=None):
        self.params = list(params)  # parameters that require grad, registration order
        self.names = list(names)  # their qualified names
        self.sparse = list(expect_sparse_gradient or [False] * len(self.params))  # a sparse .grad: a bucket alone
        self._group = process_group  # who we average with; None: the default group, never held (clean_exit.py)
        self.world_size = dist.get_world_size(self.group)
        self.size_limits = list(size_limits)  # bucket byte limits (first, then the rest)
        self.as_view = gradient_as_bucket_view  # .grad is a view into the bucket
        self.observers = Observers(observers)  # told each named event (observers.py)
        # the seams: when a gradient is ready (readiness.py), and what a complete bucket's collective is
        self.readiness = readiness_for(self, find_unused_parameters, static_graph)
        self.set_comm_hook(None, None)  # the default path; register_comm_hook: CommHook; ZeroOptimizer: its own
        self._install(list(reversed(each_sparse_alone(compute_bucket_assignment, self.params, self.size_limits,
                                                      self.sparse))))  # last layers first
        self.backward: Backward | None = None  # armed by a synced forward until its backward ends
        self.accumulated = Accumulated(len(self.params))  # got a gradient since the last sync (no_sync too)
        self.ready_order: list[int] = []  # parameter indices as their gradients arrived (first iteration)
        self.rebuilt = not self.readiness.rebuilds  # torch never rebuilds when the graph may change
        self.rebuild_due = False  # rebuild at the next forward
        self.backwards = 0  # synced backwards so far (shadowed ones too): names a collective in errors
        self.superseded = False  # a later wrapper of the same parameters took their hooks over
        for i, p in enumerate(self.params):
            hook_once(p, self._hook, i)  # held weakly: a deleted wrapper leaves no hook behind

    @property
    def group(self):
        return group_or_default(self._group)

    def _install(self, assignment) -> None:
        self.buckets = build_buckets(self.params, self.names, assignment, self.sparse)
        self.where = {i: (b, k) for b, indices in enumerate(assignment) for k, i in enumerate(indices)}

    def set_collective(self, collective: BucketCollective, owner: str | None = None) -> None:
        """Every later synced backward's buckets go through ``collective``. ``owner``: who chose it, if not DDP
        (ZeroOptimizer), so that a comm hook may not replace it; no comm hook is registered any more."""
        self.collective = collective
        self.collective_owner = owner  # None: DDP's own choice (the default path, or a registered hook)
        self.registered_hook: tuple | None = None  # (state, hook) of a registered comm hook (DDP's copies keep it)

    def set_comm_hook(self, state, hook) -> None:  # hook None: the default path (divide by N, sum)
        self.set_collective(collective_for(state, hook, self.world_size))
        self.registered_hook = None if hook is None else (state, hook)

    def set_bucket_assignment(self, assignment: list[list[int]], final: bool = True) -> None:
        """Buckets of these parameter indices, in the order they are reduced, before the first synced forward.
        ``final``: never rebuilt in arrival order (ZeroOptimizer cut its shards from them; FSDP's units)."""
        if self.backward is not None:
            raise RuntimeError("set_bucket_assignment while a synced backward is armed: give the buckets before "
                               "the first forward")
        if sorted(i for indices in assignment for i in indices) != list(range(len(self.params))):
            raise ValueError(f"set_bucket_assignment: each of the {len(self.params)} parameter indices must be in "
                             "exactly one bucket")
        self._install([list(indices) for indices in assignment])
        if final:
            self.rebuilt, self.rebuild_due = True, False

    def add_observer(self, observer) -> None:
        """``observer`` (``observers.ReducerObserver``) is told every later named event, after those before it."""
        self.observers.observers.append(observer)

    @property
    def waiting_for_backward(self) -> bool:  # armed by a synced forward whose backward has not started
        return self.backward is not None and not self.backward.started

    # --8<-- [start:prepare]
    def prepare_for_backward(self, outputs, collective: BucketCollective | None = None,
                             expected: int | None = None) -> None:
        """Called at the end of a synced forward: arm the hooks for the coming backward (join: its active ranks'
        ``collective`` and their number ``expected``)."""
        self.backward = Backward(
            collective=collective or self.collective, expected=expected or self.world_size,
            local_unused=self.readiness.begin(outputs),  # find_unused: the graph walk's; static: the first backward's
            pending=[len(b.params) for b in self.buckets], counts=UsedCounts(len(self.params)),
            ready=[False] * len(self.params))
        on_backward_start(outputs, self.params, self._start_backward)  # a backward reaching the parameters

    def _start_backward(self) -> None:
        state = self.backward
        if state is None or state.started:
            return
        state.started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)  # runs after backward
        self.observers.backward_started()
        for i in state.local_unused:  # found by the graph walk: ready now
            self._mark_unused(i)
    # --8<-- [end:prepare]

    # --8<-- [start:hook]
    def _hook(self, i: int, param) -> None:
        """Parameter ``i``'s post-accumulate-grad hook: its gradient is in ``param.grad``."""
        grad = check_layout(param.grad, self.names[i], self.sparse[i])
        if grad is not None:
            self.accumulated.add(i)  # counted even inside no_sync, as torch does
        if self.backward is None:  # not armed: inside no_sync, or a forward that bypassed DDP
            self.accumulated.unarmed(self.names[i])  # warned, unless a no_sync forward explains it
            return
        self._start_backward()
        if not self.readiness.fire(i):  # static_graph: ready at its last firing
            return
        if not self.rebuilt:
            self.ready_order.append(i)
        self._mark_ready(i, grad)
    # --8<-- [end:hook]

    def _mark_unused(self, i: int) -> None:  # no gradient in this backward: what the readiness policy sends
        self._mark_ready(i, *self.readiness.contribution(self.params[i].grad, i in self.accumulated))

    # --8<-- [start:mark_ready]
    def _mark_ready(self, i: int, grad, used: bool = True) -> None:
        state = self.backward
        if state.ready[i]:  # reentrant checkpointing, or a module used in two backward passes
            raise RuntimeError(gradient_twice_message(self.names[i], walk_missed_it=i in state.local_unused))
        b, k = self.where[i]
        bucket = self.buckets[b]
        if not used:  # counted as absent; a bucket-view .grad is copied before the slot is overwritten
            state.counts.mark_unused(i, self.params[i].grad, bucket.views[k])
        bucket.put(k, grad, state.collective.divisor)  # a hook's collective divides by itself (1 here)
        state.ready[i] = True
        self.observers.grad_ready(i, self.names[i])
        self._launch(state)

    def _complete(self, state: Backward, b: int) -> bool:
        """Every gradient of bucket ``b`` is in it (a backward without gradients: all ready from the start)."""
        return all(state.ready[i] for i in self.buckets[b].indices)
    # --8<-- [end:mark_ready]

    # --8<-- [start:launch]
    def _launch(self, state: Backward, wait: bool = False) -> None:
        """Hand complete buckets over, in bucket order, each when ``call_order`` allows it (``wait``: at the
        end of backward, wait for that instead of returning to try again at the next gradient)."""
        for b in range(state.next_bucket, len(self.buckets)):
            if not self._complete(state, b):
                return  # bucket order: a later bucket may be complete, but it waits for this one
            if not self._may_issue(state, wait):
                return  # the hook still issues the previous bucket's collectives: try at the next gradient
            self._communicate(state, self.buckets[b])

    def _communicate(self, state: Backward, bucket) -> None:
        with issued_as(f"bucket {bucket.index} {state.collective.name}"):
            future = state.collective.issue(bucket, bucket.buffer, bucket.index == len(self.buckets) - 1, self.group)
        state.futures.append(future)
        self.observers.bucket_launched(bucket, future)

    def _may_issue(self, state: Backward, wait: bool) -> bool:  # may the next collective go out now? (wait: until)
        previous = state.collective.call_order.wait_for(state.futures)
        if previous is not None and wait:
            self._wait(f"{state.collective.name} of bucket {state.next_bucket - 1}", previous)
        return previous is None or wait
    # --8<-- [end:launch]

    def _wait(self, what: str, future):
        return waiting.wait(future, f"{what} in backward #{self.backwards}", self.group)

    # --8<-- [start:finalize]
    def _finalize(self) -> None:
        """Autograd callback after backward: ``_finish`` the buckets, ``land`` each result, check the counts."""
        state = self.backward
        self.backwards += 1
        try:  # static_graph: in its first backward, all that came goes now; in each, its flags join the counts
            self.readiness.before_finish(state.counts, lambda i: self._mark_ready(i, self.params[i].grad))
            for i, done in enumerate(state.ready):  # no gradient on this rank: zeros, so nobody hangs
                if not done:
                    state.local_unused.append(i)
                    self._mark_unused(i)
            means, counts = self._finish(state)
            by_index = {bucket.index: bucket for bucket in self.buckets}
            for index, mean in enumerate(means):
                state.collective.land(by_index[index], mean, counts, self.as_view)
            state.counts.restore_kept(self.params, counts)
            self.accumulated.clear()
        finally:
            self.backward = None  # disarmed, whatever happened
        self.observers.backward_ended()
        # a gradient missing, or static graph's flags raised: raise on every rank
        self.readiness.end(counts, state.expected, state.local_unused, state.counts.summed_flags())
        self.rebuild_due = not self.rebuilt and self.readiness.order_known  # once, at the next forward

    def _finish(self, state: Backward) -> tuple[list[torch.Tensor], list[int]]:
        """The buckets still waiting their turn, then the used counts (after every hook's last collective,
        so nothing comes between them on any rank), then wait for all: (each bucket's mean, the counts)."""
        self._launch(state, wait=True)
        self._may_issue(state, wait=True)
        summed = state.counts.all_reduce(self.group, self.buckets[0].buffer.device)
        results = [state.collective.result(b, self._wait(f"{state.collective.name} of bucket {b.index}", f))
                   for b, f in zip(self.buckets, state.futures)]
        self._wait("used-counts all-reduce", summed)
        return results, state.counts.counts()
    # --8<-- [end:finalize]

    def backward_without_gradients(self, collective: BucketCollective) -> None:
        """A backward this rank sits out: every bucket issued through ``collective`` in bucket order, the used
        counts all zero, all waited for; nothing lands here (join's shadow: ``ddp_join.py``)."""
        self.backwards += 1  # counted as the active ranks count theirs: a stalled collective's name agrees
        self._finish(Backward(collective=collective, expected=self.world_size, local_unused=[],
                              pending=[0] * len(self.buckets), counts=UsedCounts(len(self.params), used=0),
                              ready=[True] * len(self.params)))  # nothing to wait for: every bucket is complete

    # --8<-- [start:rebuild]
    @issued_as("bucket order broadcast")
    def rebuild(self, size_limits: list[int] | None = None) -> None:
        """Once, before the second synced forward (every rank, a joined one too): buckets in the order
        gradients arrived, with ``size_limits`` if given (``bucket_cap_mb="auto"``: the cost model's)."""
        self.rebuild_due, self.rebuilt, self.size_limits = False, True, list(size_limits or self.size_limits)
        self._install(rebuilt_with_sparse(rebuilt_assignment, self.ready_order, self.params, self.sparse,
                                          self.size_limits, self.group))
    # --8<-- [end:rebuild]
