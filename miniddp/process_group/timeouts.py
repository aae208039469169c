"""Timeouts: how long a rank waits for the others before it gives up.

What
    ``as_timedelta`` validates Hugging Face's ``ddp_timeout`` (seconds, default
    ``DEFAULT_TIMEOUT_S`` = 1800) and turns it into the ``timedelta`` that
    ``init_process_group`` takes.

Why
    Every collective is a rendezvous: if one rank is slow or dead, the others block inside
    ``all_reduce``. Without a timeout that is a silent hang that burns a whole allocation;
    with one it is an error. A timeout of ``0``, ``nan`` or ``"30"`` is refused here, with the
    option's name, instead of deep inside c10d.

How torch differs
    ``init_process_group(timeout=...)`` defaults to 30 min for gloo and 10 min for NCCL
    (``torch/distributed/constants.py``); Transformers passes ``ddp_timeout`` (1800 s) to it.
    On gloo a blocked collective raises on the waiting rank; on NCCL the watchdog thread aborts
    the communicator after the timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), unless
    ``TORCH_NCCL_BLOCKING_WAIT=1`` makes ``wait()`` raise ``DistBackendError``
    (``ProcessGroupNCCL.cpp``). Who was missing: ``monitored_barrier.py``, ``stalled_ranks.py``.
"""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = ["DEFAULT_TIMEOUT_S", "as_timedelta"]

#: Hugging Face's default ``ddp_timeout``: 30 minutes.
DEFAULT_TIMEOUT_S = 1800


# --8<-- [start:as_timedelta]
def as_timedelta(timeout, name: str = "ddp_timeout") -> timedelta:
    """``timeout`` in seconds (int/float) or a ``timedelta`` -> a positive ``timedelta``."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, got {timeout!r}")
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name}={timeout!r} is not a finite number of seconds; use e.g. {name}=1800")
    if seconds <= 0:
        raise ValueError(
            f"{name}={timeout!r} must be > 0 seconds (default {DEFAULT_TIMEOUT_S}); "
            "a rank waits this long for its peers before raising"
        )
    if seconds > timedelta.max.total_seconds():  # 1e308: a timedelta cannot hold it (an OverflowError)
        raise ValueError(f"{name}={timeout!r} seconds is more than a timedelta holds (about 2.7 million years): "
                         f"use e.g. {name}=1800 (the default)")
    if seconds < 0.001:  # gloo and NCCL count whole milliseconds: this would be a timeout of 0
        raise ValueError(f"{name}={timeout!r} is under a millisecond, which gloo and NCCL round to 0: "
                         f"give seconds, e.g. {name}=1800 (the default)")
    return timedelta(seconds=seconds)
# --8<-- [end:as_timedelta]
