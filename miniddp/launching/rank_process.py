"""One rank's process in the test harness: its body, and how it ends with everything it started.

What
    ``run_rank`` is the body of each process ``miniddp.launching.spawn.run_on_ranks`` starts: it sets
    torchrun's environment variables, joins the process group, calls the function under test
    and sends back its result or its traceback. ``watch_lifeline`` makes the rank lead its own
    process group and kill it when the parent is gone; ``kill_group`` is how the parent ends a
    rank and all it started.

Why
    A process that outlives its test (DataLoader workers of a killed rank, ranks of a
    SIGKILLed pytest worker) holds cores and ports for every later test. One ``os.killpg``
    ends a rank *and its descendants*; a "lifeline" pipe whose write end only the parent holds
    reads end-of-file when the parent dies, however it died, and the rank then kills its group.
    ``PR_SET_PDEATHSIG`` is not enough: under forkserver a rank's parent is the server, and the
    signal ends the rank alone, not its DataLoader workers. A rank killed at a timeout says nothing,
    so before killing it the parent sends ``STACK_SIGNAL``: ``faulthandler`` writes every thread's
    Python stack to the rank's file from inside the signal handler, even while the rank is blocked in
    C++ (a ``dist.recv`` that will never return).

How torch differs
    ``torch/testing/_internal/common_distributed.py`` (``MultiProcessTestCase``) terminates its
    children one by one (``p.terminate()``) at a timeout or after one fails; what they started
    is not reached, and a child whose test process is killed runs on; a hung child is killed
    without a word about where it was.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import pickle
import re
import signal
import sysconfig
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..process_group.clean_exit import destroy_process_group
from ..process_group.monitored_barrier import monitored_barrier

STACK_SIGNAL = signal.SIGUSR1  # the parent's "where are you?" to a rank it is about to kill


# --8<-- [start:lifeline]
def watch_lifeline(lifeline, inherited) -> None:
    """Lead a process group (all this rank will start joins it) that dies with the parent."""
    os.setpgid(0, 0)  # first, before fn can start anything: group id = this rank's pid
    if inherited is not None:  # fork copied the parent's write end into this rank: drop it,
        inherited.close()  # or the lifeline could never break while this rank lives

    def watch():
        lifeline.poll(None)  # the parent never writes: readable only at end-of-file, once it is gone
        os.killpg(0, signal.SIGKILL)  # this rank and everything it started

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def kill_group(p) -> None:
    """SIGKILL a rank's process group (the rank and its descendants), then the rank itself."""
    try:
        os.killpg(p.pid, signal.SIGKILL)  # no such group if the rank never reached setpgid
    except (ProcessLookupError, PermissionError):
        pass
    p.kill()  # a rank killed before its setpgid had started nothing yet
# --8<-- [end:lifeline]


def dump_stacks_on_signal(path) -> None:
    """On ``STACK_SIGNAL``, write every thread's Python stack to ``path``, after a first line naming the
    main thread (the signal may land on another thread: the parent reads the main thread's block)."""
    if path is None:
        return
    dump = open(path, "w")  # held open by faulthandler for the life of the rank
    dump.write(f"main thread {threading.main_thread().ident:#x}\n")
    dump.flush()
    faulthandler.register(STACK_SIGNAL, file=dump, all_threads=True, chain=False)


def read_stacks(pids: dict[int, int], files, wait_s: float = 2.0) -> dict[int, str]:
    """Ask each rank in ``pids`` (rank -> pid) for its stack and read them: rank -> its main thread's
    frames, innermost first, each with its source line; "" for a rank that did not answer in time."""
    for pid in pids.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    texts, deadline = {}, time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(pids):  # complete once two reads agree: faulthandler writes a thread at a time
            text = _read(files[rank])
            if text.count("\n") > 1 and texts.get(rank) == text:
                del pids[rank]
            texts[rank] = text
    return {rank: _main_thread(text) for rank, text in texts.items()}


def _read(path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _main_thread(text: str) -> str:
    header, _, threads = text.partition("\n")
    main = header.rpartition(" ")[2]
    for block in re.split(r"\n(?=\S)", threads):
        ident = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", block)
        if ident and main.startswith("0x") and int(ident[1], 16) == int(main, 16):
            frames = re.findall(r'File "(.*)", line (\d+) in (.+)', block)
            return "".join(f'  File "{file}", line {line} in {fn}\n    {linecache.getline(file, int(line)).strip()}\n'
                           for file, line, fn in frames)
    return ""


# the longest first: site-packages may lie inside a virtual environment's lib folder
_LIBRARIES = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")},
                          key=len, reverse=True))
_HARNESS = (__file__, __file__.replace("rank_process.py", "spawn.py"))


def where(rank: int, stack: str, user_frames: int = 2) -> str:
    """Where a rank was, in a few lines: its innermost frame (often torch's ``recv`` or ``wait``), then the
    innermost frames of code that is neither a library nor the harness, with their source lines."""
    frames = re.findall(r'  File "(.*)", line (\d+) in (.+)\n    (.*)', stack)
    if not frames:
        return f"  rank {rank}: no stack (it did not answer the signal)"
    ours = [f for f in frames[1:] if not f[0].startswith(_LIBRARIES + ("<",)) and f[0] not in _HARNESS][:user_frames]
    lines = [f"  rank {rank}: " + _frame(*frames[0])] + [f"      called from {_frame(*f)}" for f in ours]
    return "\n".join(lines)


def _frame(file, line, fn, source) -> str:
    for root in _LIBRARIES:
        if file.startswith(root + os.sep):
            file = os.path.relpath(file, root)
            break
    else:
        relative = os.path.relpath(file)
        file = file if relative.startswith("..") else relative
    return f"{fn} ({file}:{line}): {source}" if source else f"{fn} ({file}:{line})"


# --8<-- [start:worker]
def run_rank(rank, world_size, fn, args, kwargs, conn, lifeline, inherited, host, backend, init, pg_timeout,
             stack_file=None):
    """Body of each rank's process: join, run ``fn``, send back a result or a traceback."""
    watch_lifeline(lifeline, inherited)
    dump_stacks_on_signal(stack_file)
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
            monitored_barrier(pg_timeout, store=store)  # every rank's init has returned (as init_distributed)
        result = fn(rank, world_size, *args, **kwargs)
        # plain pickle copies tensors into the message; multiprocessing's own pickler would
        # share their memory through a file descriptor that dies with this process
        conn.send_bytes(pickle.dumps(("ok", time.monotonic(), result)))  # when: one clock for every process
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        try:
            payload = pickle.dumps(exc)
        except Exception:  # an exception that cannot travel: send its text only
            payload = None
        conn.send_bytes(pickle.dumps(("error", time.monotonic(), (type(exc).__name__, traceback.format_exc(),
                                                                  payload))))
    finally:
        # the group, ours or one fn made (the notebook launcher's): bounded, so a rank whose peer failed
        # mid-collective does not wait for it; no garbage collection: the rank ends with os._exit
        destroy_process_group(collect=False)
        conn.close()
# --8<-- [end:worker]
