"""ZeRO-2's bucket collective: each bucket reduce-scattered, each rank keeping only its shard of the mean.

What
    ``Shards`` cuts each of DDP's buckets into ``world_size`` equal chunks (the last padded with zeros): rank ``r``
    owns chunk ``r`` of every bucket, the gradient's *and* the parameters' elements there. A ``Piece`` is where a
    chunk meets one parameter: a view of that parameter's elements (what the optimizer steps) and, once a
    backward has landed, the same slice of the shard's averaged gradient (its ``.grad``).
    ``ReduceScatterMean`` is the reducer's collective (``engine/bucket_collective.py``): divided by N on the way
    into the bucket, one SUM reduce-scatter per bucket as soon as it is complete, in bucket order; ``land`` adds
    this rank's chunk of the mean into its shard (accumulating, as ``.grad`` does, until ``zero_grad``). With
    ``frees_gradients`` (stage 2), each ``.grad`` is dropped as its bucket goes out and the bucket's buffer gives
    its memory back once the result has landed (``BucketMemory``, an observer of the reducer, takes it again
    when the next backward starts). Under join it answers ``engine/ddp_join.py``'s ``JoinAware``: a joined
    rank still lands its chunk (``land_joined``), and the mean may be over the active ranks (``dividing_by``).
    ``PartlyHeld`` is the collective when ``ZeroOptimizer`` holds only some of DDP's parameters (another optimizer
    steps the rest): a bucket wholly held goes through ``ReduceScatterMean``, any other is all-reduced as under
    plain DDP, the rest's ``.grad`` set from the mean and the held pieces given their chunk of it.

Why
    After an all-reduce every rank holds the whole averaged gradient but steps only its shard of the optimizer
    (ZeRO-1): (N-1)/N of it is thrown away. A reduce-scatter moves half the bytes of an all-reduce and leaves
    each rank exactly the part it steps; an all-gather of the updated parameters is the other half
    (Rajbhandari et al., arXiv 1910.02054, section 5.2, "P_os+g").

How torch and DeepSpeed differ
    torch's DDP has no sharded gradients. DeepSpeed's stage 2 (``deepspeed/runtime/zero/stage_1_and_2.py``)
    partitions each param group's flat buffer in rank order and reduces its own gradient buckets into the owners'
    partitions. Here the partition *is* the bucket layout, so one reduce-scatter per bucket suffices; it is fixed
    when the optimizer attaches (the reducer does not rebuild the buckets afterwards). DeepSpeed's ZeRO reduces
    only the gradients of the parameters its optimizer holds; torch's ``ZeroRedundancyOptimizer`` sits beside DDP's
    all-reduce, so a second optimizer there sees averaged gradients, as it does here (``PartlyHeld``).
"""

from __future__ import annotations

import torch

from ..collectives.byte_count import all_reduce
from ..collectives.shard_collectives import reduce_scatter
from ..engine.bucket_collective import BucketCollective
from ..engine.observers import ReducerObserver


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
        ### BEGIN SOLUTION
        self.chunk = [-(-b.buffer.numel() // world_size) for b in buckets]  # ceil(numel / N): every rank's size
        ### END SOLUTION
        self.pieces = [self._cut(b, size) for b, size in zip(buckets, self.chunk)]
        self.grad: list[torch.Tensor | None] = [None] * len(buckets)  # this rank's averaged chunk, per bucket
        self.used: set[int] = set()  # parameters some rank had a gradient for since zero_grad

    def _cut(self, bucket, size: int) -> list[Piece]:
        """This rank's ``Piece``s of ``bucket``: elements ``[rank*size, (rank+1)*size)`` of its flat layout
        (``start``/``stop`` count in the parameter, ``offset`` in the chunk)."""
        ### BEGIN SOLUTION
        lo, hi = self.rank * size, (self.rank + 1) * size  # this rank's elements of the bucket's flat layout
        pieces, offset = [], 0
        for index, param in zip(bucket.indices, bucket.params):
            start, stop = max(lo, offset), min(hi, offset + param.numel())
            if start < stop:
                pieces.append(Piece(param, index, start - offset, stop - offset, start - lo))
            offset += param.numel()
        return pieces
        ### END SOLUTION

    def padded(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (bucket ``b``'s layout) with zeros up to ``world_size`` whole chunks."""
        ### BEGIN SOLUTION
        missing = self.chunk[b] * self.world_size - flat.numel()
        return flat if missing == 0 else torch.cat([flat, flat.new_zeros(missing)])
        ### END SOLUTION

    def land(self, b: int, mean_chunk: torch.Tensor, counts: list[int]) -> None:
        """Add this rank's chunk of bucket ``b``'s mean to its shard; a piece gets a ``.grad`` once some rank
        had its parameter's gradient (unused everywhere: left as it was, as DDP leaves ``.grad``)."""
        ### BEGIN SOLUTION
        if self.grad[b] is None:
            self.grad[b] = mean_chunk
        else:
            self.grad[b] += mean_chunk
        self.used.update(i for i in self.buckets[b].indices if counts[i] > 0)
        for piece in self.pieces[b]:
            if piece.index in self.used:
                piece.tensor.grad = self.grad[b][piece.offset : piece.offset + piece.stop - piece.start]
        ### END SOLUTION

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
        ### BEGIN SOLUTION
        self.shards, self.divisor, self.frees_gradients = shards, divisor, frees_gradients
        ### END SOLUTION

    def issue(self, bucket, flat, is_last, group):
        ### BEGIN SOLUTION
        chunk = flat.new_empty(self.shards.chunk[bucket.index])
        future = reduce_scatter(chunk, self.shards.padded(bucket.index, flat), group)
        ### END SOLUTION
        if self.frees_gradients and flat is bucket.buffer:  # the gradients are in the bucket: drop .grad now
            for param in bucket.params:
                param.grad = None
        return future

    def result(self, bucket, value) -> torch.Tensor:
        return value

    def land(self, bucket, result, counts, as_view) -> None:
        if result.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
            raise RuntimeError(f"bucket {bucket.index}'s reduce-scatter returned a view of the bucket, whose memory "
                               "stage 2 frees: the shard must be a tensor of its own (the collective's output)")
        self.shards.land(bucket.index, result, counts)
        for param in bucket.params:  # the whole gradient is not this rank's to keep (stage 1: it was kept till now)
            param.grad = None
        if self.frees_gradients:
            bucket.buffer.untyped_storage().resize_(0)

    # join's protocol (engine/ddp_join.JoinAware): a joined rank still owns its chunk, and steps it; the mean
    # may be over the ranks still active
    def land_joined(self, bucket, result, counts) -> None:
        self.shards.land(bucket.index, result, counts)

    def dividing_by(self, n: int) -> ReduceScatterMean:
        return ReduceScatterMean(self.shards, n, self.frees_gradients)
# --8<-- [end:collective]


# --8<-- [start:partly_held]
class PartlyHeld(BucketCollective):
    """ZeRO over part of DDP's parameters: a bucket whose every parameter ZeroOptimizer holds (``held``: reducer
    indices) is ``inner``'s (the reduce-scatter); any other is all-reduced, since the parameters another optimizer
    steps need the whole mean, as plain DDP gives it. Its held pieces take their chunk of that mean."""

    name = "reduce-scatter or all-reduce"  # which, per bucket: whether ZeroOptimizer holds all of it

    def __init__(self, inner: ReduceScatterMean, shards: Shards, held: set[int]):
        self.inner, self.shards, self.held = inner, shards, held
        self.divisor, self.call_order = inner.divisor, inner.call_order

    def whole(self, bucket) -> bool:
        return all(i in self.held for i in bucket.indices)

    def issue(self, bucket, flat, is_last, group):
        return self.inner.issue(bucket, flat, is_last, group) if self.whole(bucket) else all_reduce(flat, group)

    def result(self, bucket, value) -> torch.Tensor:
        return self.inner.result(bucket, value) if self.whole(bucket) else super().result(bucket, value)

    def land(self, bucket, result, counts, as_view) -> None:
        if self.whole(bucket):
            return self.inner.land(bucket, result, counts, as_view)
        bucket.write_back(result, [0 if i in self.held else c for i, c in enumerate(counts)], as_view)
        rest = [(p, p.grad) for i, p in zip(bucket.indices, bucket.params) if i not in self.held]
        self.inner.land(bucket, self._chunk(bucket, result), counts, as_view)  # drops every .grad (stage 2: frees)
        for param, grad in rest:  # ...but the rest's mean is theirs to keep, as under DDP
            param.grad = grad

    def land_joined(self, bucket, result, counts) -> None:
        self.inner.land_joined(bucket, result if self.whole(bucket) else self._chunk(bucket, result), counts)

    def _chunk(self, bucket, mean: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the bucket's whole mean: what the reduce-scatter would have given it."""
        size = self.shards.chunk[bucket.index]
        return self.shards.padded(bucket.index, mean)[self.shards.rank * size :][:size].clone()

    def dividing_by(self, n: int) -> PartlyHeld:
        return PartlyHeld(self.inner.dividing_by(n), self.shards, self.held)
# --8<-- [end:partly_held]


class BucketMemory(ReducerObserver):
    """Stage 2 freed each bucket's memory after the last backward; a synced backward that starts takes it back
    (the views into it stay valid), before any gradient is put in a bucket. The buckets must still be those
    the shards were cut from."""

    def __init__(self, reducer, shards: Shards):
        self.reducer, self.shards = reducer, shards

    def backward_started(self) -> None:
        if self.reducer.buckets is not self.shards.buckets:
            raise RuntimeError("DDP's buckets changed after ZeroOptimizer cut its shards from them (a rebuild or "
                               "load_layout_state): attach the optimizer after loading the layout")
        for bucket in self.shards.buckets:
            storage = bucket.buffer.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(bucket.nbytes)
