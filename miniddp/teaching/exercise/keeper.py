"""The keeper of the check's session: nothing the learner's code starts outlives the check.

What
    ``python keeper.py COMMAND...`` (``bounds.py`` starts it, as a file: it imports only the standard
    library) runs COMMAND, the check's pytest session, as its child, after making itself a child
    subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``): a process the session starts stays a descendant
    of the keeper however it detaches (``os.setsid``, a double fork), since an orphan is adopted by
    the keeper, not by init. The keeper kills every descendant, until none is left, when the
    session's own process exits, when its stdin reads end-of-file (the check's end of that pipe
    closes however the check ends, ``SIGKILL`` included) or on ``SIGTERM``, ``SIGHUP`` or
    ``SIGINT``; then it ends as the session's process ended (its exit code, or its signal).
    ``descendants(pid)`` lists a process's descendants from ``/proc``: ``bounds.py`` sums their memory.

Why
    A session swept by its session id misses a child that called ``setsid()``, and a check killed by
    ``SIGTERM``, ``SIGHUP`` (a closed terminal) or ``SIGKILL`` ran no cleanup at all: a learner's
    sampler that never ends went on growing under init, with no memory cap. The keeper holds the
    whole tree whatever the learner's code does, and dies only after it.

How torch differs
    torchrun's agent starts each worker in a session of its own and ends it with ``os.killpg``
    (``torch/distributed/elastic/multiprocessing/subprocess_handler``): a process a worker detached
    with ``setsid`` is not reached, and a SIGKILLed agent leaves its workers running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
SWEEP_S = 0.02  # between two kill sweeps: a process being forked as we go is caught by the next one


def descendants(root: int) -> list[tuple[int, str, int]]:
    """(pid, state, resident pages) of every process below ``root``, from one read of ``/proc``."""
    children, info = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()  # after the name, which may hold spaces
            except OSError:  # gone meanwhile
                continue
            pid = int(entry)
            children.setdefault(int(fields[1]), []).append(pid)
            info[pid] = (pid, fields[0], int(fields[21]))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(info[pid])
        todo.extend(children.get(pid, []))
    return found


def end_all(session: subprocess.Popen) -> None:
    """SIGKILL every descendant, again until none is alive, reaping the orphans adopted meanwhile
    (the session's own process is left for ``session.wait``, which reads its status)."""
    me = os.getpid()
    while True:
        tree = descendants(me)
        _reap([pid for pid, state, _ in tree if state == "Z" and pid != session.pid])
        alive = [pid for pid, state, _ in tree if state not in "ZX"]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(SWEEP_S)


def _reap(pids) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)  # an adopted orphan's zombie; a grandchild's is its parent's to reap
        except ChildProcessError:
            pass


def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed: the check cannot hold its session")


def main(command: list[str]) -> None:
    _subreaper()  # before the session starts: none of its processes may be orphaned to init first
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # the session's stdin is not the lifeline: only this process and the check hold that pipe
    session = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def lifeline():
        while os.read(0, 512):  # the check never writes: this ends at end-of-file, once it is gone
            pass
        stop.set()

    threading.Thread(target=lifeline, name="lifeline", daemon=True).start()
    while session.poll() is None and not stop.wait(0.25):
        # adopted orphans that have exited: reap them as they go, not only at the end
        _reap([pid for pid, state, _ in descendants(os.getpid()) if state == "Z" and pid != session.pid])
    end_all(session)
    code = session.wait()
    if code < 0:  # end as the session's process did, so the check reads its status unchanged
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled: no need to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)  # not sys.exit: the lifeline thread may still be reading stdin


if __name__ == "__main__":
    main(sys.argv[1:])
