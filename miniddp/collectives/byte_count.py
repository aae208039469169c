"""Counting the bytes handed to collectives: ``with count_bytes() as sent: loss.backward()``.

What
    ``all_reduce(tensor, group)`` is ``dist.all_reduce(..., async_op=True)`` as a future, with the
    tensor's bytes added to every open ``count_bytes()`` block (``sent.total``, ``sent.by_op``,
    ``sent.wire_bytes(world_size)``). miniddp's hooks, the reducer's bucket collective and used-counts and
    ZeRO's gradient shards issue through it; ``shard_collectives.py`` records its own.

Why
    Compression is about bytes on the wire: a benchmark or a test can read them per step.

How torch differs
    torch does not count bytes; its ``PowerSGDState.compression_stats()`` counts elements.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist


class ByteCount:
    """Payload bytes handed to collectives by miniddp's hooks (and the reducer's used-counts), by collective.

    Payload is the size of the tensors passed in. What one rank puts on the
    wire depends on the algorithm: a ring all-reduce sends 2(n-1)/n of its
    payload, a reduce-scatter (n-1)/n of its input, an all-gather n-1 times
    its input (``wire_bytes``).
    """

    def __init__(self):
        self.by_op: dict[str, int] = {}  # "all_reduce" -> bytes

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def wire_bytes(self, world_size: int) -> float:
        """Bytes one rank sends with ring algorithms (gloo and NCCL both use rings for large messages)."""
        factor = {"all_reduce": 2 * (world_size - 1) / world_size, "all_gather": world_size - 1,
                  "reduce_scatter": (world_size - 1) / world_size}
        return sum(n * factor.get(op.split()[0], 1) for op, n in self.by_op.items())


_counters: list[ByteCount] = []  # the open count_bytes() blocks of this process
_lock = threading.Lock()  # PowerSGD's second all-reduce is issued from a comm thread


@contextmanager
def count_bytes():
    """``with count_bytes() as sent: loss.backward()`` -> ``sent.total``, ``sent.by_op``."""
    counter = ByteCount()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def payload(tensor: torch.Tensor) -> int:
    """``tensor``'s bytes as a collective sends them: a sparse one's row indices and rows, not its dense size."""
    parts = (tensor._indices(), tensor._values()) if tensor.is_sparse else (tensor,)
    return sum(t.numel() * t.element_size() for t in parts)


def record(op: str, tensor: torch.Tensor) -> None:
    """Add ``tensor``'s bytes to every open ``count_bytes()``."""
    with _lock:
        for counter in _counters:
            counter.by_op[op] = counter.by_op.get(op, 0) + payload(tensor)


def all_reduce(tensor: torch.Tensor, group) -> torch.futures.Future:
    """``dist.all_reduce(tensor, async_op=True)`` as a future, counted."""
    record("all_reduce", tensor)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()

