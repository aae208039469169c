"""Living under torchrun's elastic agent: die with it, and a store of its own per restart.

What
    ``die_with_launcher()`` ends a worker (SIGTERM) once its launcher is gone;
    ``restart_scoped_store(env, timeout)`` is the agent's store under a prefix of its own for
    each ``--max-restarts`` attempt. ``init_distributed`` uses both when torchrun started it.

Why
    ``kill -9`` of torchrun leaves its workers orphaned, still training, still holding the
    output directory's lock, invisible to the next ``torchrun``. And a restarted attempt that
    shares the dead attempt's keys can read stale addresses and fail or hang while connecting.

How torch differs
    torch's workers do not watch their agent: the agent stops them
    (``torch/distributed/elastic/multiprocessing/``), so an agent killed outright stops nobody.
    Its ``env://`` rendezvous reuses the agent's store (``TORCHELASTIC_USE_AGENT_STORE``) across
    attempts with no per-attempt prefix (``torch/distributed/rendezvous.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist


def die_with_launcher(poll_s: float = 1.0) -> None:
    """End this worker (SIGTERM) when its launcher dies: a daemon thread watches the parent pid.

    ``kill -9`` of torchrun leaves its workers running, orphaned: still training, still
    holding the output directory's lock, and invisible to the next ``torchrun``.
    (``prctl(PR_SET_PDEATHSIG)`` would fire when the *thread* that started us exits.)
    """
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_s)
        print(f"miniddp: the launcher (pid {launcher}) died; rank {os.environ.get('RANK')} stops",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="miniddp-die-with-launcher", daemon=True).start()


# --8<-- [start:restart_scoped_store]
def restart_scoped_store(env, timeout) -> dist.Store:
    """torchrun's agent store (at ``env.master_addr:master_port``, a ``DistEnv``), under a prefix of its
    own for each restart attempt.

    torch 2.13's ``env://`` reuses the agent's store across ``--max-restarts`` attempts
    without a prefix, so a restarted gloo group can read the dead attempt's addresses
    and fail to connect, or hang in ``connectFullMesh``.
    """
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"miniddp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
# --8<-- [end:restart_scoped_store]
