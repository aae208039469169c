"""Run a function on N ranks on this machine: what every test, notebook and ``notebook_launcher`` stands on.

What
    ``run_on_ranks(fn, world_size, args=(...), kwargs={...})`` starts ``world_size`` processes,
    joins them into one process group, calls ``fn(rank, world_size, *args, **kwargs)`` in each
    (``rank_process.run_rank``) and returns their return values in rank order. A rank
    that raises makes the parent raise ``RankError`` (its rank, its traceback, and as
    ``__cause__`` the original exception, and what became of the others: raised, exited, killed,
    or returned normally before it failed); a rank that hangs is killed at ``timeout`` and the
    parent raises ``RankTimeout`` naming it and where each hung rank was (its Python stack, dumped
    by ``faulthandler`` on a signal just before the kill). The harness's own options are
    keyword-only: a misspelt one is a ``TypeError``, and ``fn`` may take any keyword through ``kwargs=``.

Why
    Distributed bugs live *between* processes, so the tests run real processes that fail like
    ordinary tests: quickly, with the right traceback, never hanging CI, never fighting over a
    port under pytest-xdist (the parent's ``TCPStore`` listens on port 0), never leaving a
    process behind. Ranks fork from a ``forkserver`` that has imported torch once: fork's speed
    without the parent's threads and locks (``docs/testing.md`` has the measurements); notebooks
    pass ``start_method="fork"``, as their functions cannot be pickled by name.

How torch differs
    torch's own tests (``torch/testing/_internal/common_distributed.py``, ``MultiProcessTestCase``)
    use a FileStore per test, pipe each child's traceback to the parent and skip with an exit
    code when there are too few GPUs; this is the same idea as one function call. Their timeout
    says which child hung, not where.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import wait

import torch.distributed as dist

from .rank_process import kill_group, read_stacks, run_rank, where

_deadline: float | None = None  # set_call_deadline: every call ends by then (a caller's own bound)

DEFAULT_TIMEOUT_S = 120.0  # a whole multi-rank call; tests pass smaller ones
# What the forkserver imports once. torch._dynamo is imported lazily by torch DDP's first
# construction, at a cost of seconds per fresh process: preloading it keeps every oracle test fast.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "miniddp"]
# ...and, when the caller has them, what a test module imports: a rank unpickles ``fn`` by importing its
# module, so without these every rank of every test paid ~0.2 s of CPU to import pytest and Hypothesis.
_PRELOAD_IF_IMPORTED = ["pytest", "hypothesis"]


class RankError(RuntimeError):
    """A rank raised. ``.rank``, ``.remote_traceback``, ``.others``, ``.stacks``; ``__cause__`` is the original."""

    def __init__(self, rank: int, exc_type: str, remote_traceback: str, others=(), stacks=None):
        also = f" ({'; '.join(f'rank {r}: {what}' for r, what in others)})" if others else ""
        super().__init__(f"rank {rank} raised {exc_type}{also}:\n{remote_traceback}")  # last line: the exception
        self.rank = rank  # which rank failed first
        self.exc_type = exc_type  # the name of its exception class
        self.remote_traceback = remote_traceback  # formatted in the child
        self.others = list(others)  # (rank, what became of it) for the other ranks that did not finish
        self.stacks = dict(stacks or {})  # rank -> its Python stack when killed after the grace


class RankTimeout(RankError, TimeoutError):
    """Ranks did not finish within the harness timeout and were killed. ``.ranks``, ``.timeout``, and
    ``.stacks``: rank -> where it was (its main thread's Python stack, innermost first)."""

    def __init__(self, ranks: list[int], timeout: float, stacks=None):
        self.stacks = dict(stacks or {})
        lines = [f"rank(s) {ranks} did not finish within {timeout:g} s and were killed"]
        if self.stacks:
            lines[0] += "; where each was (innermost first):"
            lines += [where(rank, self.stacks.get(rank, "")) for rank in ranks]
        RuntimeError.__init__(self, "\n".join(lines))
        self.rank, self.ranks, self.exc_type, self.remote_traceback = ranks[0], ranks, "RankTimeout", ""
        self.timeout, self.others = timeout, []


def set_call_deadline(deadline: float | None) -> None:
    """Make every ``run_on_ranks`` call end by ``deadline`` (``time.monotonic()``), or lift it (None).

    For a caller that bounds a whole test, as ``miniddp exercise check`` bounds each spec item: a
    call still running then raises ``RankTimeout`` with the ranks' stacks, before the caller's own
    timeout would stop the test without them."""
    global _deadline
    _deadline = deadline


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        preload = _PRELOAD + [m for m in _PRELOAD_IF_IMPORTED if m in sys.modules]
        ctx.set_forkserver_preload(preload)  # no effect once the server runs
    return ctx


# --8<-- [start:run_on_ranks]
def run_on_ranks(fn, world_size: int, *, args=(), kwargs=None, backend: str = "gloo",
                 timeout: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver", init: bool = True,
                 pg_timeout: float | None = None, grace: float = 3.0) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    ``init=True`` joins the ranks into a process group on ``backend`` before
    calling ``fn``; ``init=False`` only sets torchrun's environment variables
    (``RANK``, ``MASTER_PORT``...) so ``fn`` can test its own initialisation.
    ``timeout`` bounds the whole call; ``pg_timeout`` (default: ``timeout``) is
    the process group's own collective timeout. When a rank fails, the others
    get ``grace`` seconds to finish or fail too, then are killed. When the call
    returns or raises, no process it started, nor any they started, is left.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args= must be a tuple or list of fn's positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs= must be a dict of fn's keyword arguments, got {type(kwargs).__name__}")
    started = time.monotonic()
    ctx = _context(start_method)
    pg_timeout = datetime.timedelta(seconds=pg_timeout or timeout)
    lifeline, lifeline_w = ctx.Pipe(duplex=False)  # the write end never leaves this process
    inherited = lifeline_w if start_method == "fork" else None  # ...except as a copy fork makes
    store = None
    procs, conns = [], {}
    results, errors, returned = [None] * world_size, [], {}  # returned: rank -> when its result came
    dumps = tempfile.mkdtemp(prefix="miniddp-stacks-")  # where a rank writes its stack when asked
    files = [os.path.join(dumps, f"{rank}.txt") for rank in range(world_size)]
    finished = False  # every rank reported success
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=run_rank, name=f"rank{rank}", args=(
                rank, world_size, fn, tuple(args), kwargs or {}, child_end, lifeline, inherited,
                "127.0.0.1", backend, init, pg_timeout, files[rank]))
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        lifeline.close()  # the ranks hold their copies
        # The store's server thread starts only now, after the last fork: a fork taken while that
        # thread held a libc lock (getnameinfo's resolver lock) would deadlock the child.
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=pg_timeout,
                              wait_for_workers=False)  # port 0: the OS picks a free one
        for conn in conns:
            conn.send(store.port)
        deadline = time.monotonic() + timeout
        if _deadline is not None and _deadline < deadline:  # a caller's deadline comes first: say what was left
            deadline, timeout = _deadline, max(0.0, _deadline - started)
        pending = dict(conns)  # pipes we still expect a message on
        while pending:
            if errors:  # someone failed: the rest get a short grace, not the full timeout
                deadline = min(deadline, min(errors)[0] + grace)
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, when, payload = pickle.loads(conn.recv_bytes())  # when: the rank's time.monotonic()
                except EOFError:  # died without a word: a crash, os._exit, a signal
                    procs[rank].join(1)
                    said = f"rank {rank} exited with code {procs[rank].exitcode} before reporting"
                    status, when, payload = "error", time.monotonic(), ("ProcessExit", said, None)
                if status == "ok":
                    results[rank], returned[rank] = payload, when
                else:
                    errors.append((when, rank, payload))
        if errors:
            first, *later = sorted(errors, key=lambda e: e[:2])  # the first: the cause
            failed_at, rank, (exc_type, tb, blob) = first
            # a rank that returned before the failure never issued what the failing rank waited for there
            others = [(r, f"had returned normally before rank {rank} failed: a collective or message rank {rank} "
                          "waited for from it was never issued") for r, t in sorted(returned.items()) if t <= failed_at]
            others += [(r, p[1] if p[0] == "ProcessExit" else f"raised {p[0]}") for _, r, p in later]
            others += [(r, f"still running {grace:g} s after: killed") for r in sorted(pending.values())]
            stacks = read_stacks({r: procs[r].pid for r in pending.values()}, files)
            raise RankError(rank, exc_type, tb, others, stacks) from _unpickle(blob)
        if pending:
            ranks = sorted(pending.values())
            raise RankTimeout(ranks, timeout, read_stacks({r: procs[r].pid for r in ranks}, files))
        finished = True
        return results
    finally:
        stop = time.monotonic() + (5 if finished else 0.5)  # time to exit on their own
        for p in procs:  # no orphans, whatever happened: each rank's whole group goes
            p.join(timeout=max(0.0, stop - time.monotonic()))
            kill_group(p)  # also what a finished rank left running
            p.join()
        for conn in [*conns, lifeline, lifeline_w]:
            conn.close()
        shutil.rmtree(dumps, ignore_errors=True)
        del store
# --8<-- [end:run_on_ranks]


def _unpickle(blob):
    try:
        return pickle.loads(blob) if blob is not None else None
    except Exception:  # e.g. a class the parent cannot import
        return None
