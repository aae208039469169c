"""Two "hosts" on this machine: two network namespaces joined by a veth pair.

Each namespace has its own network stack (interfaces, addresses, routes, ports,
loopback) as a separate machine has; the filesystem, the processes and the host
name stay shared, like two hosts with a shared filesystem for checkpoints. A
command runs "on" host A with ``ip netns exec <A's namespace> <command>``
(``a.cmd(argv)``); from there it reaches host B at ``10.77.0.2`` over the pair and
nothing else: not this machine's own network, not B's loopback. Taking one end of
the pair down is pulling out a cable.

    with two_hosts() as (a, b):
        subprocess.run(a.cmd(["ip", "-brief", "address"]))  # lo, and veth-a with 10.77.0.1/24
        b.link_down()   # now neither host reaches the other

Needs root and iproute2's ``ip``: ``unavailable()`` says why not, for a skip.
Namespace names carry the pid of the process that made them and a counter, so
pytest-xdist workers and several pairs never collide; the pair is created directly
inside the two namespaces, so its interface names (``veth-a``, ``veth-b``) exist
nowhere else. ``two_hosts`` deletes both namespaces (and so the pair) when its
block ends, whatever happened in it, and first deletes those of dead processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.77.0"  # a private /24 that exists only inside the two namespaces


@dataclass(frozen=True)
class Host:
    namespace: str  # the network namespace (`ip netns list`)
    interface: str  # its end of the veth pair: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    address: str  # its address on that interface, the one the other host reaches it at

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        """Every process on this host (in its network namespace): launchers, workers, their children."""
        return [int(p) for p in _ip("netns", "pids", self.namespace).split()]

    def link_down(self) -> None:
        """Pull the cable: this end of the pair goes down, and the other loses its carrier."""
        _ip("netns", "exec", self.namespace, "ip", "link", "set", self.interface, "down")

    def link_up(self) -> None:
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


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (a skip reason), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces (`ip netns add`)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command (apt-get install iproute2)"
    probe = f"miniddp-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as err:
        return f"`ip netns add` does not work here: {err}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30)
    return None


_made = 0  # pairs made by this process: part of their names


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale() -> None:
    """Delete the namespaces of test processes that died without cleaning up (SIGKILL runs no finally)."""
    for line in _ip("netns", "list").splitlines():
        match = re.match(r"(miniddp-(\d+)-(\d+|probe)(-[ab])?)\b", line.strip())
        if match and not _alive(int(match.group(2))):
            subprocess.run(["ip", "netns", "delete", match.group(1)], capture_output=True, timeout=30)


@contextmanager
def two_hosts(subnet: str = SUBNET):
    """Yield hosts A (``subnet``.1 on ``veth-a``) and B (``subnet``.2 on ``veth-b``), with ``lo`` up in
    each; delete both namespaces afterwards, which deletes the pair too."""
    global _made
    _made += 1
    _sweep_stale()
    tag = f"miniddp-{os.getpid()}-{_made}"
    a = Host(f"{tag}-a", "veth-a", f"{subnet}.1")
    b = Host(f"{tag}-b", "veth-b", f"{subnet}.2")
    made = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface,
            "netns", b.namespace)
        for host in (a, b):
            run = ("netns", "exec", host.namespace, "ip")
            _ip(*run, "address", "add", f"{host.address}/24", "dev", host.interface)
            _ip(*run, "link", "set", host.interface, "up")
            _ip(*run, "link", "set", "lo", "up")
        yield a, b
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
