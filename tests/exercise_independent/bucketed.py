"""An independent correct solution of ``bucketed``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: the buckets are found by grouping the parameters by (dtype, device) first
and cutting each group greedily, then ordering all buckets by the latest parameter each holds. The hooks sit
on each parameter's ``AccumulateGrad`` node (picotron's way, ``grad_fn.next_functions``), not
``register_post_accumulate_grad_hook``; gradients are copied into the bucket undivided, and the whole flat
bucket is multiplied by ``1 / world_size`` just before its all-reduce (still before the sum). Readiness is a
countdown per bucket; the copy back splits the flat result with ``torch.split``. The wrap broadcasts one
flat tensor per dtype instead of one message per tensor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

MiB = 1024 * 1024


def assign_buckets(params, bucket_cap_mb):
    groups = {}
    for i in range(len(params) - 1, -1, -1):
        groups.setdefault((params[i].dtype, params[i].device), []).append(i)
    buckets = []
    for indices in groups.values():
        current, size = [], 0
        for i in indices:
            current.append(i)
            size += params[i].numel() * params[i].element_size()
            if size >= bucket_cap_mb * MiB:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    buckets.sort(key=max, reverse=True)
    return buckets


class BucketedDataParallel(nn.Module):
    def __init__(self, module, bucket_cap_mb=25, process_group=None):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError("bucket_cap_mb must be > 0")
        self.module = module
        self.group = process_group or dist.group.WORLD
        self.n = dist.get_world_size(self.group)
        self.require_backward_grad_sync = True
        self._syncing = True
        self._coalesced_broadcast()
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.bucket_params = [[named[i][1] for i in b] for b in assign_buckets([p for _, p in named], bucket_cap_mb)]
        self.bucket_assignment = [[named[i][0] for i in b] for b in assign_buckets([p for _, p in named],
                                                                                   bucket_cap_mb)]
        self.flats = [torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
                      for ps in self.bucket_params]
        self.where = {}
        for b, ps in enumerate(self.bucket_params):
            offset = 0
            for p in ps:
                self.where[id(p)] = (b, offset)
                offset += p.numel()
        self._reset()
        self._accumulators = []  # the AccumulateGrad nodes must stay alive for their hooks to stay
        for _, p in named:
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            node.register_hook(self._hook_for(p))
            self._accumulators.append(node)

    def _reset(self):
        self.countdown = [len(ps) for ps in self.bucket_params]
        self.handles = []
        self.queued = False

    def _coalesced_broadcast(self):
        tensors = [t.detach() for t in [*self.module.parameters(), *self.module.buffers()]]
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        root = dist.get_global_rank(self.group, 0)
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.broadcast(flat, src=root, group=self.group)
            for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(chunk.view_as(t))

    def forward(self, *inputs, **kwargs):
        self._syncing = self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def _hook_for(self, p):
        def hook(*_):
            if not self._syncing:
                return
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            b, offset = self.where[id(p)]
            self.flats[b][offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            self.countdown[b] -= 1
            while len(self.handles) < len(self.flats) and self.countdown[len(self.handles)] == 0:
                flat = self.flats[len(self.handles)]
                flat.mul_(1.0 / self.n)
                self.handles.append(dist.all_reduce(flat, group=self.group, async_op=True))
        return hook

    def _end_of_backward(self):
        handles, countdown = self.handles, self.countdown
        self._reset()
        for b, handle in enumerate(handles):
            handle.wait()
            ps = self.bucket_params[b]
            for p, chunk in zip(ps, self.flats[b].split([p.numel() for p in ps])):
                p.grad.copy_(chunk.view_as(p))
        if any(countdown):
            raise RuntimeError("some parameters got no gradient in this backward")
