"""Module state: check it matches at wrap, copy it from rank 0, keep buffers in step.

What
    ``verify_param_shapes`` checks that every rank built the same model (names,
    shapes, dtypes) and names the first difference; ``sync_module_states``
    broadcasts parameters (and buffers) from rank 0 when DDP wraps a model;
    ``broadcast_buffers`` re-broadcasts buffers (BatchNorm's running mean and
    variance, step counters...) at the start of every forward; all through
    ``broadcast_coalesced``, which packs many tensors into few broadcasts.

Why
    DDP keeps replicas identical by applying identical updates, which only works
    if they *start* identical: ranks seeded differently (or not at all) would
    otherwise train different models while averaging their gradients. A shape
    mismatch must fail loudly at wrap time: left alone it turns into a bucket of
    the wrong size and a collective that hangs or sums unrelated numbers. Buffers
    get no gradients, so averaging never touches them: BatchNorm's running stats
    drift apart per rank unless someone copies them.

How torch differs
    torch does the same at construction (``_verify_param_shape_across_processes``
    and ``_sync_module_states`` with 250 MiB broadcast buckets, in
    ``torch/nn/parallel/distributed.py`` and ``torch/distributed/utils.py``) and
    ``_sync_buffers`` before each forward. With ``broadcast_buffers=False`` torch
    syncs neither at wrap nor per forward; so do we. We write broadcast results
    through ``.data`` so that autograd's version counters do not move: two forwards
    before one backward must not fail with "modified by an inplace operation".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's _DEFAULT_BROADCAST bucket at wrap


class ParameterMismatchError(ValueError):
    """Ranks hold models with different parameters; raised on every rank alike."""


# --8<-- [start:verify]
def verify_param_shapes(module: torch.nn.Module, group=None) -> None:
    """Raise on every rank if any rank's parameters differ (name, shape or dtype) from rank 0's."""
    mine = [(name, tuple(p.shape), str(p.dtype).replace("torch.", "")) for name, p in module.named_parameters()]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)  # small, once: pickled lists are fine
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for k, (ref, got) in enumerate(zip(reference, theirs)):
            if ref != got:
                raise ParameterMismatchError(
                    f"parameter #{k} differs between rank 0 and rank {rank}: rank 0 has {ref[0]} "
                    f"shape {ref[1]} {ref[2]}, rank {rank} has {got[0]} shape {got[1]} {got[2]}. "
                    "Every rank must build the same model before wrapping it in DistributedDataParallel.")
        if len(reference) != len(theirs):
            longer, extra = (0, reference) if len(reference) > len(theirs) else (rank, theirs)
            raise ParameterMismatchError(
                f"rank 0 has {len(reference)} parameters, rank {rank} has {len(theirs)}; the first one only "
                f"rank {longer} has is {extra[min(len(reference), len(theirs))][0]}.")
# --8<-- [end:verify]


# --8<-- [start:coalesced]
def broadcast_coalesced(tensors, src_rank: int = 0, group=None, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcast ``tensors`` from group rank ``src_rank``: few flat messages instead of one per tensor."""
    src = dist.get_global_rank(group or dist.group.WORLD, src_rank)
    pending: dict = {}  # (dtype, device) -> tensors waiting to be packed
    for t in tensors:
        key = (t.dtype, t.device)
        pending.setdefault(key, []).append(t)
        if sum(x.numel() * x.element_size() for x in pending[key]) >= bucket_bytes:
            _broadcast_flat(pending.pop(key), src, group)
    for chunk in pending.values():
        _broadcast_flat(chunk, src, group)


def _broadcast_flat(chunk, src, group) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t in chunk:
        t.data.copy_(flat[offset : offset + t.numel()].view_as(t))  # .data: no version bump
        offset += t.numel()
# --8<-- [end:coalesced]


def sync_module_states(module: torch.nn.Module, group=None, include_buffers: bool = True) -> None:
    """Make every rank's parameters (and buffers) equal to rank 0's."""
    tensors = [p for p in module.parameters()]
    if include_buffers:
        tensors += [b for b in module.buffers()]
    if tensors:
        broadcast_coalesced(tensors, 0, group)


# --8<-- [start:broadcast_buffers]
def broadcast_buffers(module: torch.nn.Module, group=None) -> None:
    """Before each forward: every rank's buffers become rank 0's (``broadcast_buffers=True``)."""
    buffers = [b for b in module.buffers()]
    if buffers and dist.get_world_size(group) > 1:
        broadcast_coalesced(buffers, 0, group)
# --8<-- [end:broadcast_buffers]
