"""Timeouts: how long a rank waits for the others before it gives up.

What
    ``as_timedelta`` validates Hugging Face's ``ddp_timeout`` (seconds, default
    1800) and turns it into the ``timedelta`` that ``init_process_group`` takes;
    ``monitored_barrier`` is a barrier that, when it times out, says *which*
    ranks never arrived; ``nccl_watchdog_env`` spells out the environment that
    makes NCCL raise instead of hanging.

Why
    Every collective is a rendezvous: if one rank is slow (loading a big model,
    writing a checkpoint, stuck in a data loader) or dead, the others block inside
    ``all_reduce``. Without a timeout that is a silent hang that burns a whole
    allocation; with one it is an error, but usually on the *waiting* rank, whose
    message says little about the culprit. Naming the missing rank is the fix.

How torch differs
    ``init_process_group(timeout=...)`` defaults to 30 min for gloo and 10 min for
    NCCL (``torch/distributed/constants.py``); Transformers passes ``ddp_timeout``
    (1800 s) to it. On gloo a blocked collective raises on the waiting rank
    ("Timed out waiting 3000ms for recv"). On NCCL a collective returns at once
    and the *watchdog* thread aborts the communicator after the timeout
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), tearing the process down, unless
    ``TORCH_NCCL_BLOCKING_WAIT=1`` makes ``wait()`` raise instead
    (``ProcessGroupNCCL.cpp``). ``torch.distributed.monitored_barrier`` exists but
    is gloo-only and only rank 0 learns who is missing; ours uses the process
    group's key-value store, so every rank can name the missing ones, on any backend.
    ``naming_stalled_ranks`` does the same *after* a collective failed: the
    ranks whose collective timed out (or lost a peer) check in through the store,
    and those that never do are the stalled or dead ones. torch's gloo error
    ("Timed out waiting 20000ms for recv") names nobody.
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

#: Hugging Face's default ``ddp_timeout``: 30 minutes.
DEFAULT_TIMEOUT_S = 1800


class StalledRankError(RuntimeError):
    """A barrier timed out; ``.missing`` holds the ranks that never arrived."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing  # global ranks to look at: those that never arrived (else the late ones)


# --8<-- [start:as_timedelta]
def as_timedelta(timeout, name: str = "ddp_timeout") -> timedelta:
    """``timeout`` in seconds (int/float) or a ``timedelta`` -> a positive ``timedelta``."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, got {timeout!r}")
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name}={timeout!r} is not a finite number of seconds; use e.g. {name}=1800")
    if seconds <= 0:
        raise ValueError(
            f"{name}={timeout!r} must be > 0 seconds (default {DEFAULT_TIMEOUT_S}); "
            "a rank waits this long for its peers before raising"
        )
    return timedelta(seconds=seconds)
# --8<-- [end:as_timedelta]


def init_process_group(backend: str, timeout=DEFAULT_TIMEOUT_S, **kwargs) -> None:
    """``torch.distributed.init_process_group`` with a validated ``ddp_timeout``."""
    dist.init_process_group(backend=backend, timeout=as_timedelta(timeout), **kwargs)


def nccl_watchdog_env(blocking_wait: bool = False) -> dict[str, str]:
    """Environment variables that turn an NCCL hang into an error (set before init).

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: the watchdog aborts the communicator and
    the process when a collective exceeds the timeout (3, torch's default since
    2.2, does the same without the clean-up). ``TORCH_NCCL_BLOCKING_WAIT=1``: a
    ``work.wait()`` blocks and raises ``DistBackendError`` in Python instead, which
    a test or a retry loop can catch.
    """
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if blocking_wait:
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    return env


_barrier_calls = 0  # how many monitored barriers this process has entered (keys are per call)


# --8<-- [start:monitored_barrier]
def monitored_barrier(timeout=60, store=None, group=None) -> None:
    """Wait until every rank arrives, or raise ``StalledRankError`` naming the absent ones.

    Each rank writes ``mb/<call>/<rank>`` to the store and waits for all the others'
    keys. On timeout it checks which keys are missing: those ranks are the stalled
    ones, and every rank that timed out can say so (torch's gloo-only version
    tells only rank 0). It also marks the call failed, so that a latecomer
    raises too instead of sailing through a barrier the others gave up on.
    """
    global _barrier_calls
    _barrier_calls += 1
    deadline = as_timedelta(timeout, name="timeout")
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = dist.get_rank()
    prefix = f"mb/{_barrier_calls}"
    store.set(f"{prefix}/{me}", "arrived")
    start = time.monotonic()
    try:
        store.wait([f"{prefix}/{r}" for r in ranks], deadline)
    except RuntimeError:  # the store's wait raises on timeout (DistStoreError)
        missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
        if not missing:  # the last one arrived just as we gave up: that is a pass
            return
        store.set(f"{prefix}/failed", ",".join(map(str, missing)))
        waited = time.monotonic() - start
        raise StalledRankError(
            f"rank {me}: rank(s) {missing} did not reach the barrier within {waited:.1f} s "
            f"(timeout {deadline.total_seconds():g} s). Look at what those ranks were doing: "
            "a slow load or save, a data loader stall, an exception, or a branch only some ranks take.",
            missing,
        ) from None
    if store.check([f"{prefix}/failed"]):
        missing = [int(r) for r in store.get(f"{prefix}/failed").decode().split(",") if r]
        raise StalledRankError(
            f"rank {me} reached the barrier late: the other ranks gave up waiting for rank(s) {missing}",
            missing,
        )
# --8<-- [end:monitored_barrier]


# Words in the errors gloo and NCCL raise when a peer is late or gone (a timeout, a closed socket).
_COMM_FAILURE = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def announce_process(group=None) -> None:
    """Write ``host:pid`` of this rank to the store, so an error elsewhere can point at it (``py-spy dump``)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"miniddp/process/{dist.get_rank()}", f"{socket.gethostname()}:{os.getpid()}")


def _where(store, rank: int) -> str:
    try:
        host, pid = store.get(f"miniddp/process/{rank}").decode().rsplit(":", 1)
        return f"rank {rank} (pid {pid} on {host})"
    except Exception:  # not announced, or the store is gone with its host
        return f"rank {rank}"


# --8<-- [start:naming_stalled_ranks]
@contextmanager
def naming_stalled_ranks(what: str, group=None, grace: float = 2.0):
    """Turn a collective's timeout or lost peer into ``StalledRankError`` naming the ranks that never came.

    ``what`` names the collective and must be the same string on every rank
    (e.g. "bucket all-reduce of backward #12"). A rank whose collective failed
    writes the time to ``stall/<what>/<rank>``, then gives the others ``grace``
    seconds to do the same: whoever has not written by then was not waiting in
    this collective (stalled elsewhere, or dead); whoever wrote much later than
    the first was the slow one; if all wrote at once, the transport failed.
    """
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, StalledRankError) or not any(w in str(err).lower() for w in _COMM_FAILURE):
            raise
        try:
            store = dist.distributed_c10d._get_default_store()
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            store.set(f"stall/{what}/{dist.get_rank()}", repr(time.time()))
            deadline = time.monotonic() + grace
            while True:
                missing = [r for r in ranks if not store.check([f"stall/{what}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            posted = {r: float(store.get(f"stall/{what}/{r}")) for r in ranks if r not in missing}
        except Exception:  # the store is unreachable (its host died): keep the original error
            raise err from None
        first = min(posted.values())
        late = [r for r, t in posted.items() if t - first > grace / 2]  # came after the others gave up
        if missing:
            names = ", ".join(_where(store, r) for r in missing)
            message = (f"{names} never reached the {what}: stalled in other code, or dead. Ranks {sorted(posted)} "
                       "were waiting. Look at what it was doing (`py-spy dump --pid PID` on its host, its log)")
        elif late:
            message = (f"{', '.join(_where(store, r) for r in late)} reached the {what} "
                       f"{max(posted[r] for r in late) - first:.1f} s after the other ranks had given up waiting: "
                       "it was the slow one (a long save, evaluation or data loading on that rank alone?)")
        else:  # everyone was there at once: the transport failed, not a rank
            message = (f"every rank was waiting in the {what} and it still failed: the network or the backend, "
                       "not a stalled rank (NCCL_DEBUG=INFO; the interfaces: GLOO/NCCL_SOCKET_IFNAME)")
        raise StalledRankError(f"{message}; the original error follows.\n{err}", missing or late) from err
# --8<-- [end:naming_stalled_ranks]
