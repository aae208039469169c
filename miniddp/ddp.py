"""miniddp.DistributedDataParallel: the concepts, composed.

What
    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` for the arguments
    ``device_ids, process_group, bucket_cap_mb, broadcast_buffers,
    find_unused_parameters, gradient_as_bucket_view``. Wrapping checks that every
    rank built the same model and copies rank 0's state (``buffers.py``); each
    forward re-broadcasts buffers and arms the reducer; each backward averages
    gradients in buckets that overlap with the computation (``bucketing.py``,
    ``reducer.py``), unless the forward ran in ``no_sync()`` (``no_sync.py``);
    parameters without gradients are handled or reported (``unused.py``).

Why
    Each piece alone is a page of this site; this file is where they meet, and
    where one training step can be followed from top to bottom.

How torch differs
    torch's ``DistributedDataParallel`` (``torch/nn/parallel/distributed.py`` +
    ``reducer.cpp``) also supports static graphs, communication hooks
    (compression, PowerSGD), mixed-device modules, sparse gradients, join for
    uneven inputs and Python-side optimizer overlap; we leave those out. We raise
    a missing gradient at the end of the same backward instead of the next
    iteration.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .bucketing import bucket_size_limits
from .buffers import broadcast_buffers, sync_module_states, verify_param_shapes
from .no_sync import no_sync
from .reducer import Reducer


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper: same constructor arguments and semantics as torch's DDP."""

    def __init__(self, module: torch.nn.Module, device_ids=None, *, process_group=None, bucket_cap_mb=None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, tracer=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs a process group: call "
                               "miniddp.init_distributed() (or torch.distributed.init_process_group) first")
        _check_device_ids(module, device_ids)
        self.module = module  # the model; its state_dict is what you save
        self.process_group = process_group or dist.group.WORLD  # the ranks we average with
        self.broadcast_buffers = broadcast_buffers  # copy rank 0's buffers before every forward
        self.require_backward_grad_sync = True  # False inside no_sync()
        limits = bucket_size_limits(bucket_cap_mb)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied weights once
        if not named:
            raise ValueError("the module has no parameter with requires_grad=True: there is nothing to average")
        # --8<-- [start:wrap]
        verify_param_shapes(module, self.process_group)  # same model everywhere, or a clear error
        sync_module_states(module, self.process_group, include_buffers=broadcast_buffers)  # rank 0's state
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], self.process_group, limits,
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view, tracer=tracer)
        # --8<-- [end:wrap]

    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        self.reducer.rebuild_if_due()  # once, after the first iteration
        if self.broadcast_buffers:
            broadcast_buffers(self.module, self.process_group)  # BatchNorm stats: rank 0's
        outputs = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.reducer.prepare_for_backward(outputs)  # arm the hooks for this graph
        # a no_sync or no-grad forward leaves the reducer as it was: an earlier synced
        # forward whose backward has not run yet still syncs (as in torch)
        return outputs
    # --8<-- [end:forward]

    def no_sync(self):
        """Context manager: accumulate gradients locally; see ``miniddp.no_sync``."""
        return no_sync(self)

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are reduced."""
        return self.reducer.bucket_names


def _check_device_ids(module, device_ids) -> None:
    if device_ids is None:
        return
    if len(device_ids) != 1:
        raise ValueError(f"device_ids={device_ids!r}: one process drives one device; pass [local_rank]")
    expected = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else torch.device("cuda", device_ids[0])
    for name, p in module.named_parameters():
        if p.device != expected:
            raise ValueError(f"device_ids={device_ids!r} but parameter {name} is on {p.device}; "
                             f"move the model first: model.to({str(expected)!r})")
