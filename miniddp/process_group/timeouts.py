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
    ("Timed out waiting 20000ms for recv") names nobody. Across hosts the store
    itself may be cut off: a TCPStore read across a dead link blocks until the
    kernel gives up on the connection (a timed-out wait sends a cancellation and
    reads its answer with no timeout), so the check-in runs in a thread, is given
    up after ``STORE_ANSWER_S``, and the error names the store's host instead.
"""

from __future__ import annotations

import math
import os
import socket
import threading
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
    if seconds < 0.001:  # gloo and NCCL count whole milliseconds: this would be a timeout of 0
        raise ValueError(f"{name}={timeout!r} is under a millisecond, which gloo and NCCL round to 0: "
                         f"give seconds, e.g. {name}=1800 (the default)")
    return timedelta(seconds=seconds)
# --8<-- [end:as_timedelta]


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


# Words in the errors gloo and NCCL raise when a peer is late, gone or cut off (a timeout, a closed
# socket, a route that vanished with a link: gloo's "Read error [10.0.0.2]:4242: No route to host").
_COMM_FAILURE = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "connection refused",
                 "no route to host", "network is unreachable", "read error", "write error")

#: Seconds the store may take, beyond the grace, to answer a failed rank's check-in. A store op
#: takes milliseconds; one that has not answered in seconds is on a host that is down or cut off,
#: where a TCPStore read blocks until the kernel gives up on the connection (15 min by default).
STORE_ANSWER_S = 5.0

_here_cache: dict = {}  # store host -> this process's "host at address", found while the network worked


def announce_process(group=None) -> None:
    """Write ``host:pid`` of this rank to the store, so an error elsewhere can point at it (``py-spy dump``).

    Across hosts, the host carries the address this rank reaches the store from
    (``node07 at 10.0.0.2``): the address to ``ping`` when a link goes down.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"miniddp/process/{dist.get_rank()}", f"{_here(store)}:{os.getpid()}")


def _here(store) -> str:
    """This host's name, and across hosts the address it reaches the store from: ``node07 at 10.0.0.2``."""
    peer = _store_address(store)[0]
    if peer not in _here_cache:  # once: when the link is down there is no route to find the address by
        address = _local_address(peer)
        _here_cache[peer] = socket.gethostname() + (f" at {address}" if address else "")
    return _here_cache[peer]


def _store_address(store) -> tuple[str | None, int | None]:
    """Where the job's store listens: the TCPStore under the prefixes, else MASTER_ADDR and MASTER_PORT."""
    while hasattr(store, "underlying_store"):  # PrefixStore(s) over the real one
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host:
        return host, port
    port = os.environ.get("MASTER_PORT")
    return os.environ.get("MASTER_ADDR"), int(port) if port and port.isdigit() else None


def _local_address(peer: str | None) -> str | None:
    """The address this machine reaches ``peer`` from (a UDP connect sends nothing); None on loopback."""
    if not peer:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "::1" else address


def _where(store, rank: int) -> str:
    try:
        key = f"miniddp/process/{rank}"
        if not store.check([key]):  # not announced: a get would wait for it until the store's timeout
            return f"rank {rank}"
        host, pid = store.get(key).decode().rsplit(":", 1)
        return f"rank {rank} (pid {pid} on {host})"
    except Exception:  # the store is gone with its host
        return f"rank {rank}"


def _check_in(store, what: str, ranks: list[int], me: int, grace: float) -> dict:
    """Post "I was waiting in ``what``", give the others ``grace`` s to do the same, and read who did.

    Every store operation of the check-in is here, so that the caller can give up on all of them
    at once when the store does not answer.
    """
    store.set(f"stall/{what}/{me}", repr(time.time()))
    store.set(f"stall-in/{me}", what)  # for a rank that failed in another collective than ours
    deadline = time.monotonic() + grace
    while True:
        missing = [r for r in ranks if not store.check([f"stall/{what}/{r}"])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    posted = {r: float(store.get(f"stall/{what}/{r}")) for r in ranks if r not in missing}
    elsewhere = {r: store.get(f"stall-in/{r}").decode() for r in missing if store.check([f"stall-in/{r}"])}
    first = min(posted.values())
    late = [r for r, t in posted.items() if t - first > grace / 2]  # came after the others gave up
    absent = [r for r in missing if r not in elsewhere]
    return {"absent": absent, "elsewhere": elsewhere, "posted": posted, "late": late, "first": first,
            "where": {r: _where(store, r) for r in absent + late}}


def _unreachable_store(store, what: str, me: int, waited: float, problem) -> str:
    """The message when the store itself cannot be reached: it names the store's host, the peer cut off."""
    host, port = _store_address(store)
    store_at = f"{host}:{port}" if host else "the job's store"
    if problem is None:
        how = (f"did not answer within {waited:.0f} s: that host is down or unreachable from this one "
               "(a cable, switch or firewall between them)")
    else:
        how = (f"failed ({type(problem).__name__}: {' '.join(str(problem).split())[:200]}): "
               "its host, or the launcher that served it, is gone")
    return (f"rank {me} on {_here(store)}: the {what} failed, and the store at {store_at} (the job's rendezvous "
            f"host, where rank 0 runs) {how}. Check that host, and the network from here (`ping {host}`)")


# --8<-- [start:naming_stalled_ranks]
@contextmanager
def naming_stalled_ranks(what: str, group=None, grace: float = 2.0):
    """Turn a collective's timeout or lost peer into ``StalledRankError`` naming the ranks that never came.

    ``what`` names the collective and must be the same string on every rank
    (e.g. "bucket all-reduce of backward #12"). A rank whose collective failed
    writes the time to ``stall/<what>/<rank>``, then gives the others ``grace``
    seconds to do the same: whoever has not written by then was not waiting in
    this collective (stalled elsewhere, dead or cut off; or failed in another
    collective, which it says); whoever wrote much later than the first was the
    slow one; if all wrote at once, the transport failed. The store may be on a
    host that is down or cut off, where its reads block: the check-in runs in a
    thread, and when it has not answered ``STORE_ANSWER_S`` after the grace, the
    error names the store's host as unreachable instead of hanging.
    """
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, StalledRankError) or not any(w in str(err).lower() for w in _COMM_FAILURE):
            raise
        store = dist.distributed_c10d._get_default_store()
        ranks, me = dist.get_process_group_ranks(group or dist.group.WORLD), dist.get_rank()
        answer: dict = {}

        def check_in():
            try:
                answer.update(_check_in(store, what, ranks, me, grace))
            except Exception as problem:  # the store's server died with its host or launcher
                answer["problem"] = problem

        start = time.monotonic()
        thread = threading.Thread(target=check_in, name="miniddp-check-in", daemon=True)
        thread.start()
        thread.join(grace + STORE_ANSWER_S)  # never wait for good on a store across a dead link
        if thread.is_alive() or "problem" in answer:
            message = _unreachable_store(store, what, me, time.monotonic() - start, answer.get("problem"))
            raise StalledRankError(f"{message}; the original error follows.\n{err}", []) from err
        absent, elsewhere, posted, late, where = (answer[k] for k in ("absent", "elsewhere", "posted", "late", "where"))
        others = "".join(f"; rank {r} was waiting in the {w}" for r, w in sorted(elsewhere.items()))
        if absent:
            here = _here(store)
            away = "" if any(where[r].endswith(f" on {here})") or "(pid" not in where[r] for r in absent) else (
                f" (or cut off by the network from this host, {here})")
            message = (f"{', '.join(where[r] for r in absent)} never reached the {what}: stalled in other code, or "
                       f"dead{away}. Ranks {sorted(posted)} were waiting{others}. Look at what it was doing "
                       "(`py-spy dump --pid PID` on its host, its log)")
        elif late:
            message = (f"{', '.join(where[r] for r in late)} reached the {what} "
                       f"{max(posted[r] for r in late) - answer['first']:.1f} s after the other ranks had given up "
                       "waiting: it was the slow one (a long save, evaluation or data loading on that rank alone?)")
        elif elsewhere:  # every rank was in a collective when it failed, but not all in the same one
            message = (f"every rank was waiting in a collective and they failed together: ranks {sorted(posted)} in "
                       f"the {what}{others}. The network or the backend failed, not a stalled rank (unless the "
                       "ranks issue collectives in different orders: MINIDDP_DEBUG=collectives)")
        else:  # everyone was there at once: the transport failed, not a rank
            message = (f"every rank was waiting in the {what} and it still failed: the network or the backend, "
                       "not a stalled rank (NCCL_DEBUG=INFO; the interfaces: GLOO/NCCL_SOCKET_IFNAME)")
        raise StalledRankError(f"{message}; the original error follows.\n{err}", absent or late) from err
# --8<-- [end:naming_stalled_ranks]
