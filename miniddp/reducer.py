"""The reducer: launch each bucket's all-reduce the moment its gradients exist.

What
    ``Reducer`` registers one hook per parameter. During a synchronised backward
    the hook writes the fresh gradient into its bucket; when a bucket has all its
    gradients it is launched (``all_reduce(async_op=True)``), strictly in bucket
    order. A callback queued on the autograd engine runs when backward is over:
    it waits for every bucket and writes the averages back, so **when
    ``loss.backward()`` returns, every ``.grad`` holds the mean over ranks**.
    After the first iteration the buckets are rebuilt once, in the order the
    gradients really arrived (agreed across ranks by a broadcast from rank 0).

Why
    Backward produces gradients last layer first. Launching a bucket while the
    earlier layers are still differentiating hides communication behind compute
    (the DDP paper, arXiv 2006.15704, §3.2.3 "Overlap Computation with
    Communication"). Launching in one fixed order on every rank matters as much:
    collectives are matched by order, so two ranks launching buckets 3 then 2
    and 2 then 3 would sum the wrong buffers together (or deadlock).

How torch differs
    ``torch/csrc/distributed/c10d/reducer.cpp`` does the same in C++: autograd
    hooks on the ``AccumulateGrad`` nodes, ``mark_variable_ready``, buckets
    launched in order, ``finalize_backward`` queued with
    ``queue_callback``, and a one-time ``rebuild_buckets``. We use
    ``register_post_accumulate_grad_hook`` (it receives the *parameter*, whose
    ``.grad`` now holds the accumulated gradient) and keep it in Python.
    Like torch, only a backward that reaches the parameters' ``AccumulateGrad``
    nodes syncs: a ``torch.autograd.grad`` call in between (a gradient penalty)
    computes input gradients and leaves the sync armed for ``loss.backward()``.
    When a bucket's all-reduce times out or loses a peer, we name the ranks that
    never reached it (``timeouts.naming_stalled_ranks``); torch's error does not.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from .bucketing import build_buckets, compute_bucket_assignment
from .timeouts import naming_stalled_ranks
from .unused import UnusedParameterError, find_tensors, missing_gradients_message, unused_parameters


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters."""

    def __init__(self, params, names, process_group, size_limits, *, find_unused_parameters=False,
                 gradient_as_bucket_view=False, tracer=None):
        self.params = list(params)  # parameters that require grad, registration order
        self.names = list(names)  # their qualified names
        self.group = process_group  # who we average with
        self.world_size = dist.get_world_size(process_group)
        self.size_limits = list(size_limits)  # bucket byte limits (first, then the rest)
        self.find_unused = find_unused_parameters  # walk the graph after each forward?
        self.as_view = gradient_as_bucket_view  # .grad is a view into the bucket
        self.tracer = tracer  # optional miniddp.trace.Tracer
        # registration order, buckets filled then reversed: the last layers reduce first
        assignment = list(reversed(compute_bucket_assignment(self.params, self.size_limits)))
        self._install(assignment)
        self.expect_hooks = False  # True between a synced forward and the end of its backward
        self.started = False  # has this backward begun (callback queued)?
        self.ready_order: list[int] = []  # parameter indices as their gradients arrived (first iteration)
        self.rebuilt = find_unused_parameters  # torch never rebuilds when the graph may change
        self.rebuild_due = False  # rebuild at the next forward
        self.warned_no_unused = False  # the "flag set but nothing unused" warning, once
        self.local_unused: list[int] = []  # this backward's parameters without a local gradient
        self.used_since_sync = [False] * len(self.params)  # got a gradient since the last sync (no_sync too)
        self.divisor = self.world_size  # gradients are divided by this (join: maybe the active ranks only)
        self.expected = self.world_size  # ranks that must produce each gradient (join: the active ones)
        self.backwards = 0  # synced backwards so far: names a collective in error messages
        self.hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self._check_counter_precision()

    def _install(self, assignment) -> None:
        self.buckets = build_buckets(self.params, self.names, assignment)
        self.where = {}  # parameter index -> (bucket, position in bucket)
        for b, indices in enumerate(assignment):
            for k, i in enumerate(indices):
                self.where[i] = (self.buckets[b], k)
        self.ready = [False] * len(self.params)  # gradient written to its bucket this backward?
        self.next_bucket = 0  # the next bucket to launch (launch order = bucket order)

    def _check_counter_precision(self) -> None:
        exact = {torch.bfloat16: 256, torch.float16: 2048}  # integers a dtype counts exactly
        for b in self.buckets:
            if self.world_size > exact.get(b.buffer.dtype, 2**24):
                raise NotImplementedError(f"{b.buffer.dtype} buckets count used-flags exactly only up to "
                                          f"{exact[b.buffer.dtype]} ranks; world_size={self.world_size}")

    # --8<-- [start:prepare]
    def prepare_for_backward(self, outputs, divisor: int | None = None, expected: int | None = None) -> None:
        """Called at the end of a synced forward: arm the hooks for the coming backward."""
        self.expect_hooks, self.started, self.local_unused = True, False, []
        self.divisor, self.expected = divisor or self.world_size, expected or self.world_size
        self.ready = [False] * len(self.params)
        self.next_bucket = 0
        for b in self.buckets:
            b.reset()
        if self.find_unused:
            self.local_unused = unused_parameters(outputs, self.params)
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
        if self.started or not self.expect_hooks:
            return
        self.started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)  # runs after backward
        if self.tracer is not None:
            self.tracer.event("backward start")
        for i in self.local_unused:  # found by the graph walk: ready now
            self._mark_unused_ready(i)

    def _make_hook(self, i: int):
        def hook(param):  # post-accumulate-grad hooks receive the parameter itself
            grad = param.grad
            if grad is not None and grad.layout != torch.strided:
                raise NotImplementedError(f"parameter {self.names[i]} got a {grad.layout} gradient: miniddp "
                                          "averages dense gradients only (use sparse=False, or torch's DDP)")
            if grad is not None:
                self.used_since_sync[i] = True  # counted even inside no_sync, as torch does
            if not self.expect_hooks:  # inside no_sync, or a forward that bypassed DDP
                return
            self._start_backward()
            if not self.rebuilt:
                self.ready_order.append(i)
            self._mark_ready(i, grad, used=True)
        return hook

    def _mark_unused_ready(self, i: int) -> None:
        """No gradient in this backward. With find_unused_parameters, a gradient accumulated
        under no_sync still counts (torch copies any defined .grad); otherwise zeros, flagged."""
        if self.find_unused:
            self._mark_ready(i, self.params[i].grad, used=self.used_since_sync[i])
        else:
            self._mark_ready(i, None, used=False)

    # --8<-- [start:mark_ready]
    def _mark_ready(self, i: int, grad, used: bool) -> None:
        if self.ready[i] and i in self.local_unused:  # the walk said "unused", yet a gradient came
            raise RuntimeError(
                f"parameter {self.names[i]} received a gradient, but find_unused_parameters' graph walk from the "
                "forward's outputs did not reach it. Usual causes: reentrant activation checkpointing "
                "(torch.utils.checkpoint(..., use_reentrant=True) hides the segment's parameters until backward: "
                "use use_reentrant=False), or an output object that hides its tensors from the walk.")
        if self.ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]} got its gradient twice in one backward (reentrant gradient "
                "checkpointing, or a module used in two separate backward passes); use "
                "torch.utils.checkpoint(..., use_reentrant=False)")
        self.ready[i] = True
        bucket, k = self.where[i]
        bucket.put(k, grad, self.divisor, self.as_view, used)
        if self.tracer is not None:
            self.tracer.event("grad ready", param=self.names[i])
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            b = self.buckets[self.next_bucket]  # launch in order, never out of it
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
            if self.tracer is not None:
                self.tracer.bucket_launched(b)
            self.next_bucket += 1
    # --8<-- [end:mark_ready]

    # --8<-- [start:finalize]
    def _finalize(self) -> None:
        """Autograd callback after backward: finish every bucket, write the averages back."""
        self.expect_hooks = False
        for i, done in enumerate(self.ready):  # no gradient on this rank: zeros, so nobody hangs
            if not done:
                self.local_unused.append(i)
                self._mark_unused_ready(i)
        missing, counts, anything_unused = [], [], False
        self.backwards += 1
        for b in self.buckets:
            with naming_stalled_ranks(f"all-reduce of bucket {b.index} in backward #{self.backwards}", self.group):
                b.work.wait()
        # every bucket's used-counters in one host copy: on a GPU each .tolist() is a sync point
        used = iter(torch.cat([b.used.to(torch.float64) for b in self.buckets]).tolist())
        for b in self.buckets:
            for k, p in enumerate(b.params):
                c = round(next(used))  # ranks that produced this gradient
                anything_unused |= c < self.expected
                if c < self.expected and not self.find_unused:
                    missing.append(b.names[k])
                    counts.append(c)
                if c == 0:  # unused on every rank: .grad stays as it was
                    continue
                if self.as_view:
                    p.grad = b.views[k]
                elif p.grad is None:
                    p.grad = b.views[k].clone()
                else:
                    p.grad.copy_(b.views[k])
        self.used_since_sync = [False] * len(self.params)
        if self.tracer is not None:
            self.tracer.event("backward end")
        if missing:
            local = [self.names[i] for i in self.local_unused]
            frozen = [self.names[i] for i in self.local_unused if not self.params[i].requires_grad]
            raise UnusedParameterError(missing_gradients_message(missing, counts, self.expected, local, frozen),
                                       missing)
        if self.find_unused and not anything_unused and not self.warned_no_unused:
            self.warned_no_unused = True  # judged from the counts: nothing unused on ANY rank
            warnings.warn("find_unused_parameters=True but no parameter was unused in this backward on any rank: "
                          "the graph walk after every forward costs time for nothing; consider False.", stacklevel=2)
        if not self.rebuilt:
            self.rebuild_due = True
    # --8<-- [end:finalize]

    # --8<-- [start:rebuild]
    def rebuild(self) -> None:
        """Once, before the second synced forward: buckets in the order gradients arrived."""
        self.rebuild_due, self.rebuilt = False, True
        arrived = list(dict.fromkeys(self.ready_order))
        order = arrived + [i for i in range(len(self.params)) if i not in set(arrived)]
        agreed = torch.tensor(order, dtype=torch.int64, device=self.buckets[0].buffer.device)
        dist.broadcast(agreed, src=dist.get_global_rank(self.group, 0), group=self.group)  # rank 0's order wins
        order = agreed.tolist()
        assignment = compute_bucket_assignment([self.params[i] for i in order], self.size_limits)
        self._install([[order[j] for j in bucket] for bucket in assignment])
    # --8<-- [end:rebuild]

    @property
    def bucket_names(self) -> list[list[str]]:
        return [list(b.names) for b in self.buckets]

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
