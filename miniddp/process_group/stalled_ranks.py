"""Naming stalled ranks: after a collective failed, who never came to it.

What
    ``with naming_stalled_ranks("all-reduce of bucket 0 in backward #12"):`` around a
    collective turns its failure (a timeout, a lost peer) into ``StalledRankError``: the ranks
    whose collective failed check in through the store, and those that never do are the
    stalled or dead ones; one that checks in much later was the slow one; if all came at
    once, the transport failed. A store that stops answering is named instead of waited for.
    Any ``RuntimeError`` from the block counts (it wraps nothing but communication), except
    miniddp's own verdicts and this rank's own out-of-memory or device errors.

Why
    gloo's "Timed out waiting 20000ms for recv" is raised on the rank that waited and names
    nobody; the one to look at is the rank that was not there.

How torch differs
    torch names no rank after the fact: gloo raises a plain ``RuntimeError`` for a timeout, a
    closed connection and a dead peer alike, NCCL a ``DistBackendError`` (or the watchdog
    aborts the process); ``TORCH_NCCL_DESYNC_DEBUG`` and the flight recorder report which
    ranks had not joined a collective, for NCCL only.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .desync import CollectiveMismatchError
from .process_info import announced, describe, store_address, this_host


class StalledRankError(RuntimeError):
    """A barrier or a collective failed waiting for ranks; ``.missing`` holds the ranks to look at."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing  # global ranks to look at: those that never arrived (else the late ones)


#: Seconds the store may take, beyond the grace, to answer a failed rank's check-in. A store op
#: takes milliseconds; one that has not answered in seconds is on a host that is down or cut off,
#: where a TCPStore read blocks until the kernel gives up on the connection (15 min by default).
STORE_ANSWER_S = 5.0

# A failed collective reaches us as a RuntimeError: from gloo a plain one, for a timeout, a closed
# connection and a dead peer alike; from NCCL a DistBackendError; from the store a DistStoreError.
# The block wraps communication only, so any RuntimeError sends this rank to the check-in, which
# finds out who was missing. Not these: our own verdicts name the ranks already, and the others
# are this rank's own failures, by their type.
_NOT_A_PEER = (StalledRankError, CollectiveMismatchError, torch.OutOfMemoryError, torch.AcceleratorError)


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
            "where": {r: announced(store, r) for r in absent + late}}


def _check_in_or_give_up(store, what: str, ranks: list[int], me: int, grace: float) -> dict:
    """``_check_in`` in a thread, given up ``STORE_ANSWER_S`` after the grace: ``{"problem": ...}`` then."""
    answer: dict = {}

    def check_in():
        try:
            answer.update(_check_in(store, what, ranks, me, grace))
        except Exception as problem:  # the store's server died with its host or launcher
            answer["problem"] = problem

    thread = threading.Thread(target=check_in, name="miniddp-check-in", daemon=True)
    thread.start()
    thread.join(grace + STORE_ANSWER_S)  # never wait for good on a store across a dead link
    return {"problem": None} if thread.is_alive() else answer


def _unreachable_store(store, what: str, me: int, waited: float, problem) -> str:
    """The message when the store itself cannot be reached: it names the store's host, the peer cut off."""
    host, port = store_address(store)
    store_at = f"{host}:{port}" if host else "the job's store"
    if problem is None:
        how = (f"did not answer within {waited:.0f} s: that host is down or unreachable from this one "
               "(a cable, switch or firewall between them)")
    else:
        how = (f"failed ({type(problem).__name__}: {' '.join(str(problem).split())[:200]}): "
               "its host, or the launcher that served it, is gone")
    return (f"rank {me} on {this_host(store)}: the {what} failed, and the store at {store_at} (the job's rendezvous "
            f"host, where rank 0 runs) {how}. Check that host, and the network from here (`ping {host}`)")


def _verdict(answer: dict, what: str, here: str) -> str:
    """Who was missing, late, or elsewhere, as read by the check-in."""
    absent, elsewhere, posted, late, where = (answer[k] for k in ("absent", "elsewhere", "posted", "late", "where"))
    others = "".join(f"; rank {r} was waiting in the {w}" for r, w in sorted(elsewhere.items()))
    if absent:
        on_another_host = all(where[r] is not None and where[r][0] != here for r in absent)
        away = f" (or cut off by the network from this host, {here})" if on_another_host else ""
        return (f"{', '.join(describe(r, where[r]) for r in absent)} never reached the {what}: stalled in other code, "
                f"or dead{away}. Ranks {sorted(posted)} were waiting{others}. Look at what it was doing "
                "(`py-spy dump --pid PID` on its host, its log)")
    if late:
        return (f"{', '.join(describe(r, where[r]) for r in late)} reached the {what} "
                f"{max(posted[r] for r in late) - answer['first']:.1f} s after the other ranks had given up "
                "waiting: it was the slow one (a long save, evaluation or data loading on that rank alone?)")
    if elsewhere:  # every rank was in a collective when it failed, but not all in the same one
        return (f"every rank was waiting in a collective and they failed together: ranks {sorted(posted)} in "
                f"the {what}{others}. The network or the backend failed, not a stalled rank (unless the "
                "ranks issue collectives in different orders: MINIDDP_DEBUG=collectives)")
    return (f"every rank was waiting in the {what} and it still failed: the network or the backend, "  # all at once
            "not a stalled rank (NCCL_DEBUG=INFO; the interfaces: GLOO/NCCL_SOCKET_IFNAME)")


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
    host that is down or cut off, where its reads block: when the check-in has
    not answered ``STORE_ANSWER_S`` after the grace, the error names the store's
    host as unreachable instead of hanging.
    """
    try:
        yield
    except _NOT_A_PEER:
        raise
    except RuntimeError as err:  # the transport's error, whatever its words: see _NOT_A_PEER
        store = dist.distributed_c10d._get_default_store()
        ranks, me = dist.get_process_group_ranks(group or dist.group.WORLD), dist.get_rank()
        start = time.monotonic()
        answer = _check_in_or_give_up(store, what, ranks, me, grace)
        if "problem" in answer:
            message = _unreachable_store(store, what, me, time.monotonic() - start, answer["problem"])
            raise StalledRankError(f"{message}; the original error follows.\n{err}", []) from err
        message, named = _verdict(answer, what, this_host(store)), answer["absent"] or answer["late"]
        raise StalledRankError(f"{message}; the original error follows.\n{err}", named) from err
# --8<-- [end:naming_stalled_ranks]
