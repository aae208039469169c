"""The debug switch: ``MINIDDP_DEBUG=collectives`` makes every process group a ``CheckedGroup``.

What
    ``enabled()`` reads the switch, ``detector_timeout`` how long a checked group waits for a
    late rank (``MINIDDP_DEBUG_TIMEOUT``); ``register("gloo")`` registers a c10d backend named
    ``miniddp_debug_gloo`` whose creator wraps a real ``ProcessGroupGloo`` (or NCCL) in a
    ``CheckedGroup``, and returns the name ``init_distributed`` passes to
    ``init_process_group``. ``backend_name(group)`` is the real backend under a group.

Why
    torch calls a backend's creator for the default group and for every ``dist.new_group()``,
    each with that group's own store: registering once checks them all, torch DDP's C++
    reducer included, with no change to the user's script.

How torch differs
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the C++ group inside ``_new_process_group_helper``
    (``torch/distributed/distributed_c10d.py``); ``Backend.register_backend`` (same file) is
    torch's entry point for out-of-tree backends, the one used here.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from .desync import TIMEOUT_ENV, CheckedGroup
from .timeouts import as_timedelta

DEBUG_ENV = "MINIDDP_DEBUG"  # the switch: "collectives", alone or in a comma-separated list


def enabled(environ=None) -> bool:
    """Is ``MINIDDP_DEBUG=collectives`` set (alone or in a comma-separated list)?"""
    return "collectives" in (os.environ if environ is None else environ).get(DEBUG_ENV, "").split(",")


def detector_timeout(group_timeout: timedelta, environ=None) -> timedelta:
    """``MINIDDP_DEBUG_TIMEOUT`` seconds, else 0.9 x the group's timeout: we speak before gloo does."""
    value = (os.environ if environ is None else environ).get(TIMEOUT_ENV)
    return as_timedelta(float(value), name=TIMEOUT_ENV) if value else group_timeout * 0.9


# --8<-- [start:register]
def register(inner: str) -> str:
    """Register the checking backend around ``inner`` ("gloo" or "nccl"); return the name to init with."""
    if inner not in ("gloo", "nccl"):
        raise ValueError(f"{DEBUG_ENV}=collectives wraps gloo or nccl, not {inner!r}; unset {DEBUG_ENV}")
    name = CheckedGroup.name_for(inner)
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, lambda *args: _create(inner, *args),
                                      devices=["cuda" if inner == "nccl" else "cpu"])
    return name


def _create(inner_name: str, store, rank: int, size: int, timeout: timedelta) -> CheckedGroup:
    """torch calls this for the default group and each ``new_group``, with that group's own store."""
    if inner_name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        inner = dist.ProcessGroupNCCL(dist.PrefixStore("inner/", store), rank, size, options)
    else:
        inner = dist.ProcessGroupGloo(dist.PrefixStore("inner/", store), rank, size, timeout)
    return CheckedGroup(inner, inner_name, dist.PrefixStore("desync/", store), rank, size, detector_timeout(timeout))
# --8<-- [end:register]


def backend_name(group=None) -> str:
    """The real backend under ``group``: "gloo" for a checked gloo group, else ``dist.get_backend``."""
    group = group or dist.group.WORLD
    return group.inner_name if isinstance(group, CheckedGroup) else dist.get_backend(group)
