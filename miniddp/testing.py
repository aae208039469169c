"""Run a function on N ranks: the harness behind every test and notebook.

What
    ``run_on_ranks(fn, world_size, args=(...), kwargs={...})`` starts
    ``world_size`` processes, joins them into one process group, calls
    ``fn(rank, world_size, *args, **kwargs)`` in each, and returns the list of
    their return values, in rank order. If a rank raises, the parent raises
    ``RankError`` carrying that rank's number, its traceback and (as
    ``__cause__``) the original exception; if a rank hangs, it is killed at
    ``timeout`` and the parent raises ``RankTimeout`` naming it. The harness's own
    options are keyword-only, so a misspelt one is a ``TypeError`` and ``fn`` may
    take any keyword, ``timeout`` included, through ``kwargs=``.

Why
    Distributed bugs live *between* processes, so the tests must run real
    processes, and fail like ordinary tests: quickly, with the right traceback,
    never hanging CI, never fighting over a port under pytest-xdist, and never
    leaving a process behind (DataLoader workers of a killed rank, or ranks of a
    SIGKILLed pytest worker, would hold cores and ports for every later test).

How
    * Rendezvous: the parent opens a ``TCPStore`` on port 0 (the OS picks a free
      port) and the ranks join it as clients, as torchrun's workers join its agent's.
    * Start method (measured in ``benchmarks/launch_cost.py``): ``forkserver``, the
      default, forks each rank from a clean server that has already imported
      torch: fork's speed (~0.06 s against spawn's ~1.6 s) without inheriting the
      parent's threads and locks. Notebooks use ``start_method="fork"``: their
      functions cannot be pickled by name. The store is opened only after the
      last fork, so no child inherits a lock held by the store's thread.
    * Each rank sets ``torch.set_num_threads(1)``: N ranks on 2 cores must not
      each start a full thread pool.
    * No orphans. Each rank leads its own process group, which everything it
      starts joins, so one ``os.killpg`` ends a rank *and its descendants*: the
      parent does it at the timeout, after a failure's grace and in its
      ``finally``. A parent that is SIGKILLed runs no ``finally``: each rank's
      watchdog thread then reads end-of-file on a "lifeline" pipe whose write end
      only the parent held, and kills its own group. (``PR_SET_PDEATHSIG`` is not
      enough: under forkserver a rank's parent is the server, and it kills the
      rank alone, not its DataLoader workers.)

How torch differs
    torch's own tests (``torch/testing/_internal/common_distributed.py``,
    ``MultiProcessTestCase``) use a FileStore per test, pipe each child's
    traceback to the parent and skip with an exit code when there are too few
    GPUs; this is the same idea in ~250 lines.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from .process_group.clean_exit import destroy_process_group

DEFAULT_TIMEOUT_S = 120.0  # a whole multi-rank call; tests pass smaller ones
# What the forkserver imports once. torch._dynamo is imported lazily by torch DDP's first
# construction (1.5 s here): preloading it keeps every oracle test fast.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "miniddp"]


class RankError(RuntimeError):
    """A rank raised. ``.rank``, ``.remote_traceback``; ``__cause__`` is the original."""

    def __init__(self, rank: int, exc_type: str, remote_traceback: str):
        super().__init__(f"rank {rank} raised {exc_type}:\n{remote_traceback}")
        self.rank = rank  # which rank failed first
        self.exc_type = exc_type  # the name of its exception class
        self.remote_traceback = remote_traceback  # formatted in the child


class RankTimeout(RankError, TimeoutError):
    """Ranks did not finish within the harness timeout and were killed."""

    def __init__(self, ranks: list[int], timeout: float):
        RuntimeError.__init__(self, f"rank(s) {ranks} did not finish within {timeout:g} s and were killed")
        self.rank, self.ranks, self.exc_type, self.remote_traceback = ranks[0], ranks, "RankTimeout", ""


def nccl_available(world_size: int) -> bool:
    """True when NCCL can run ``world_size`` ranks here (one GPU per rank)."""
    return dist.is_nccl_available() and torch.cuda.device_count() >= world_size


def backend_params(world_size: int):
    """pytest parameters: gloo always, nccl when there is a GPU per rank (else skipped)."""
    import pytest  # only the test suite needs pytest

    reason = f"nccl needs {world_size} CUDA device(s); torch.cuda.device_count()={torch.cuda.device_count()}"
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param(
            "nccl", id="nccl", marks=[pytest.mark.nccl, pytest.mark.skipif(not nccl_available(world_size), reason=reason)]
        ),
    ]


# --8<-- [start:lifeline]
def _watch_lifeline(lifeline, inherited) -> None:
    """Lead a process group (all this rank will start joins it) that dies with the parent."""
    os.setpgid(0, 0)  # first, before fn can start anything: group id = this rank's pid
    if inherited is not None:  # fork copied the parent's write end into this rank: drop it,
        inherited.close()  # or the lifeline could never break while this rank lives

    def watch():
        lifeline.poll(None)  # the parent never writes: readable only at end-of-file, once it is gone
        os.killpg(0, signal.SIGKILL)  # this rank and everything it started

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _kill_group(p) -> None:
    """SIGKILL a rank's process group (the rank and its descendants), then the rank itself."""
    try:
        os.killpg(p.pid, signal.SIGKILL)  # no such group if the rank never reached setpgid
    except (ProcessLookupError, PermissionError):
        pass
    p.kill()  # a rank killed before its setpgid had started nothing yet
# --8<-- [end:lifeline]


# --8<-- [start:worker]
def _worker(rank, world_size, fn, args, kwargs, conn, lifeline, inherited, host, backend, init, pg_timeout):
    """Body of each rank's process: join, run ``fn``, send back a result or a traceback."""
    _watch_lifeline(lifeline, inherited)
    torch.set_num_threads(1)  # N ranks share a few cores; no oversubscription
    port = conn.recv()  # the store's port, sent once every rank has been started (see run_on_ranks)
    os.environ.update(  # torchrun's variables, so code under test can read them
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR=host,
        MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
    )
    try:
        if init:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=pg_timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        result = fn(rank, world_size, *args, **kwargs)
        # plain pickle copies tensors into the message; multiprocessing's own pickler would
        # share their memory through a file descriptor that dies with this process
        conn.send_bytes(pickle.dumps(("ok", rank, result)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        try:
            payload = pickle.dumps(exc)
        except Exception:  # an exception that cannot travel: send its text only
            payload = None
        conn.send_bytes(pickle.dumps(("error", rank, (type(exc).__name__, traceback.format_exc(), payload))))
    finally:
        # the group, ours or one fn made (the notebook launcher's): bounded, so a rank whose peer failed
        # mid-collective does not wait for it; no garbage collection: the rank ends with os._exit
        destroy_process_group(collect=False)
        conn.close()
# --8<-- [end:worker]


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
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
    ctx = _context(start_method)
    pg_timeout = datetime.timedelta(seconds=pg_timeout or timeout)
    lifeline, lifeline_w = ctx.Pipe(duplex=False)  # the write end never leaves this process
    inherited = lifeline_w if start_method == "fork" else None  # ...except as a copy fork makes
    store = None
    procs, conns = [], {}
    results, errors = [None] * world_size, []
    finished = False  # every rank reported success
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"rank{rank}", args=(
                rank, world_size, fn, tuple(args), kwargs or {}, child_end, lifeline, inherited,
                "127.0.0.1", backend, init, pg_timeout))
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
        pending = dict(conns)  # pipes we still expect a message on
        while pending:
            if errors:  # someone failed: the rest get a short grace, not the full timeout
                deadline = min(deadline, errors[0][0] + grace)
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, _, payload = pickle.loads(conn.recv_bytes())
                except EOFError:  # died without a word: a crash, os._exit, a signal
                    procs[rank].join(1)
                    status, payload = "error", ("ProcessExit", f"rank {rank} exited with code "
                                                f"{procs[rank].exitcode} before reporting", None)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append((time.monotonic(), rank, payload))
        if errors:
            _, rank, (exc_type, tb, blob) = min(errors)  # the first failure is usually the cause
            raise RankError(rank, exc_type, tb) from _unpickle(blob)
        if pending:
            raise RankTimeout(sorted(pending.values()), timeout)
        finished = True
        return results
    finally:
        stop = time.monotonic() + (5 if finished else 0.5)  # time to exit on their own
        for p in procs:  # no orphans, whatever happened: each rank's whole group goes
            p.join(timeout=max(0.0, stop - time.monotonic()))
            _kill_group(p)  # also what a finished rank left running
            p.join()
        for conn in [*conns, lifeline, lifeline_w]:
            conn.close()
        del store
# --8<-- [end:run_on_ranks]


def _unpickle(blob):
    try:
        return pickle.loads(blob) if blob is not None else None
    except Exception:  # e.g. a class the parent cannot import
        return None
