"""One rank's process in the test harness: its body, and how it ends with everything it started.

What
    ``run_rank`` is the body of each process ``miniddp.testing.run_on_ranks`` starts: it sets
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
    signal ends the rank alone, not its DataLoader workers.

How torch differs
    ``torch/testing/_internal/common_distributed.py`` (``MultiProcessTestCase``) terminates its
    children one by one (``p.terminate()``) at a timeout or after one fails; what they started
    is not reached, and a child whose test process is killed runs on.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback

import torch
import torch.distributed as dist

from .process_group.clean_exit import destroy_process_group


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


# --8<-- [start:worker]
def run_rank(rank, world_size, fn, args, kwargs, conn, lifeline, inherited, host, backend, init, pg_timeout):
    """Body of each rank's process: join, run ``fn``, send back a result or a traceback."""
    watch_lifeline(lifeline, inherited)
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
