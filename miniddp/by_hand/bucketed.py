"""A bucketed DDP by hand: the middle step between ``average_gradients`` and the engine.

What
    ``BucketedDataParallel(module, bucket_cap_mb=25, process_group=None)`` wraps a module so that
    ``loss.backward()`` leaves every ``.grad`` the mean over the group's ranks, as torch's DDP does, in one
    class: parameters and buffers broadcast from rank 0 at wrap; gradients packed into flat buckets of about
    ``bucket_cap_mb`` MiB, filled from the last parameter to the first (``assign_buckets``); each gradient
    divided by N as it is copied in; each bucket all-reduced asynchronously from the gradient hooks as soon
    as it is complete *and* every bucket before it has gone; at the end of backward every bucket waited for
    and copied back into ``.grad``. Backwards of forwards run inside ``no_sync()`` communicate nothing:
    ``.grad`` accumulates locally, and the next synced backward averages the sum.

Why
    ``average_gradients`` waits for the whole backward, then pays one collective's latency per parameter.
    Buckets pay it once per ~25 MB, and the first buckets travel while backward still computes the rest
    (the DDP paper, arXiv 2006.15704, sections 3.2.2 and 3.2.3). Collectives pair up by the order they are
    issued, not by name (section 3.2.3: no rank may launch bucket i+1 before bucket i): a rank whose autograd
    completes bucket 1 first must still launch 0 first, or it sums its bucket 1 with another rank's bucket 0
    (or hangs on a size mismatch).

How torch differs
    torch/nn/parallel/distributed.py builds a C++ ``Reducer`` (torch/csrc/distributed/c10d/reducer.cpp) with
    the same hook, ordered launch and end-of-backward callback. It fills buckets in registration order and
    reverses the list; unless ``find_unused_parameters``, its first iteration uses one bucket for the whole
    model, and the buckets are then rebuilt in the order gradients arrived (a 1 MiB first one by default).
    It broadcasts buffers at every forward and adds unused parameters, comm hooks, ``static_graph``,
    ``join`` and ``gradient_as_bucket_view``: the engine (``engine/reducer.py``) adds those around this loop.
    picotron's ``data_parallel/data_parallel.py`` (``DataParallelBucket``) has this shape too, but launches a
    bucket the moment it completes (right only while every rank's autograd runs in one order), broadcasts
    nothing at wrap, and accumulates in fp32 ``main_grad`` buffers; a bucket with an unused parameter never
    fires there, silently, where here the end of backward names the parameter.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

MiB = 1024 * 1024


# --8<-- [start:assign]
def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[int]]:
    """Indices of ``params`` per bucket, in launch order. Walking the parameters from the last to the first
    (backward produces the last layer's gradients first), each joins the one open bucket of its dtype and
    device, which closes once it holds ``bucket_cap_mb`` MiB or more; the buckets come back ordered by the
    latest parameter each holds, latest first. Every rank computes the same buckets from the same model."""
    ### BEGIN SOLUTION
    closed, open_buckets = [], {}  # (dtype, device) -> [indices, bytes so far]
    for i in reversed(range(len(params))):
        key = (params[i].dtype, params[i].device)  # one flat buffer holds one dtype on one device
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(i)
        bucket[1] += params[i].numel() * params[i].element_size()
        if bucket[1] >= bucket_cap_mb * MiB:  # full: the next parameter of this kind opens another
            closed.append(open_buckets.pop(key)[0])
    closed += [indices for indices, _ in open_buckets.values()]  # the partly filled ones
    return sorted(closed, key=lambda indices: -indices[0])
    ### END SOLUTION
# --8<-- [end:assign]


class _Bucket:
    """One flat buffer holding the gradients of a group of same-dtype, same-device parameters."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params  # their gradients sit in the buffer in this order
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0  # views[k]: params[k]'s slice of the buffer, shaped like it
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.ready: set[int] = set()  # positions k whose gradient is in the buffer, this backward
        self.work = None  # the handle of its all-reduce (async_op=True), once launched

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class BucketedDataParallel(nn.Module):
    """``module`` made data-parallel: after each synced ``loss.backward()`` every ``.grad`` holds the mean of
    the ranks' gradients. ``no_sync()`` for gradient accumulation; ``bucket_assignment`` names the buckets."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, process_group=None):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number of MiB > 0, e.g. 25")
        self.module = module  # the model itself: the optimizer updates its parameters
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)  # N in mean = sum / N
        self.require_backward_grad_sync = True  # False inside no_sync()
        self._sync = True  # whether the backward of the latest forward communicates: torch decides at forward
        self._broadcast_from_rank_0()
        self._names = {p: name for name, p in module.named_parameters()}  # for bucket_assignment and errors
        params = [p for p in module.parameters() if p.requires_grad]  # a tied weight once, a frozen one never
        self.buckets = [_Bucket([params[i] for i in indices]) for indices in assign_buckets(params, bucket_cap_mb)]
        self.bucket_assignment = [[self._names[p] for p in b.params] for b in self.buckets]  # in launch order
        self._slot = {p: (b, k) for b, bucket in enumerate(self.buckets) for k, p in enumerate(bucket.params)}
        self._next = 0  # the next bucket to launch: buckets go strictly in bucket order
        self._callback_queued = False  # the end-of-backward callback is queued once per backward
        for p in params:
            # runs once p.grad holds this backward's gradient, added to what .grad held before
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # --8<-- [start:broadcast]
    def _broadcast_from_rank_0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers: replicas that start equal and take equal
        steps stay equal, so nothing but gradients need travel afterwards."""
        ### BEGIN SOLUTION
        src = dist.get_global_rank(self.process_group, 0)  # broadcast names its source by global rank
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(tensor.detach(), src=src, group=self.process_group)
        ### END SOLUTION
    # --8<-- [end:broadcast]

    def forward(self, *args, **kwargs):
        self._sync = self.require_backward_grad_sync  # what counts is where the forward ran, as in torch
        return self.module(*args, **kwargs)

    # --8<-- [start:no_sync]
    @contextmanager
    def no_sync(self):
        """Backwards of the forwards run inside communicate nothing: ``.grad`` accumulates on each rank,
        and the next synced backward averages the accumulated sum (k micro-batches, one all-reduce)."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before
    # --8<-- [end:no_sync]

    # --8<-- [start:hook]
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Autograd calls this once ``p.grad`` is final for this backward (on the thread running backward)."""
        ### BEGIN SOLUTION
        if not self._sync:  # inside no_sync: the gradient stays in p.grad, the next ones add to it
            return
        if not self._callback_queued:  # the first gradient of this backward: finish once autograd is done
            Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        b, k = self._slot[p]
        bucket = self.buckets[b]
        torch.div(p.grad, self.world_size, out=bucket.views[k])  # mean = sum / N, divided on the way in
        bucket.ready.add(k)
        # Launch every complete bucket whose predecessors have all gone, in bucket order: a bucket that
        # completes early waits, so that every rank issues its all-reduces in the same order. Nothing writes
        # into a launched bucket, as each hook fires once per backward (not so under reentrant checkpointing,
        # which the engine's static_graph handles).
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            first = self.buckets[self._next]
            first.work = dist.all_reduce(first.buffer, group=self.process_group, async_op=True)
            self._next += 1
        ### END SOLUTION
    # --8<-- [end:hook]

    # --8<-- [start:finish]
    def _finish(self) -> None:
        """End of backward (autograd's queued callback): wait for every bucket's all-reduce and copy the
        averaged buffer back into each parameter's ``.grad``; a parameter that got no gradient is named."""
        ### BEGIN SOLUTION
        launched, self._next, self._callback_queued = self._next, 0, False
        for bucket in self.buckets[:launched]:
            bucket.work.wait()  # the buffer now holds the sum over ranks of grad / N: the mean
            for p, view in zip(bucket.params, bucket.views):
                p.grad.copy_(view)
        missing = [p for b in self.buckets for k, p in enumerate(b.params) if k not in b.ready]
        for bucket in self.buckets:  # ready for the next backward, whatever happens below
            bucket.ready, bucket.work = set(), None
        if missing:  # their buckets never launched here; on a rank that used them, they wait for ours
            names = [self._names[p] for p in missing]
            raise RuntimeError(f"no gradient reached {names} in this backward, so their buckets were never "
                               "all-reduced: every trainable parameter must get a gradient in every synced "
                               "backward (freeze it with requires_grad_(False), or use "
                               "miniddp.DistributedDataParallel(..., find_unused_parameters=True))")
        ### END SOLUTION
    # --8<-- [end:finish]
