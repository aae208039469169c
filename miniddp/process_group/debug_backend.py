"""The debug switch: ``MINIDDP_DEBUG=collectives`` makes every process group a ``CheckedGroup``.

What
    ``enabled()`` reads the switch, ``detector_timeout`` how long a checked group waits for a
    late rank (``MINIDDP_DEBUG_TIMEOUT``); ``register("gloo")`` registers a c10d backend named
    ``miniddp_debug_gloo`` whose creator wraps a real ``ProcessGroupGloo`` (or NCCL) in a
    ``CheckedGroup``, and returns the name ``init_distributed`` passes to
    ``init_process_group``. It takes the names torch takes, read as ``device_backends`` reads them: any
    case ("GLOO"), a device ("cpu:gloo"), a map ("cpu:gloo,cuda:nccl": one checked group over a gloo
    and an NCCL backend, each collective run on its tensors' device). ``backend_name(group)`` is the
    real backend under a group.

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

import torch
import torch.distributed as dist

from .desync import TIMEOUT_ENV, CheckedGroup
from .timeouts import as_timedelta

DEBUG_ENV = "MINIDDP_DEBUG"  # the switch: "collectives", alone or in a comma-separated list
_TYPES = {"gloo": dist.ProcessGroup.BackendType.GLOO, "nccl": dist.ProcessGroup.BackendType.NCCL}


def enabled(environ=None) -> bool:
    """Is ``MINIDDP_DEBUG=collectives`` set (alone or in a comma-separated list)?"""
    return "collectives" in (os.environ if environ is None else environ).get(DEBUG_ENV, "").split(",")


def detector_timeout(group_timeout: timedelta, environ=None) -> timedelta:
    """``MINIDDP_DEBUG_TIMEOUT`` seconds, else 0.9 x the group's timeout: we speak before gloo does."""
    value = (os.environ if environ is None else environ).get(TIMEOUT_ENV)
    return as_timedelta(float(value), name=TIMEOUT_ENV) if value else group_timeout * 0.9


# --8<-- [start:register]
def register(backend: str) -> str:
    """Register the checking backend around ``backend``, any name ``init_process_group`` takes for gloo or
    NCCL ("gloo", "GLOO", "cpu:gloo", "cpu:gloo,cuda:nccl"); return the name to init with."""
    devices = device_backends(backend)
    inners = sorted(set(devices.values()))
    if not set(inners) <= {"gloo", "nccl"}:
        raise ValueError(f"{DEBUG_ENV}=collectives wraps gloo or nccl, not {backend!r}; unset {DEBUG_ENV}")
    if "nccl" in inners and not dist.is_nccl_available():  # what torch's init says, before a creator fails
        raise RuntimeError(f"backend {backend!r}: this torch has no NCCL built in")
    if len(inners) == 1:  # the group's own device, where its unchecked operations go
        name, served = CheckedGroup.name_for(inners[0]), ["cuda" if inners == ["nccl"] else "cpu"]
    else:  # one name per map: its creator builds that map's backends
        name = CheckedGroup.name_for("_".join(f"{d}_{b}" for d, b in sorted(devices.items())))
        served = sorted(devices)
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, lambda *args: _create(devices, *args), devices=served)
    return name


def _create(devices: dict, store, rank: int, size: int, timeout: timedelta) -> CheckedGroup:
    """torch calls this for the default group and each ``new_group``, with that group's own store."""
    inner_names = sorted(set(devices.values()))
    if len(inner_names) == 1:
        inner = _backend(inner_names[0], dist.PrefixStore("inner/", store), rank, size, timeout)
        return CheckedGroup(inner, inner_names[0], dist.PrefixStore("desync/", store), rank, size,
                            detector_timeout(timeout))
    # A device map ("cpu:gloo,cuda:nccl"): the checked group hands each collective to a plain group that holds
    # one backend per device, which runs it on the backend of its tensors' device, as torch's group would.
    backends = {name: _backend(name, dist.PrefixStore(f"inner/{name}/", store), rank, size, timeout)
                for name in inner_names}
    by_device = dist.ProcessGroup(dist.PrefixStore("inner/", store), rank, size)
    for device, name in devices.items():
        by_device._register_backend(torch.device(device), _TYPES[name], backends[name])
    main = "nccl" if "nccl" in backends else inner_names[0]  # torch's default backend for such a map
    by_device._set_default_backend(_TYPES[main])
    group = CheckedGroup(backends[main], main, dist.PrefixStore("desync/", store), rank, size,
                         detector_timeout(timeout))
    group.inner = by_device
    for device, name in devices.items():  # what the checked group does not wrap: unchecked, on the same backends
        if torch.device(device).type != ("cuda" if main == "nccl" else "cpu"):  # CheckedGroup registered that one
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backends[name])
    return group


def _backend(name: str, store, rank: int, size: int, timeout: timedelta):
    """A real gloo or NCCL backend for one group."""
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
# --8<-- [end:register]


def device_backends(backend: str) -> dict[str, str]:
    """``{device: backend}`` as ``init_process_group`` reads ``backend``: a name in any case ("GLOO") stands
    for every device its backend serves, "cpu:gloo,cuda:nccl" maps each device (torch's ``BackendConfig``)."""
    text = str(backend).lower()
    if ":" not in text:
        return dict.fromkeys(dist.Backend.backend_capability.get(text, ["cpu", "cuda"]), text)
    pairs = [pair.split(":") for pair in text.split(",")]
    if any(len(pair) != 2 for pair in pairs) or len({device for device, _ in pairs}) != len(pairs):
        raise ValueError(f"backend {backend!r}: give one backend, or device:backend pairs, each device once "
                         "(e.g. 'cpu:gloo,cuda:nccl')")
    return dict(pairs)


def backend_name(group=None) -> str:
    """The real backend under ``group``: "gloo" for a checked gloo group, else ``dist.get_backend``."""
    group = group or dist.group.WORLD
    return group.inner_name if isinstance(group, CheckedGroup) else dist.get_backend(group)
