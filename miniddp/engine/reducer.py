"""The reducer: bucket ready -> comm hook -> future -> write back.

What
    ``Reducer`` registers one hook per parameter. In a synchronised backward it
    copies each fresh gradient into its bucket; a complete bucket goes to the
    communication hook (``comm_hooks.allreduce_hook`` unless
    ``register_comm_hook`` chose another), which returns a future of the
    averaged bucket. A callback queued on the autograd engine runs when backward
    is over: it waits for every future and writes the results into ``.grad``
    (``Bucket.write_back``, the only place that does), so **when
    ``loss.backward()`` returns, every ``.grad`` holds the mean over ranks**. After the first
    iteration the buckets are rebuilt once, in the order gradients arrived
    (agreed across ranks by a broadcast from rank 0).

Why
    Launching a bucket while earlier layers still differentiate hides
    communication behind compute (the DDP paper, arXiv 2006.15704, §3.2.3).
    Launching in one order on every rank matters as much: collectives pair up
    by order, so ranks launching buckets 3, 2 and 2, 3 would sum the wrong
    buffers (or deadlock). A hook may also issue collectives *later*, from its
    future's callbacks on a communication thread (PowerSGD sends Q once P is
    summed): for such a hook bucket k goes to the hook only once bucket k-1's
    future is done, so every rank issues all of bucket 0's collectives, then
    bucket 1's, whatever the hook does inside. The default path and the
    compression hooks issue everything inside the call; their buckets travel
    concurrently (``comm_hooks.issues_everything_in_call``).

How torch differs
    ``torch/csrc/distributed/c10d/reducer.cpp`` has the same parts in C++
    (``autograd_hook``, ``mark_variable_ready``, ``finalize_backward``,
    ``rebuild_buckets``) but calls each bucket's hook as soon as the bucket is
    ready: on gloo, where a future completes with its collective, torch's
    PowerSGD then issues the P and Q all-reduces of different buckets in a
    different order on each rank, and hangs. On NCCL a future completes at
    *enqueue*, so our wait costs nothing there; on gloo, a PowerSGD bucket
    communicates after the previous one, still overlapping backward. As in torch, only a backward that
    reaches the parameters syncs (a ``torch.autograd.grad`` gradient penalty
    leaves the sync armed). Which ranks had each gradient travels in one small
    all-reduce after the last bucket (``unused.UsedCounts``; torch: a bitmap,
    only with ``find_unused_parameters=True``). A timed-out collective names
    the ranks that never reached it (``timeouts.naming_stalled_ranks``).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from .bucketing import bucket_size_limits, build_buckets, compute_bucket_assignment, rebuilt_assignment
from ..process_group.clean_exit import group_or_default
from ..process_group.desync import issued_as
from ..comm_hooks.default_hooks import allreduce_hook, issues_everything_in_call
from ..comm_hooks.grad_bucket import hook_name, hook_result
from .no_sync import Accumulated, unprepared_backward_message
from ..process_group.timeouts import naming_stalled_ranks
from .unused import (NOTHING_UNUSED, UsedCounts, check_counts, find_tensors, gradient_twice_message,
                     unused_contribution, unused_parameters)

_HOOKED: dict[int, tuple] = {}  # id(parameter) -> (weak ref to it, handle of its miniddp hook, weak ref to its Reducer)


@dataclass
class Backward:
    """Everything one synced backward knows; ``prepare_for_backward`` makes a fresh one."""

    divisor: int  # what the default path divides by (join: maybe the active ranks only)
    expected: int  # ranks that must produce each gradient (join: the active ones)
    local_unused: list[int]  # no gradient on this rank: the graph walk's, then the never-arrived
    ready: list[bool]  # per parameter: its gradient is in its bucket
    pending: list[int]  # per bucket: gradients still missing
    counts: UsedCounts  # this rank's 1/0 per parameter, summed over ranks at the end
    kept: dict = field(default_factory=dict)  # parameter -> its bucket-view .grad, to restore if no rank used it
    futures: list = field(default_factory=list)  # the hook's future of each bucket handed over, in order
    started: bool = False  # the end-of-backward callback is queued

    @property
    def next_bucket(self) -> int:
        return len(self.futures)


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters, through a comm hook."""

    def __init__(self, params, names, process_group, size_limits, *, find_unused_parameters=False,
                 gradient_as_bucket_view=False, tracer=None, auto_cap=None):
        self.params = list(params)  # parameters that require grad, registration order
        self.names = list(names)  # their qualified names
        self._group = process_group  # who we average with; None: the default group, never held (clean_exit.py)
        self.world_size = dist.get_world_size(self.group)
        self.size_limits = list(size_limits)  # bucket byte limits (first, then the rest)
        self.find_unused = find_unused_parameters  # walk the graph after each forward?
        self.as_view = gradient_as_bucket_view  # .grad is a view into the bucket
        self.tracer = tracer  # optional miniddp.diagnostics.trace.Tracer
        self.auto_cap = auto_cap  # bucket_cap_mb="auto": an auto_bucket.AutoBucketCap, which sets the rebuild's cap
        self.hook, self.hook_state = allreduce_hook, process_group  # what each ready bucket goes through
        self.custom_hook = False  # register_comm_hook was called: the hook divides, not the copy-in
        self.overlap_buckets = True  # the hook issues all its collectives in the call: no wait between buckets
        # registration order, buckets filled then reversed: the last layers reduce first
        self._install(list(reversed(compute_bucket_assignment(self.params, self.size_limits))))
        self.backward: Backward | None = None  # armed by a synced forward until its backward ends
        self.accumulated = Accumulated(len(self.params))  # got a gradient since the last sync (no_sync too)
        self.local_forward = False  # a no_sync forward ran since the last synced backward: local gradients expected
        self.warned_unprepared = False  # the "gradient no forward prepared" warning, once
        self.ready_order: list[int] = []  # parameter indices as their gradients arrived (first iteration)
        self.rebuilt = find_unused_parameters  # torch never rebuilds when the graph may change
        self.rebuild_due = False  # rebuild at the next forward
        self.warned_no_unused = False  # the "flag set but nothing unused" warning, once
        self.backwards = 0  # synced backwards so far: names a collective in error messages
        self.superseded = False  # a later wrapper of the same parameters took their hooks over
        self.handles = [_hook_once(p, self._make_hook(i), self) for i, p in enumerate(self.params)]

    @property
    def group(self):
        return group_or_default(self._group)

    def _install(self, assignment) -> None:
        self.buckets = build_buckets(self.params, self.names, assignment)
        self.where = {i: (b, k) for b, indices in enumerate(assignment) for k, i in enumerate(indices)}

    def set_comm_hook(self, state, hook) -> None:
        self.hook, self.hook_state, self.custom_hook = hook, state, True
        self.overlap_buckets = issues_everything_in_call(hook)

    @property
    def waiting_for_backward(self) -> bool:
        """Armed by a synced forward whose backward has not started."""
        return self.backward is not None and not self.backward.started

    @property
    def next_bucket(self) -> int:
        """The bucket the hook gets next (``desync.py`` names a bucket's collectives with it)."""
        return self.backward.next_bucket if self.backward is not None else 0

    # --8<-- [start:prepare]
    def prepare_for_backward(self, outputs, divisor: int | None = None, expected: int | None = None) -> None:
        """Called at the end of a synced forward: arm the hooks for the coming backward."""
        self.backward = Backward(
            divisor=divisor or self.world_size, expected=expected or self.world_size,
            local_unused=unused_parameters(outputs, self.params) if self.find_unused else [],
            ready=[False] * len(self.params), pending=[len(b.params) for b in self.buckets],
            counts=UsedCounts(len(self.params)))
        for t in find_tensors(outputs):  # backward starts where the outputs' gradients arrive
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._on_backward_start_hook)
    # --8<-- [end:prepare]

    # --8<-- [start:reaches]
    def _on_backward_start_hook(self, grad):
        if self._reaches_parameters():
            self._start_backward()
        return grad

    def _reaches_parameters(self) -> bool:
        """Will the running backward accumulate into a parameter's .grad? ``loss.backward()``: yes;
        ``torch.autograd.grad(out, x)`` (a gradient penalty): no, and it must not consume the sync."""
        for p in self.params:
            try:
                if torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                    return True
            except RuntimeError:  # torch refuses the question for autograd.grad's own inputs: not ours
                pass
        return False
    # --8<-- [end:reaches]

    def _start_backward(self) -> None:
        state = self.backward
        if state is None or state.started:
            return
        state.started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)  # runs after backward
        if self.tracer is not None:
            self.tracer.event("backward start")
        if self.auto_cap is not None:
            self.auto_cap.backward_started()
        for i in state.local_unused:  # found by the graph walk: ready now
            self._mark_unused(i)

    def _make_hook(self, i: int):
        def hook(param):  # post-accumulate-grad hooks receive the parameter itself
            grad = param.grad
            if grad is not None and grad.layout != torch.strided:
                raise NotImplementedError(f"parameter {self.names[i]} got a {grad.layout} gradient: miniddp "
                                          "averages dense gradients only (use sparse=False, or torch's DDP)")
            if grad is not None:
                self.accumulated.add(i)  # counted even inside no_sync, as torch does
            if self.backward is None:  # not armed: inside no_sync, or a forward that bypassed DDP
                if not self.local_forward and not self.warned_unprepared:  # no no_sync forward explains it
                    self.warned_unprepared = True
                    warnings.warn(unprepared_backward_message(self.names[i]), UserWarning, stacklevel=2)
                return
            self._start_backward()
            if not self.rebuilt:
                self.ready_order.append(i)
                if self.auto_cap is not None:
                    self.auto_cap.grad_ready(i)
            self._mark_ready(i, grad)
        return hook

    def _mark_unused(self, i: int) -> None:
        """No gradient in this backward: put in what ``unused.unused_contribution`` says."""
        grad, used = unused_contribution(self.params[i].grad, self.find_unused, i in self.accumulated)
        self._mark_ready(i, grad, used)

    # --8<-- [start:mark_ready]
    def _mark_ready(self, i: int, grad, used: bool = True) -> None:
        state = self.backward
        if state.ready[i]:  # reentrant checkpointing, or a module used in two backward passes
            raise RuntimeError(gradient_twice_message(self.names[i], walk_missed_it=i in state.local_unused))
        state.ready[i] = True
        b, k = self.where[i]
        bucket, p = self.buckets[b], self.params[i]
        if not used:
            state.counts.mark_unused(i)
            if p.grad is not None and p.grad.data_ptr() == bucket.views[k].data_ptr():
                state.kept[i] = p.grad.clone()  # a bucket-view .grad must survive if no rank used it
        bucket.put(k, grad, 1 if self.custom_hook else state.divisor)  # the default path divides here
        state.pending[b] -= 1
        if self.tracer is not None:
            self.tracer.event("grad ready", param=self.names[i])
        self._launch(state)
    # --8<-- [end:mark_ready]

    # --8<-- [start:launch]
    def _launch(self, state: Backward, wait: bool = False) -> None:
        """Hand complete buckets to the hook in bucket order. A hook that may issue collectives from its
        future's callbacks (PowerSGD) gets bucket k only once bucket k-1's future is done: that hook has then
        issued all its collectives. The default path and the compression hooks issue everything inside the
        call, so several buckets travel at once (gloo and NCCL pair collectives by order of issue)."""
        while state.next_bucket < len(self.buckets) and state.pending[state.next_bucket] == 0:
            if not self.overlap_buckets and state.futures and not state.futures[-1].done():
                if not wait:
                    return  # again at the next gradient, or at the end of backward
                self._wait(state.next_bucket - 1, state.futures[-1])
            self._call_hook(state, self.buckets[state.next_bucket])

    def _call_hook(self, state: Backward, bucket) -> None:
        last = bucket.index == len(self.buckets) - 1
        with issued_as(f"bucket {bucket.index} all-reduce"):
            future = self.hook(self.hook_state, bucket.for_hook(is_last=last, pre_divided=not self.custom_hook))
        if not isinstance(future, torch._C.Future):
            raise TypeError(f"comm hook {hook_name(self.hook)} returned {type(future).__name__} for bucket "
                            f"{bucket.index}: a hook returns a torch.futures.Future of the averaged bucket, e.g. "
                            "dist.all_reduce(bucket.buffer(), async_op=True).get_future()")
        state.futures.append(future)
        if self.tracer is not None:
            work = SimpleNamespace(get_future=lambda: future)  # what trace.Tracer reads, as from a c10d Work
            self.tracer.bucket_launched(SimpleNamespace(index=bucket.index, nbytes=bucket.nbytes,
                                                        params=bucket.params, work=work))
    # --8<-- [end:launch]

    def _wait(self, what, future):
        what = f"all-reduce of bucket {what}" if isinstance(what, int) else what
        with naming_stalled_ranks(f"{what} in backward #{self.backwards}", self.group):
            return future.wait()

    # --8<-- [start:finalize]
    def _finalize(self) -> None:
        """Autograd callback after backward: finish every bucket, write the results back, check the counts."""
        state = self.backward
        self.backwards += 1
        try:
            for i, done in enumerate(state.ready):  # no gradient on this rank: zeros, so nobody hangs
                if not done:
                    state.local_unused.append(i)
                    self._mark_unused(i)
            self._launch(state, wait=True)  # the buckets still waiting for their turn
            device = self.buckets[0].buffer.device
            # issued after every hook's last collective, so nothing comes between them on any rank: at once
            # when the hook issued everything in its calls (it then travels with the last bucket), else after
            summed = state.counts.all_reduce(self.group, device) if self.overlap_buckets else None
            results = [hook_result(self.hook, b.index, self._wait(b.index, f), b.buffer)
                       for b, f in zip(self.buckets, state.futures)]
            if summed is None:
                summed = state.counts.all_reduce(self.group, device)
            self._wait("used-counts all-reduce", summed)
            counts = state.counts.counts()
            for bucket, result in zip(self.buckets, results):
                bucket.write_back(result, counts, state.kept, self.as_view)  # the one place that sets .grad
            self.accumulated.clear()
            self.local_forward = False
        finally:
            self.backward = None  # disarmed, whatever happened
        if self.tracer is not None:
            self.tracer.event("backward end")
        anything_unused = check_counts(counts, state.expected, self.names, find_unused=self.find_unused,
                                       local=state.local_unused, params=self.params)
        if self.find_unused and not anything_unused and not self.warned_no_unused:
            self.warned_no_unused = True  # judged from the counts: nothing unused on ANY rank
            warnings.warn(NOTHING_UNUSED, stacklevel=2)
        if not self.rebuilt:
            self.rebuild_due = True
        if self.auto_cap is not None:
            self.auto_cap.backward_ended()
    # --8<-- [end:finalize]

    # --8<-- [start:rebuild]
    @issued_as("bucket order broadcast")
    def rebuild(self) -> None:
        """Once, before the second synced forward: buckets in the order gradients arrived. With
        ``bucket_cap_mb="auto"`` the cap is chosen here first (collectives: every rank, a joined one too)."""
        self.rebuild_due, self.rebuilt = False, True
        if self.auto_cap is not None:
            self.size_limits = bucket_size_limits(self.auto_cap.choose(self.params, self.group))
        self._install(rebuilt_assignment(self.ready_order, self.params, self.size_limits, self.group))
    # --8<-- [end:rebuild]

    @property
    def bucket_names(self) -> list[list[str]]:
        return [list(b.names) for b in self.buckets]

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()


def _hook_once(param, fn, owner):
    """Register ``fn`` on ``param``, removing the hook an earlier wrapper of the same parameter left:
    wrapping a module again must not leave the old reducer reacting to every backward. The old reducer
    is marked superseded: its wrapper's next forward raises instead of averaging nothing."""
    old = _HOOKED.get(id(param))
    if old is not None and old[0]() is param:
        old[1].remove()
        previous = old[2]()
        if previous is not None and previous is not owner:
            previous.superseded = True
    handle = param.register_post_accumulate_grad_hook(fn)
    _HOOKED[id(param)] = (weakref.ref(param, lambda _, key=id(param): _HOOKED.pop(key, None)), handle,
                          weakref.ref(owner))
    return handle
