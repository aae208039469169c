"""The reducer: gradient hooks -> buckets launched in order -> the mean in ``.grad``.

What
    ``prepare_for_backward`` arms the reducer; each hook's ``_mark_ready`` puts its gradient in its bucket
    (divided as the bucket's collective says: by N on the default path, not at all for a comm hook); complete
    buckets go out in bucket order (``_launch``); ``_finalize`` waits and lands each result (the default:
    the mean written into ``.grad``). The buckets are rebuilt once, in arrival order. Two seams hold what
    varies, each chosen when DDP is built: ``readiness`` (``readiness.py``: strict, find-unused, static
    graph) and ``collective`` (``bucket_collective.py``: the all-reduce, a comm hook, ZeRO-2's
    reduce-scatter); join's shadow backward is a collective of ``ddp_join.py``'s. Whoever brings their own
    uses the public seams, never the reducer's attributes: ``set_collective``, ``set_comm_hook``,
    ``set_bucket_assignment`` (ZeRO keeps the buckets it cut its shards from) and ``add_observer``. A
    parameter whose gradient is sparse (``nn.Embedding(sparse=True)``) is a bucket of its own
    (``sparse_gradients.py``).

Why
    A bucket sent while earlier layers still differentiate hides communication behind compute
    (the DDP paper, arXiv 2006.15704, §3.2.3). One order on every rank matters as much:
    collectives pair up by order, so ranks sending buckets 3, 2 and 2, 3 would sum the wrong ones.

How torch differs
    ``reducer.cpp`` has the same parts (``autograd_hook``, ``mark_variable_ready``,
    ``finalize_backward``, ``rebuild_buckets``) and the same mean: no hook, divide on the way in
    and sum. Who had each gradient travels in one small all-reduce (``unused.UsedCounts``; torch: a
    bitmap, only with ``find_unused_parameters=True``); the policies are flags tested where they matter there.
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
from .torch_surface import TorchReducerSurface
from .unused import UsedCounts, gradient_twice_message


def readiness_for(reducer, find_unused_parameters: bool, static_graph: bool) -> Readiness:
    """The readiness policy DDP's flags choose, once (``static_graph`` wins: it finds unused parameters itself)."""
    return StaticGraph(reducer.names, dist.get_rank(reducer.group), reducer.world_size) if static_graph else \
        (FindUnused if find_unused_parameters else Strict)(reducer.params, reducer.names)


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


class Reducer(TorchReducerSurface):
    """Bucketed, overlapped gradient averaging for a list of parameters (and torch's names: TorchReducerSurface)."""

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
        # last layers first; the dense rule passed in (an exercise's compute_bucket_assignment takes two arguments)
        self._install(list(reversed(each_sparse_alone(compute_bucket_assignment, self.params, self.size_limits,
                                                      self.sparse))))
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
        grad = check_layout(param.grad, self.names[i], self.sparse[i])  # sparse exactly where a SparseBucket waits
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
        """Gradient i in its bucket, ready (unused: ``counts.mark_unused``), ``observers.grad_ready``, ``_launch``."""
        state = self.backward
        if state.ready[i]:  # reentrant checkpointing, or a module used in two backward passes
            raise RuntimeError(gradient_twice_message(self.names[i], walk_missed_it=i in state.local_unused))
        ### BEGIN SOLUTION
        state.ready[i] = True
        b, k = self.where[i]
        bucket = self.buckets[b]
        if not used:
            state.counts.mark_unused(i, self.params[i].grad, bucket.views[k])
        bucket.put(k, grad, state.collective.divisor)  # the default path: mean = sum / N, divided here
        state.pending[b] -= 1
        self.observers.grad_ready(i, self.names[i])
        self._launch(state)
        ### END SOLUTION
    # --8<-- [end:mark_ready]

    # --8<-- [start:launch]
    def _launch(self, state: Backward, wait: bool = False) -> None:
        """Hand complete buckets over, in bucket order, each when ``call_order`` allows it (``wait``: at the
        end of backward, wait for that instead of returning to try again at the next gradient)."""
        ### BEGIN SOLUTION
        while state.next_bucket < len(self.buckets) and state.pending[state.next_bucket] == 0:
            if not self._may_issue(state, wait):
                return
            self._communicate(state, self.buckets[state.next_bucket])
        ### END SOLUTION

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
        try:  # static_graph: in its first backward, all that came goes now; in each, its flags go with the counts
            self.readiness.before_finish(state.counts, lambda i: self._mark_ready(i, self.params[i].grad))
            for i, done in enumerate(state.ready):  # no gradient on this rank: zeros, so nobody hangs
                if not done:
                    state.local_unused.append(i)
                    self._mark_unused(i)
            ### BEGIN SOLUTION
            results, counts = self._finish(state)
            for bucket, result in zip(self.buckets, results):
                state.collective.land(bucket, result, counts, self.as_view)  # the one place that sets .grad
            ### END SOLUTION
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
        counts all zero, all waited for, each result landed as ``collective`` says (join's shadow: ``ddp_join.py``)."""
        self.backwards += 1  # counted as the active ranks count theirs: a stalled collective's name agrees
        # every bucket is complete (nothing pending, every parameter ready) and this rank used nothing
        sat_out = Backward(collective=collective, expected=self.world_size, local_unused=[],
                           pending=[0] * len(self.buckets), counts=UsedCounts(len(self.params), used=0),
                           ready=[True] * len(self.params))
        results, counts = self._finish(sat_out)
        for bucket, result in zip(self.buckets, results):
            collective.land(bucket, result, counts, self.as_view)

    # --8<-- [start:rebuild]
    @issued_as("bucket order broadcast")
    def rebuild(self, size_limits: list[int] | None = None) -> None:
        """Once, before the second synced forward (every rank, a joined one too): buckets in the order
        gradients arrived, with ``size_limits`` if given (``bucket_cap_mb="auto"``: the cost model's)."""
        self.rebuild_due, self.rebuilt, self.size_limits = False, True, list(size_limits or self.size_limits)
        self._install(rebuilt_with_sparse(rebuilt_assignment, self.ready_order, self.params, self.sparse,
                                          self.size_limits, self.group))
    # --8<-- [end:rebuild]
