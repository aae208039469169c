"""The process group: the ground floor, everything about the ranks and the wire that DDP stands on.

What
    ``backend.py`` picks the backend for a device (cuda -> nccl, cpu -> gloo, xpu, hpu, mlu by name);
    ``env.py`` is the rendezvous (torchrun or SLURM -> ``DistEnv``), with ``slurm.py`` reading SLURM's
    compressed host lists and ``elastic_agent.py`` living under torchrun's elastic agent; ``timeouts.py``
    how long a rank waits (``ddp_timeout``), ``monitored_barrier.py`` a barrier that names who never came,
    ``stalled_ranks.py`` naming them after a failed collective, ``process_info.py`` where each rank runs;
    ``desync.py`` compares every collective across ranks before it runs, ``fingerprint.py`` is one rank's
    view of one collective and the user's line that issued it, ``debug_backend.py`` the switch that turns
    it on (``MINIDDP_DEBUG=collectives``); ``clean_exit.py`` destroys the group miniddp created before the
    interpreter tears down.

May import
    torch only: it is the ground floor (import-linter's layers contract in ``pyproject.toml``).
"""
