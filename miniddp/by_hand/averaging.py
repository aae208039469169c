"""All-reduce averaging: turning N ranks' gradients into one mean gradient.

What
    ``average_gradients(params_or_module, group=None)`` is the naive baseline: after
    ``backward()``, one ``all_reduce(SUM)`` per gradient, divided by the world size (before
    the sum with ``predivide=True``, as DDP does; ``all_reduce_mean`` is that one-tensor step).
    ``ring_all_reduce(tensor, group=None)`` is the algorithm under ``dist.all_reduce``, from
    point-to-point sends and receives only (``send``/``recv``, ``isend``/``irecv`` or
    ``batch_isend_irecv``; no collective): a reduce-scatter then an all-gather around a ring,
    over ``world_size`` chunks of any size; ``naive_all_reduce`` is its reference.

Why
    The mean of the shards' gradients is the global batch's gradient (the DDP paper, arXiv
    2006.15704, section 2). Where the division happens matters in low precision: summing fp16
    first can overflow, dividing first can underflow. On a ring each rank sends 2(n-1)/n of the
    tensor whatever n is: nccl-tests' "bus bandwidth" factor (``doc/PERFORMANCE.md``).

How torch differs
    DDP issues one collective per ~25 MB bucket while backward runs (``engine/bucketing.py``),
    dividing as it copies into the bucket (``mark_variable_ready_dense`` in ``reducer.cpp``).
    gloo's ``ReduceOp.AVG`` (torch >= 2.7) is SUM then divide (pytorch/pytorch#149781); NCCL's
    ``ncclAvg`` is a pre-multiplied sum. Both pick ring, tree or other algorithms by size and
    topology and pipeline chunks in slices; ours is the plain ring.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..process_group.fingerprint import issued_as


def _gradients(params_or_module) -> list[torch.Tensor]:
    """The ``.grad`` of each distinct parameter that has one, in registration order."""
    if isinstance(params_or_module, nn.Module):
        params: Iterable = params_or_module.parameters()  # already skips tied duplicates
    elif isinstance(params_or_module, torch.Tensor):
        params = [params_or_module]
    else:
        params = params_or_module
    seen: set[int] = set()  # a parameter listed twice must be averaged once
    grads = []
    for p in params:
        if id(p) in seen or p.grad is None:  # frozen or unused: nothing to average
            continue
        seen.add(id(p))
        grads.append(p.grad)
    return grads


# --8<-- [start:all_reduce_mean]
@torch.no_grad()  # in-place on gradients (or parameters): not part of any graph
def all_reduce_mean(tensor: torch.Tensor, group=None, *, predivide: bool = True) -> torch.Tensor:
    """Mean over the group's ranks, in place, returning ``tensor``: divide by ``dist.get_world_size(group)`` then
    all-reduce SUM (``predivide``: no float16 overflow), or SUM then divide (no underflow of tiny values)."""
    ### BEGIN SOLUTION
    world = dist.get_world_size(group)
    if predivide:  # what DDP does: the sum can then never exceed the largest input
        tensor.div_(world)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if not predivide:  # the sum of N gradients may overflow fp16 before we divide
        tensor.div_(world)
    return tensor
    ### END SOLUTION
# --8<-- [end:all_reduce_mean]


# --8<-- [start:average_gradients]
@issued_as("naive gradient all-reduce")
def average_gradients(params_or_module, group=None, *, predivide: bool = True) -> int:
    """Replace every gradient by its mean over the group's ranks (``all_reduce_mean``, passing ``predivide``);
    return the number of all-reduces issued.

    The naive baseline: one all-reduce per gradient, in registration order (what
    bucketing improves on). ``params_or_module``: a module, one tensor, or any
    iterable of parameters (a generator too); a parameter listed twice is averaged
    once, and one whose ``.grad`` is ``None`` is skipped (``_gradients`` does both),
    so every rank must agree on which have gradients (or the collectives pair up
    wrongly). A rank outside ``group`` issues nothing and returns 0.
    """
    if dist.get_rank(group) < 0:  # not in the group (size -1): nothing to average here
        return 0
    ### BEGIN SOLUTION
    collectives = 0  # one all-reduce per gradient: what bucketing reduces
    for grad in _gradients(params_or_module):
        all_reduce_mean(grad, group, predivide=predivide)
        collectives += 1
    return collectives
    ### END SOLUTION
# --8<-- [end:average_gradients]


# --8<-- [start:chunks]
def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``world_size`` ``(start, end)`` pairs tiling ``range(numel)`` in order: each chunk ``numel // world_size``
    long, the first ``numel % world_size`` one longer (empty chunks when ``numel < world_size``)."""
    ### BEGIN SOLUTION
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)  # empty chunks when numel < world_size
        bounds.append((start, end))
        start = end
    return bounds
    ### END SOLUTION


def ring_schedule(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """``(phase, chunk sent to the right, chunk received from the left)`` for each of 2(n-1) steps.

    ``phase`` is the literal string ``"reduce-scatter"`` for the first n-1 steps
    (the received chunk is added to this rank's), then ``"all-gather"`` for n-1
    (it replaces this rank's). Rank ``r`` sends to ``(r + 1) % n`` and receives
    from ``(r - 1) % n``: the chunk it receives at a step is the one its left
    neighbour sends. After reduce-scatter step s, the chunk a rank just received
    holds the sum of s + 2 ranks; after n-1 steps each rank owns the full sum of
    one chunk (sending chunk r first, rank r owns chunk (r + 1) % n). The
    all-gather then passes each finished chunk once around the ring.
    """
    ### BEGIN SOLUTION
    n = world_size
    reduce_scatter = [("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    all_gather = [("all-gather", (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]
    return reduce_scatter + all_gather
    ### END SOLUTION
# --8<-- [end:chunks]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to ``dst`` and receive from ``src`` at once (both posted before either waits).

    Posting both before waiting is what keeps the ring from deadlocking: if
    every rank did a blocking send first, each could wait for a receive that its
    neighbour, itself stuck sending, never posts. An empty
    chunk is skipped on both ends (its sender and receiver compute the same
    bounds), so a tensor smaller than the ring still works.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# --8<-- [start:ring_all_reduce]
@torch.no_grad()  # like dist.all_reduce: works on parameters too, outside autograd
@issued_as("ring all-reduce")
def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """SUM ``tensor`` over the group's ranks, in place, returning it, with point-to-point messages only.

    Equal to ``dist.all_reduce(tensor, group=group)`` (exactly, for integer-valued
    data; floats may round differently because the order of additions differs).
    Step by step of ``ring_schedule``: one send of one chunk to the right, one
    receive from the left (``_exchange`` posts both before waiting, and skips an
    empty chunk), so each rank sends 2(n-1) messages, 2(n-1)/n of the tensor, and
    issues no collective.
    A rank outside ``group`` returns ``tensor`` untouched, as torch's collectives do.
    """
    group = group if group is not None else dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)  # positions *within* the group
    if rank < 0 or n == 1:  # not a member, or nobody to talk to
        return tensor
    right = dist.get_global_rank(group, (rank + 1) % n)  # p2p addresses are global ranks
    left = dist.get_global_rank(group, (rank - 1) % n)
    contiguous = tensor.is_contiguous()  # p2p needs contiguous memory: else work on a copy
    flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=tensor.dtype, device=tensor.device)
    ### BEGIN SOLUTION
    for phase, send_i, recv_i in ring_schedule(rank, n):
        (s0, s1), (r0, r1) = bounds[send_i], bounds[recv_i]
        if phase == "reduce-scatter":  # receive a partial sum, add ours to it
            incoming = scratch[: r1 - r0]
            _exchange(flat[s0:s1], right, incoming, left, group)
            flat[r0:r1].add_(incoming)
        else:  # all-gather: receive a finished chunk straight into place
            _exchange(flat[s0:s1], right, flat[r0:r1], left, group)
    ### END SOLUTION
    if not contiguous:  # write the copy's result back into the caller's tensor
        tensor.copy_(flat.view(tensor.shape))
    return tensor
# --8<-- [end:ring_all_reduce]


# --8<-- [start:naive_all_reduce]
@torch.no_grad()
def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The reference: gather every rank's tensor, add them up in rank order, in place.

    Each rank receives (n-1) whole tensors, where the ring receives 2(n-1)/n of one.
    """
    mine = tensor.contiguous()  # collectives want contiguous buffers
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    total = gathered[0].clone()
    for other in gathered[1:]:
        total.add_(other)  # in the tensor's own dtype, as the collectives do
    return tensor.copy_(total)
# --8<-- [end:naive_all_reduce]
