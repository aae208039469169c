"""An independent correct solution of ``reduce_scatter``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: the chunk size is ``(n + N - 1) // N``; the pieces come from interval
arithmetic on the parameters' cumulative ends; padding is ``F.pad``; landing builds a new shard tensor
(``before + mean``) and points the pieces' ``.grad`` at it again, instead of adding in place; the divisor is
set on its own line; the reduce-scatter is ``dist.reduce_scatter`` of a list of chunks, whose ``Work`` a thread
waits for, not miniddp's counted wrapper. The rest of the file is the skeleton's as ``miniddp exercise start
reduce_scatter`` writes it today.
"""

from __future__ import annotations

import itertools
import threading

import torch
import torch.distributed as dist

from ..engine.bucket_collective import BucketCollective


class Piece:
    """Where this rank's chunk of a bucket meets parameter ``index``: elements ``[start, stop)`` of its flat view."""

    def __init__(self, param: torch.Tensor, index: int, start: int, stop: int, offset: int):
        self.param, self.index, self.start, self.stop = param, index, start, stop
        self.offset = offset  # where the piece begins in this rank's chunk of the bucket
        self.tensor = param.detach().view(-1)[start:stop]  # the optimizer's parameter: a view of the real one


# --8<-- [start:shards]
class Shards:
    """Each bucket's chunk size and this rank's pieces; the shards of the averaged gradient, one per bucket."""

    def __init__(self, buckets, rank: int, world_size: int):
        self.buckets, self.rank, self.world_size = buckets, rank, world_size
        self.chunk = [(b.buffer.numel() + world_size - 1) // world_size for b in buckets]
        self.pieces = [self._cut(b, size) for b, size in zip(buckets, self.chunk)]
        self.grad: list[torch.Tensor | None] = [None] * len(buckets)  # this rank's averaged chunk, per bucket
        self.used: set[int] = set()  # parameters some rank had a gradient for since zero_grad

    def _cut(self, bucket, size: int) -> list[Piece]:
        # Interval arithmetic: this rank's chunk [first, last) against each parameter's [begin, end) in the bucket.
        first, last = self.rank * size, self.rank * size + size
        ends = list(itertools.accumulate(p.numel() for p in bucket.params))
        pieces = []
        for index, param, end in zip(bucket.indices, bucket.params, ends):
            begin = end - param.numel()
            if end <= first or begin >= last:
                continue
            lo, hi = max(begin, first), min(end, last)
            pieces.append(Piece(param, index, lo - begin, hi - begin, lo - first))
        return pieces

    def padded(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (bucket ``b``'s layout) with zeros up to ``world_size`` whole chunks."""
        return torch.nn.functional.pad(flat, (0, self.chunk[b] * self.world_size - flat.numel()))

    def land(self, b: int, mean_chunk: torch.Tensor, counts: list[int]) -> None:
        """Add this rank's chunk of bucket ``b``'s mean to its shard; a piece gets a ``.grad`` once some rank
        had its parameter's gradient (unused everywhere: left as it was, as DDP leaves ``.grad``)."""
        # A new tensor each time (no in-place add): the pieces' .grad are then pointed at it again.
        before = self.grad[b]
        self.grad[b] = mean_chunk.clone() if before is None else before + mean_chunk
        for i in self.buckets[b].indices:
            if counts[i]:
                self.used.add(i)
        for piece in self.pieces[b]:
            if piece.index in self.used:
                length = piece.stop - piece.start
                piece.tensor.grad = self.grad[b].narrow(0, piece.offset, length)

    def zero_grad(self) -> None:
        self.grad, self.used = [None] * len(self.buckets), set()
        for pieces in self.pieces:
            for piece in pieces:
                piece.tensor.grad = None
# --8<-- [end:shards]


# --8<-- [start:collective]
class ReduceScatterMean(BucketCollective):
    """Divided by N on the way in; one SUM reduce-scatter per bucket; this rank's chunk of the mean lands in
    its shard. ``frees_gradients`` (stage 2): no full-size gradient outlives the backward."""

    name = "reduce-scatter"

    def __init__(self, shards: Shards, divisor: int, frees_gradients: bool):
        self.shards = shards
        self.divisor = divisor  # the reducer divides each gradient by it on its way into the bucket: the mean
        self.frees_gradients = frees_gradients

    def issue(self, bucket, flat, is_last, group):
        size = self.shards.chunk[bucket.index]
        whole = self.shards.padded(bucket.index, flat)
        mine = torch.empty(size, dtype=whole.dtype, device=whole.device)
        work = dist.reduce_scatter(mine, list(whole.split(size)), group=group, async_op=True)  # a list of chunks
        future = torch.futures.Future()  # completed by a thread (gloo's Work has no future of its own)
        threading.Thread(target=lambda: (work.wait(), future.set_result(mine)), daemon=True).start()
        if self.frees_gradients and flat is bucket.buffer:  # the gradients are in the bucket: drop .grad now
            for param in bucket.params:
                param.grad = None
        return future

    def result(self, bucket, value) -> torch.Tensor:
        return value

    def land(self, bucket, result, counts, as_view) -> None:
        self.shards.land(bucket.index, result, counts)
        for param in bucket.params:  # the whole gradient is not this rank's to keep (stage 1: it was kept till now)
            param.grad = None
        if self.frees_gradients:
            bucket.buffer.untyped_storage().resize_(0)

    def land_joined(self, bucket, result, counts) -> None:  # a joined rank still owns its chunk: it steps it
        self.shards.land(bucket.index, result, counts)

    def dividing_by(self, n: int) -> ReduceScatterMean:
        return ReduceScatterMean(self.shards, n, self.frees_gradients)
# --8<-- [end:collective]
