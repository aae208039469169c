"""Process info: where each rank runs, so that an error elsewhere can point at it.

What
    ``announce_process()`` writes this rank's ``host:pid`` to the job's store (across hosts,
    ``node07 at 10.0.0.2:4242``: with the address it reaches the store from);
    ``announced(store, rank)`` reads it back, ``describe`` prints it as ``rank 1 (pid 4242 on
    node07)``; ``store_address(store)`` is where the store listens; ``this_host(store)`` names
    this process's host.

Why
    "Rank 1 never came" is actionable only with the host and pid to ``py-spy dump``, and, when
    a link fails, the address to ``ping``. Both must be read while the network still works.

How torch differs
    torch's errors name a peer's address at most (gloo's "Connection closed by peer
    [10.0.0.2]:4242"); torchrun's failure summary (``ChildFailedError``,
    ``torch/distributed/elastic/multiprocessing/errors/``) names a worker's host and pid only
    once it has exited.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

_here_cache: dict = {}  # store host -> this process's "host at address", found while the network worked


def announce_process() -> None:
    """Write ``host:pid`` of this rank to the store, so an error elsewhere can point at it (``py-spy dump``).

    Across hosts, the host carries the address this rank reaches the store from
    (``node07 at 10.0.0.2``): the address to ``ping`` when a link goes down.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"miniddp/process/{dist.get_rank()}", f"{this_host(store)}:{os.getpid()}")


def this_host(store) -> str:
    """This host's name, and across hosts the address it reaches the store from: ``node07 at 10.0.0.2``."""
    peer = store_address(store)[0]
    if peer not in _here_cache:  # once: when the link is down there is no route to find the address by
        address = _local_address(peer)
        _here_cache[peer] = socket.gethostname() + (f" at {address}" if address else "")
    return _here_cache[peer]


def store_address(store) -> tuple[str | None, int | None]:
    """Where the job's store listens: the TCPStore under the prefixes, else MASTER_ADDR and MASTER_PORT."""
    while hasattr(store, "underlying_store"):  # PrefixStore(s) over the real one
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host:
        return host, port
    port = os.environ.get("MASTER_PORT")
    return os.environ.get("MASTER_ADDR"), int(port) if port and port.isdigit() else None


def _local_address(peer: str | None) -> str | None:
    """The address this machine reaches ``peer`` from (a UDP connect sends nothing); None on loopback."""
    if not peer:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "::1" else address


def announced(store, rank: int) -> tuple[str, str] | None:
    """``(host, pid)`` that ``rank`` announced, or None: not announced, or the store is gone with its host."""
    try:
        key = f"miniddp/process/{rank}"
        if not store.check([key]):  # not announced: a get would wait for it until the store's timeout
            return None
        host, pid = store.get(key).decode().rsplit(":", 1)
        return host, pid
    except Exception:  # the store's server died with its host or launcher
        return None


def describe(rank: int, where: tuple[str, str] | None) -> str:
    """``rank 1 (pid 4242 on node07 at 10.0.0.2)``, or ``rank 1`` when it never announced itself."""
    return f"rank {rank}" + (f" (pid {where[1]} on {where[0]})" if where else "")
