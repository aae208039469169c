"""An independent correct solution of ``averaging``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: ``all_reduce_mean`` multiplies by the reciprocal ``1 / world_size``
(``mul_``) instead of dividing, still before the SUM by default so float16 cannot overflow.
``average_gradients`` does not use ``all_reduce_mean`` or the ``_gradients`` helper: it collects the
distinct gradients itself (a dict keyed by ``id``), scales them all, then launches every all-reduce
with ``async_op=True`` and waits on them together, so the collectives overlap instead of blocking
one by one. It still issues one all-reduce per gradient in registration order: the spec counts them
(a flattened single all-reduce gives the right means but is rejected: the baseline is one per gradient).
``chunk_bounds``, ``ring_schedule`` and ``ring_all_reduce`` below are the skeleton's (the ``ring``
exercise's reference); the reference averaging was visible in the ``ring`` skeleton before this was written.
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
    """Mean over the group's ranks, in place: divide then SUM (``predivide``) or SUM then divide."""
    scale = 1.0 / dist.get_world_size(group)  # exact for 1, 2, 4 ranks; within an ulp otherwise
    if predivide:  # each term is at most the largest input, so the sum cannot overflow
        tensor.mul_(scale)
    dist.all_reduce(tensor, group=group)
    if not predivide:
        tensor.mul_(scale)
    return tensor
# --8<-- [end:all_reduce_mean]


# --8<-- [start:average_gradients]
@issued_as("naive gradient all-reduce")
def average_gradients(params_or_module, group=None, *, predivide: bool = True) -> int:
    """Replace every gradient by its mean over the group's ranks; return the collectives issued.

    The naive baseline: one blocking all-reduce per parameter, in registration
    order. Parameters whose ``.grad`` is ``None`` are skipped, so every rank must
    agree on which ones have gradients (or the collectives pair up wrongly). A
    rank outside ``group`` issues nothing and returns 0.
    """
    if dist.get_rank(group) < 0:  # not in the group (size -1): nothing to average here
        return 0
    if isinstance(params_or_module, nn.Module):
        candidates = list(params_or_module.parameters())
    elif isinstance(params_or_module, torch.Tensor):
        candidates = [params_or_module]
    else:
        candidates = list(params_or_module)
    distinct = {id(p): p for p in candidates if p.grad is not None}  # a tied parameter once; order kept
    grads = [p.grad for p in distinct.values()]
    scale = 1.0 / dist.get_world_size(group)
    with torch.no_grad():
        if predivide:
            for g in grads:
                g.mul_(scale)
        pending = [dist.all_reduce(g, group=group, async_op=True) for g in grads]  # all in flight at once
        for work in pending:
            work.wait()
        if not predivide:
            for g in grads:
                g.mul_(scale)
    return len(pending)
# --8<-- [end:average_gradients]


# --8<-- [start:chunks]
def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``world_size`` contiguous chunks; the first ``numel % n`` get one more."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)  # empty chunks when numel < world_size
        bounds.append((start, end))
        start = end
    return bounds


def ring_schedule(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """``(phase, chunk sent to the right, chunk received from the left)`` for each of 2(n-1) steps.

    After reduce-scatter step s, the chunk a rank just received holds the sum of
    s + 2 ranks; after n-1 steps rank r owns the full sum of chunk (r + 1) % n.
    The all-gather then passes each finished chunk once around the ring.
    """
    n = world_size
    reduce_scatter = [("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    all_gather = [("all-gather", (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]
    return reduce_scatter + all_gather
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
    """SUM ``tensor`` over the group's ranks, in place, with a ring of ``isend``/``irecv``.

    Equal to ``dist.all_reduce(tensor, group=group)`` (exactly, for integer-valued
    data; floats may round differently because the order of additions differs).
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
    for phase, send_i, recv_i in ring_schedule(rank, n):
        (s0, s1), (r0, r1) = bounds[send_i], bounds[recv_i]
        if phase == "reduce-scatter":  # receive a partial sum, add ours to it
            incoming = scratch[: r1 - r0]
            _exchange(flat[s0:s1], right, incoming, left, group)
            flat[r0:r1].add_(incoming)
        else:  # all-gather: receive a finished chunk straight into place
            _exchange(flat[s0:s1], right, flat[r0:r1], left, group)
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
