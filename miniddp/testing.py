"""Run a function on N ranks: the harness behind every test and notebook.

What
    ``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes,
    joins them into one process group, calls ``fn(rank, world_size, *args)`` in
    each, and returns the list of their return values, in rank order. If a rank
    raises, the parent raises ``RankError`` carrying that rank's number, its
    traceback and (as ``__cause__``) the original exception; if a rank hangs, it
    is killed at ``timeout`` and the parent raises ``RankTimeout`` naming it.

Why
    Distributed bugs live *between* processes, so the tests must run real
    processes, and fail like ordinary tests: quickly, with the right traceback,
    never hanging CI, never leaving orphans, never fighting over a port when
    pytest-xdist runs many tests at once.

How
    * Rendezvous: the parent opens a ``TCPStore`` on port 0 (the OS picks a free
      port; nothing is fixed, nothing races) and the ranks join it as clients,
      exactly as torchrun's agent hands its store to its workers.
    * Start method, measured on this 2-core machine (``benchmarks/launch_cost.py``):
      a 2-rank launch costs ~1.6 s with ``spawn`` (each child re-imports torch)
      and ~0.05 s with ``fork``. ``forkserver`` (the default) forks each rank from
      a clean server that has already imported torch and miniddp: fork's speed
      (~0.06 s) after a first launch of ~2.3 s, without inheriting the parent's
      threads and locks (pytest-xdist's, OpenMP's). Functions defined in a
      notebook cannot be pickled by name, so notebooks use ``start_method="fork"``,
      as Accelerate's ``notebook_launcher`` does. The store is opened only after
      the last fork, so no child inherits a lock held by the store's thread.
    * Each rank sets ``torch.set_num_threads(1)``: N ranks on 2 cores must not
      each start a full thread pool.

How torch differs
    torch's own tests (``torch/testing/_internal/common_distributed.py``,
    ``MultiProcessTestCase``) use a FileStore per test, pipe each child's
    traceback to the parent and skip with an exit code when there are too few
    GPUs; this is the same idea in ~200 lines.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

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
        RuntimeError.__init__(
            self, f"rank(s) {ranks} did not finish within {timeout:g} s and were killed"
        )
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


# --8<-- [start:worker]
def _worker(rank, world_size, fn, args, kwargs, conn, host, backend, init, pg_timeout):
    """Body of each rank's process: join, run ``fn``, send back a result or a traceback."""
    _die_with_parent()
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
        if init and dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
# --8<-- [end:worker]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the process that started it dies (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's finally still kills us
        pass


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    return ctx


# --8<-- [start:run_on_ranks]
def run_on_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S,
                 start_method: str = "forkserver", init: bool = True, pg_timeout: float | None = None,
                 grace: float = 3.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    ``init=True`` joins the ranks into a process group on ``backend`` before
    calling ``fn``; ``init=False`` only sets torchrun's environment variables
    (``RANK``, ``MASTER_PORT``...) so ``fn`` can test its own initialisation.
    ``timeout`` bounds the whole call; ``pg_timeout`` (default: ``timeout``) is
    the process group's own collective timeout. When a rank fails, the others
    get ``grace`` seconds to finish or fail too, then are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _context(start_method)
    pg_timeout = datetime.timedelta(seconds=pg_timeout or timeout)
    store = None
    procs, conns = [], {}
    results, errors = [None] * world_size, []
    finished = False  # every rank reported success
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"rank{rank}", args=(
                rank, world_size, fn, args, kwargs, child_end, "127.0.0.1", backend, init, pg_timeout))
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
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
            err = RankError(rank, exc_type, tb)
            original = _unpickle(blob)
            raise err from original
        if pending:
            raise RankTimeout(sorted(pending.values()), timeout)
        finished = True
        return results
    finally:
        for p in procs:  # no orphans, whatever happened
            p.join(timeout=5 if finished else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in conns:
            conn.close()
        del store
# --8<-- [end:run_on_ranks]


def _unpickle(blob):
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:
        return None
