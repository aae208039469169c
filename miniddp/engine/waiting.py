"""Waiting for the reducer's collectives, so that a stalled rank is named, not just timed out.

What
    ``wait(future, what, group)`` waits for one of the reducer's futures (a bucket's, or the used
    counts'). If the collective behind it times out or loses a peer, the error is a
    ``StalledRankError`` that names ``what`` ("all-reduce of bucket 2 in backward #7") and the
    ranks that never reached it (``process_group.stalled_ranks.naming_stalled_ranks``).

Why
    A rank stuck in its data loader or dead leaves the others blocked inside ``loss.backward()``;
    gloo's "Timed out waiting 1800000ms for recv" then names nobody. ``what`` must be the same
    string on every rank, which the backward count and the bucket index give.

How torch differs
    torch's reducer waits in C++ and reports the backend's error as it is; on NCCL the watchdog
    aborts the communicator (``ProcessGroupNCCL.cpp``), and ``TORCH_NCCL_DESYNC_DEBUG`` or the
    flight recorder explain the hang afterwards.
"""

from __future__ import annotations

from ..process_group.stalled_ranks import naming_stalled_ranks


def wait(future, what: str, group):
    """``future.wait()``, with a timeout turned into an error naming the ranks that never came."""
    with naming_stalled_ranks(what, group):
        return future.wait()
