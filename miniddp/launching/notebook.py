"""``notebook_launcher``: run a function on N ranks from a Jupyter cell.

What
    ``notebook_launcher(train, (config,), num_processes=2)`` forks N processes with
    torchrun's variables set, runs ``train(config)`` on each and returns every
    rank's result. The function joins the job itself (a ``miniddp.Trainer`` calls
    ``init_distributed``).

Why
    A notebook cannot be relaunched under ``torchrun``; forking from the kernel
    keeps the cell's functions and data, with the test harness's timeouts and
    clean teardown (``miniddp.launching.spawn.run_on_ranks``).

How Accelerate differs
    ``accelerate.notebook_launcher`` forks too, and also drives TPUs and several
    machines; this one is one machine.
"""

from __future__ import annotations

from .spawn import run_on_ranks


def notebook_launcher(function, args=(), num_processes: int = 2, timeout: float = 600.0) -> list:
    """Run ``function(*args)`` on ``num_processes`` ranks from a notebook; each rank's return value."""
    return run_on_ranks(lambda rank, world_size: function(*args), num_processes, init=False,
                        start_method="fork", timeout=timeout)
