"""Clean exit: the process group miniddp created is gone before the interpreter tears down.

What
    ``destroy_at_exit()`` (called by ``init_distributed``) registers, once, an ``atexit``
    function that destroys that group if it still exists. ``destroy_process_group(timeout_s)``
    is that function for any caller: idempotent, and bounded in time when a peer is gone.
    ``MINIDDP_CLEAN_EXIT=0`` switches the ``atexit`` part off (the tests' negative control).

Why
    torch 2.13, gloo: a worker thread (``pt_gloo_runloop``) releases a finished ``Work`` just
    after completing its future, which takes the GIL. If the main thread is already in
    ``Py_FinalizeEx``, that thread is ended inside a ``noexcept`` destructor: "terminate
    called without an active exception", SIGABRT, and a finished job is reported as failed
    (pytorch#190489). Destroying the group joins those threads first, but only once the last
    Python reference to it is gone: so miniddp's wrappers keep ``None`` for the default group
    (``group_or_default``), and ``torch.distributed.nn.functional`` is imported here, before any
    group exists, because its functions' ``group=group.WORLD`` defaults would hold it for good.

How torch differs
    torch registers nothing at exit, and its DDP keeps ``self.process_group``: with a torch DDP
    model alive, ``destroy_process_group()`` leaves gloo's threads running, and the abort stays
    possible.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import weakref

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - imported before any group exists: see the docstring

EXIT_TIMEOUT_S = 10.0  # how long an exit waits for the group to go: a peer gone mid-collective is not waited for
_created: weakref.ref | None = None  # the default group init_distributed created, if it still lives
_registered = False  # the atexit function is registered (once per process)


def group_or_default(group):
    """``group``, or the default group when it is ``None``: looked up at each use, never stored."""
    return group if group is not None else dist.group.WORLD


def gloo_threads() -> list[str]:
    """Names of this process's gloo worker threads (Linux: ``/proc/self/task``; elsewhere none are seen)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(("pt_gloo", "gloo_")):
            names.append(name)
    return names


# --8<-- [start:destroy]
def destroy_process_group(timeout_s: float = EXIT_TIMEOUT_S, collect: bool = True) -> bool:
    """Destroy the default process group, if there is one; True when it is gone within ``timeout_s``.

    First (``collect``) a garbage collection: a wrapper dropped in a reference cycle (a DDP and
    its hooks) may still hold a group. The destroy runs in a helper thread, so a collective still
    waiting for a peer that died cannot hold the exit for longer than ``timeout_s``; its error is
    raised here.
    """
    if not dist.is_available() or not dist.is_initialized():
        return True  # never created, or the user already destroyed it
    if collect:
        gc.collect()
    failure: list[BaseException] = []

    def destroy():
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=destroy, name="miniddp-destroy-process-group", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(f"miniddp: destroying the process group took over {timeout_s:g} s (a collective still waits "
              "for a peer); exiting without waiting for it", file=sys.stderr, flush=True)
        return False
    if failure:
        raise failure[0]
    return True
# --8<-- [end:destroy]


def destroy_at_exit() -> None:
    """Destroy the default group (the one just created) at interpreter exit, unless the user did first."""
    global _created, _registered
    _created = weakref.ref(dist.group.WORLD)
    if not _registered and os.environ.get("MINIDDP_CLEAN_EXIT", "1") != "0":
        _registered = True
        atexit.register(_at_exit)  # runs before Py_FinalizeEx, while threads may still take the GIL


def _at_exit() -> None:
    ours = _created() if _created is not None else None
    if ours is None or not dist.is_initialized() or dist.group.WORLD is not ours:
        return  # destroyed already, or a group someone else created since: theirs to destroy
    try:
        destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit a failed destroy is reported, never raised
        print(f"miniddp: destroying the process group at exit failed: {exc}", file=sys.stderr, flush=True)
