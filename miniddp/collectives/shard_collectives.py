"""ZeRO's two collectives, a reduce-scatter and an all-gather, each sending (N-1)/N of a bucket, counted.

What
    ``reduce_scatter(output, input, group)``: ``input`` is ``world_size`` equal chunks; rank r's ``output`` is the
    sum over ranks of their chunk r; returns a future of ``output``. ``all_gather(output, input, group)``: every
    rank's ``input`` concatenated into ``output``; returns something to ``wait()`` on. Both add their payload to
    ``count_bytes()`` (``byte_count.py``), as does ``broadcast`` (a parameter outside the buckets, owned whole).
    On gloo (the desync detector's checked gloo too: ``backend_name``) they are direct point-to-point exchanges:
    every rank sends chunk j to rank j (and receives its own chunk from every rank), or its chunk to every rank,
    all posted at once with ``dist.batch_isend_irecv``; one thread per process waits for the receives and completes
    the futures, in order.
    Each message is cut into segments of at most ``SEGMENT_BYTES`` (both ends cut a tensor alike, so they pair up
    in order). On NCCL and others, torch's ``reduce_scatter_single`` / ``all_gather_single``.

Why
    ZeRO's promise is that a reduce-scatter plus an all-gather cost what one all-reduce costs: (N-1)/N of the bucket
    each, per rank. gloo's own ``reduce_scatter`` sends an all-reduce's bytes (it reduces everything, then keeps a
    chunk) and its ``Work`` has no future; the direct exchange sends (N-1)/N and each rank adds only its own chunk.
    Same bytes per rank as a ring; N-1 messages per rank at once rather than N-1 steps in sequence, so nothing waits
    on a previous step. Segments: one large message each way at once may take twice the line rate's time on a slow
    link, where messages cut as gloo's ring all-reduce cuts its own take the line rate's time every time (measured
    in ``docs/performance.md``, "ZeRO against DDP", with ``benchmarks/zero_collectives.py``).

How torch differs
    ``torch.distributed.reduce_scatter_tensor`` on gloo (``ProcessGroupGloo``) is what we avoid here; NCCL's ring
    reduce-scatter and all-gather are bandwidth-optimal and used as they are. DeepSpeed calls
    ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (``deepspeed/comm``), on NCCL in practice.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.distributed as dist

from ..process_group.debug_backend import backend_name
from .byte_count import record

SEGMENT_BYTES = 512 * 1024  # the largest message the direct exchanges post


def _segments(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor`` (contiguous) as consecutive flat views of at most ``SEGMENT_BYTES``: a send and its receive, cut
    alike, pair up segment by segment."""
    return tensor.view(-1).split(max(1, SEGMENT_BYTES // tensor.element_size()))


def _exchange(send: torch.Tensor, to: int, receive: torch.Tensor, source: int, group) -> list:
    """The ``P2POp``s that send ``send`` to ``to`` and receive ``receive`` from ``source``, segment by segment."""
    return ([dist.P2POp(dist.isend, part, to, group) for part in _segments(send)]
            + [dist.P2POp(dist.irecv, part, source, group) for part in _segments(receive)])


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> torch.futures.Future:
    """Rank r's ``output`` = the sum over ranks of chunk r of their ``input``; a future of ``output``, counted."""
    record("reduce_scatter", input)
    if backend_name(group) != "gloo":
        return _reduce_scatter_single(output, input, group=group, async_op=True).get_future().then(lambda _: output)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks, received = input.view(n, -1), input.new_empty(max(n - 1, 0), output.numel())
    ops = []
    for k in range(1, n):  # to rank + k its chunk, from rank - k our chunk (every pair's messages in one order)
        ops += _exchange(chunks[(rank + k) % n], _peer(group, (rank + k) % n), received[k - 1],
                         _peer(group, (rank - k) % n), group)
    works = dist.batch_isend_irecv(ops) if ops else []
    mine = chunks[rank]
    future = torch.futures.Future()

    def complete():
        try:
            for work in works:
                work.wait()
            output.copy_(mine)
            for part in received:  # in place: no (N-1)/N-sized stack beside the received chunks
                output.add_(part)
        except Exception as error:  # a peer failed or timed out: whoever waits on the future sees it
            future.set_exception(error)
        else:
            future.set_result(output)
    _completer().put(complete)
    return future


_queue: tuple[int, queue.SimpleQueue] | None = None  # (pid, queue): one thread per process completes them all


def _completer() -> queue.SimpleQueue:
    """The queue of one long-lived thread that completes every reduce-scatter, in the order they were posted
    (the order their messages arrive in): starting a thread per call cost more than some exchanges. A forked
    child gets its own (the parent's thread is not in it). It is not a daemon: it ends once the main thread has
    ended and nothing is queued, so interpreter shutdown waits for a future it is still completing (a daemon thread
    that wakes during shutdown is ended inside torch's C++ code: SIGABRT at exit)."""
    global _queue
    if _queue is None or _queue[0] != os.getpid():
        jobs = queue.SimpleQueue()
        main = threading.main_thread()

        def serve():
            while True:
                try:
                    job = jobs.get(timeout=0.1)
                except queue.Empty:
                    if not main.is_alive():  # the script has ended and nothing is left to complete
                        return
                    continue
                job()
        threading.Thread(target=serve, daemon=False, name="reduce-scatter completer").start()
        _queue = (os.getpid(), jobs)
    return _queue[1]


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def all_gather(output: torch.Tensor, input: torch.Tensor, group):
    """``input`` from every rank, concatenated into ``output``; returns what to ``wait()`` on, counted."""
    record("all_gather", input)
    if backend_name(group) != "gloo":
        return _all_gather_single(output, input, group=group, async_op=True)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = output.view(n, -1)
    slots[rank].copy_(input)
    ops = []
    for k in range(1, n):
        to, source = _peer(group, (rank + k) % n), _peer(group, (rank - k) % n)
        ops += _exchange(input, to, slots[(rank - k) % n], source, group)
    return _Works(dist.batch_isend_irecv(ops) if ops else [])


def broadcast(tensor: torch.Tensor, source: int, group):
    """``tensor`` from global rank ``source`` into every rank's (a parameter ZeRO owns whole); returns what to
    ``wait()`` on, counted."""
    record("broadcast", tensor)
    return dist.broadcast(tensor, source, group=group, async_op=True)


def all_gather_pieces(pieces_by_rank: list[list], chunk: int, like: torch.Tensor, group):
    """One bucket's parameters from their owners: ``pieces_by_rank[r]`` are rank r's pieces of the bucket (each with
    ``.tensor``, a view of a parameter, and ``.offset`` in the chunk of ``chunk`` elements); after ``wait()`` every
    piece holds its owner's values. gloo: each piece sent straight from the owner's parameter into the others'
    (no flat copy on either side); elsewhere one ``all_gather`` of the chunks, copied into the pieces."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if backend_name(group) != "gloo":
        mine = like.new_zeros(chunk)
        for piece in pieces_by_rank[rank]:
            mine[piece.offset : piece.offset + piece.tensor.numel()] = piece.tensor
        gathered = like.new_empty(chunk * n)
        return _Landing(all_gather(gathered, mine, group), gathered.view(n, chunk), pieces_by_rank, rank)
    record("all_gather", like.new_empty(1).expand(chunk))  # counted as a chunk, sent from the pieces
    ops = []
    for k in range(1, n):  # every pair's messages in one order: the owner's pieces, in piece order
        to, source = (rank + k) % n, (rank - k) % n
        ops += [dist.P2POp(dist.isend, part, _peer(group, to), group)
                for piece in pieces_by_rank[rank] for part in _segments(piece.tensor)]
        ops += [dist.P2POp(dist.irecv, part, _peer(group, source), group)
                for piece in pieces_by_rank[source] for part in _segments(piece.tensor)]
    return _Works(dist.batch_isend_irecv(ops) if ops else [])


class _Landing:
    def __init__(self, work, rows, pieces_by_rank, rank):
        self.work, self.rows, self.pieces_by_rank, self.rank = work, rows, pieces_by_rank, rank

    def wait(self) -> bool:
        self.work.wait()
        with torch.no_grad():
            for r, pieces in enumerate(self.pieces_by_rank):
                for piece in pieces if r != self.rank else ():
                    piece.tensor.copy_(self.rows[r][piece.offset : piece.offset + piece.tensor.numel()])
        return True


def _peer(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)  # P2POp wants the global rank


# torch 2.13's names (the older ``*_tensor`` ones warn that they are deprecated)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
