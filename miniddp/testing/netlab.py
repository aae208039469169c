"""A network in a box: "hosts" in network namespaces, joined by links of a chosen rate.

What
    ``net_lab(n, rate_gbit)``: ``n`` network namespaces (each its own interfaces, addresses,
    ports and loopback; files, processes and CPU shared), two joined by a veth pair, more by a
    bridge in a "switch" namespace. ``Lab.set_rate`` shapes both ends of every link with tbf.
    ``Lab.run_ranks`` runs one process per host with torchrun's variables, naming a rank that fails.

Why
    On loopback the network barely matters; real DDP runs over 1 to 100 Gbit/s links, where
    bucket size, overlap and compression decide the step time. A shaped veth is such a link.

How it differs from real hosts
    tbf limits the rate and adds no delay (no ``netem`` here), and the ranks share this machine's
    cores and memory bandwidth, as ranks on two machines would not.

Needs root, ``ip`` and ``tc``: ``unavailable()`` says in one line why not, for a skip. A lab deletes
its namespaces when its block ends, however it ends, and first those of dead processes (SIGKILL).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.77.0"  # a private /24 that exists only inside the lab's namespaces
PORT = 29500  # MASTER_PORT: the lab's namespaces are fresh, so nothing else can hold it


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise OSError(f"`tc {' '.join(args)}` on {namespace} failed: {done.stderr.strip()}")


class RankFailed(RuntimeError):
    """A lab rank exited non-zero: ``.rank``, ``.returncode``; its stderr's last lines in the message."""

    def __init__(self, rank: int, returncode: int, message: str):
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


class RanksHung(TimeoutError):
    """Lab ranks still running at the deadline (then killed): ``.ranks``."""

    def __init__(self, ranks: list[int], timeout: float):
        super().__init__(f"ranks {ranks} still running after {timeout:.0f} s: killed")
        self.ranks = ranks


@dataclass(frozen=True)
class Host:
    namespace: str  # the network namespace (`ip netns list`)
    interface: str  # its link: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    address: str  # its address, the one the other hosts reach it at

    def cmd(self, argv: list[str]) -> list[str]:  # argv, run on this host
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:  # every process on this host (in its network namespace)
        return [int(p) for p in _ip("netns", "pids", self.namespace).split()]

    def link_down(self) -> None:
        """Pull the cable: this end goes down, and the other loses its carrier."""
        _ip("netns", "exec", self.namespace, "ip", "link", "set", self.interface, "down")

    def link_up(self) -> None:  # the cable back in
        _ip("netns", "exec", self.namespace, "ip", "link", "set", self.interface, "up")
    def ready_to_cut(self):
        """A function that takes the link down within a few milliseconds: ``ip`` is already waiting
        on this host for the word, so no namespace has to be entered at the moment that matters."""
        cutter = subprocess.Popen(self.cmd(["sh", "-c", f"read go && exec ip link set {self.interface} down"]),
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def cut() -> None:
            _, err = cutter.communicate(b"go\n", timeout=30)
            if cutter.returncode:
                raise OSError(f"taking {self.interface} down on {self.namespace} failed: {err.decode().strip()}")
        return cut


# --8<-- [start:shape]
def shape(namespace: str, interface: str, rate_gbit: float | None) -> None:
    """Hold ``interface``'s egress to ``rate_gbit`` with a token bucket (``None``: unshaped). The bucket
    holds 2 ms of the rate (at least 128 KiB): a much smaller one starves the link below its rate, a
    much larger one lets each message's first bytes through at the veth's own speed."""
    _tc(namespace, "qdisc", "del", "dev", interface, "root", check=False)
    if rate_gbit is not None:
        burst = max(128 * 1024, int(rate_gbit * 1e9 / 8 * 0.002))
        _tc(namespace, "qdisc", "add", "dev", interface, "root", "tbf", "rate", f"{rate_gbit}gbit",
            "burst", str(burst), "latency", "100ms")
# --8<-- [end:shape]


@dataclass
class Lab:
    hosts: list[Host]
    ends: list[tuple[str, str]]  # (namespace, interface) of every link end: both are shaped
    rate_gbit: float | None = None

    def set_rate(self, rate_gbit: float | None) -> None:
        """Every link at ``rate_gbit`` in each direction (``None``: as fast as the veth goes)."""
        if rate_gbit is not None and not rate_gbit > 0:
            raise ValueError(f"rate_gbit={rate_gbit!r} must be > 0, or None for an unshaped link")
        for namespace, interface in self.ends:
            shape(namespace, interface, rate_gbit)
        self.rate_gbit = rate_gbit

    def rank_env(self, rank: int, **extra: str) -> dict:
        """torchrun's variables for ``rank`` (one per host), the master on host 0, gloo on the lab's link."""
        host = self.hosts[rank]
        return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(self.hosts)), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": self.hosts[0].address, "MASTER_PORT": str(PORT),
                "GLOO_SOCKET_IFNAME": host.interface, "NCCL_SOCKET_IFNAME": host.interface, **extra}

    def run_ranks(self, argv: list[str], timeout: float, **extra_env: str) -> list[str]:
        """``argv`` once per host as rank 0..n-1; every rank's stdout. A rank that fails is named with its
        stderr's last lines; past ``timeout`` every rank is killed and the ones still running are named."""
        with tempfile.TemporaryDirectory() as tmp:
            logs = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+")) for r in range(len(self.hosts))]
            procs = [subprocess.Popen(host.cmd(argv), env=self.rank_env(r, **extra_env), stdout=out, stderr=err,
                                      text=True, start_new_session=True)  # files: a full pipe would stall a rank
                     for r, (host, (out, err)) in enumerate(zip(self.hosts, logs))]
            deadline = time.monotonic() + timeout
            try:
                for p in procs:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = [r for r, p in enumerate(procs) if p.poll() is None]
                raise RanksHung(hung, timeout) from None
            finally:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
            texts = [(out.seek(0) or out.read(), err.seek(0) or err.read()) for out, err in logs]
            for out, err in logs:
                out.close(), err.close()
        for r, (p, (_, err)) in enumerate(zip(procs, texts)):
            if p.returncode:
                tail = "\n".join(err.strip().splitlines()[-5:])
                where = f"rank {r} (on {self.hosts[r].namespace}) exited {p.returncode}"
                raise RankFailed(r, p.returncode, f"{where}:\n{tail}")
        return [out for out, _ in texts]


def unavailable(shaping: bool = True) -> str | None:
    """Why a lab cannot be made here (one line, a skip reason), or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the net lab needs root to create network namespaces (`ip netns add`)"
    for tool in ("ip",) + (("tc",) if shaping else ()):
        if shutil.which(tool) is None:
            return f"the net lab needs iproute2's `{tool}` command (apt-get install iproute2)"
    try:
        with net_lab(2) as lab:
            if shaping:
                lab.set_rate(1)
    except (OSError, subprocess.SubprocessError) as err:
        return f"the net lab cannot run here: {str(err).splitlines()[0]}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        pass
    return True


def _sweep_stale() -> None:
    """Delete the namespaces of processes that died without cleaning up (SIGKILL runs no finally)."""
    for line in _ip("netns", "list").splitlines():
        match = re.match(r"(miniddp-(\d+)-\S+)", line.strip())
        if match and not _alive(int(match.group(2))):
            subprocess.run(["ip", "netns", "delete", match.group(1)], capture_output=True, timeout=30)


_made = 0  # labs made by this process: part of their names


@contextmanager
def net_lab(n: int = 2, rate_gbit: float | None = None, subnet: str = SUBNET):
    """A ``Lab`` of ``n`` hosts (``subnet``.1 .. .n), ``lo`` up in each, every link at ``rate_gbit``;
    all its namespaces (and so its links) deleted when the block ends, whatever happened in it."""
    global _made
    if n < 2:
        raise ValueError(f"n={n} hosts: a lab needs at least 2")
    _made += 1
    _sweep_stale()
    tag = f"miniddp-{os.getpid()}-{_made}"
    names = "ab" if n == 2 else [str(i) for i in range(n)]
    hosts = [Host(f"{tag}-{x}", f"veth-{x}", f"{subnet}.{i + 1}") for i, x in enumerate(names)]
    made, ends = [], []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        if n == 2:  # one cable between the two
            a, b = hosts
            _ip("link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface,
                "netns", b.namespace)
            ends = [(a.namespace, a.interface), (b.namespace, b.interface)]
        else:  # a switch: a bridge in its own namespace, one cable per host
            switch = f"{tag}-switch"
            _ip("netns", "add", switch)
            made.append(switch)
            _ip("netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
            _ip("netns", "exec", switch, "ip", "link", "set", "br0", "up")
            for i, host in enumerate(hosts):
                port = f"port-{i}"
                _ip("link", "add", host.interface, "netns", host.namespace, "type", "veth", "peer", "name", port,
                    "netns", switch)
                _ip("netns", "exec", switch, "ip", "link", "set", port, "master", "br0", "up")
                ends += [(host.namespace, host.interface), (switch, port)]
        for host in hosts:
            for args in (("address", "add", f"{host.address}/24", "dev", host.interface),
                         ("link", "set", host.interface, "up"), ("link", "set", "lo", "up")):
                _ip("netns", "exec", host.namespace, "ip", *args)
        lab = Lab(hosts, ends)
        if rate_gbit is not None:
            lab.set_rate(rate_gbit)
        yield lab
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


@contextmanager
def two_hosts(subnet: str = SUBNET):
    """Hosts A (``subnet``.1 on ``veth-a``) and B (``subnet``.2 on ``veth-b``), one unshaped cable."""
    with net_lab(2, subnet=subnet) as lab:
        yield tuple(lab.hosts)
