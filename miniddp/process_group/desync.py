"""Collective-desync detection: compare every collective across ranks before it runs.

What
    ``CheckedGroup`` is a Python ``ProcessGroup`` around the real gloo or NCCL backend
    (``debug_backend.py`` installs it under ``MINIDDP_DEBUG=collectives``). Before each
    collective every rank posts its ``Fingerprint`` to the group's store, waits for the
    others' and compares. On a difference, or when a rank posts nothing for
    ``MINIDDP_DEBUG_TIMEOUT`` s (default 0.9 x the group's timeout), every rank raises the
    same ``CollectiveMismatchError`` naming each rank's ``file.py:LINE``. A send/recv pair is
    compared by whichever end comes second.

Why
    Collectives pair up by order alone, so a desync is silent: an extra all-reduce of a
    bucket's size is summed into the gradients, a different ``bucket_cap_mb`` per rank aborts
    gloo, a dict logged with different keys per rank deadlocks.

How torch differs
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps each group in the C++ ``ProcessGroupWrapper``
    (``torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp``): a monitored barrier, then
    all-gathers of the fingerprints on a helper gloo group; no send/recv. ``TORCH_NCCL_DESYNC_DEBUG``
    and the NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, read by
    ``torch.distributed.flight_recorder``'s ``fr_trace``) explain a hang after the watchdog fires.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from .fingerprint import Fingerprint, reduce_op_and_root

__all__ = ["CheckedGroup", "CollectiveMismatchError", "TIMEOUT_ENV"]

TIMEOUT_ENV = "MINIDDP_DEBUG_TIMEOUT"  # seconds to wait for a late rank (debug_backend.detector_timeout)
_ABSENT = "\x00absent"  # compare_set(key, _ABSENT, _ABSENT) reads a key without waiting for it


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives, or one stopped issuing them. Every rank raises the same message."""


def _even(lists) -> bool:  # uneven all-gather outputs: inputs legitimately differ per rank
    return len({t.shape for t in lists[-1]}) <= 1


def _sizes(p: Fingerprint) -> list:  # a send and its recv must agree on dtypes and sizes, not shapes
    return [(d, torch.Size(s).numel()) for d, s in p.tensors]


def _peek(store, key: str):  # the key's value, or None if it is not there (get() would wait for it)
    value = store.compare_set(key, _ABSENT, _ABSENT)  # missing key, non-empty expected value: nothing written
    return None if value == _ABSENT.encode() else value


# --8<-- [start:collectives]
# ProcessGroup method -> (op name, the inner backend's method, the tensors every rank must agree on).
# As in torch's ProcessGroupWrapper, what may legitimately differ is not compared: the root's
# lists in gather/scatter, all-gather outputs, uneven all-to-all splits.
_COLLECTIVES = {
    "allreduce": ("all_reduce", "allreduce", lambda a: a[0]),
    "allreduce_coalesced": ("all_reduce_coalesced", "allreduce_coalesced", lambda a: a[0]),
    "broadcast": ("broadcast", "broadcast", lambda a: a[0]),
    "reduce": ("reduce", "reduce", lambda a: a[0]),
    "allgather": ("all_gather", "allgather", lambda a: a[1] if _even(a[0]) else ()),
    "allgather_coalesced": ("all_gather_coalesced", "allgather_coalesced", lambda a: a[1]),
    "all_gather_single": ("all_gather_into_tensor", "_allgather_base", lambda a: a[1]),
    "_allgather_base": ("all_gather_into_tensor", "_allgather_base", lambda a: a[1]),
    "gather": ("gather", "gather", lambda a: a[1]),
    "scatter": ("scatter", "scatter", lambda a: a[0]),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter", lambda a: a[0] if _even(a[1]) else ()),
    "reduce_scatter_single": ("reduce_scatter_tensor", "_reduce_scatter_base", lambda a: a[0]),
    "_reduce_scatter_base": ("reduce_scatter_tensor", "_reduce_scatter_base", lambda a: a[0]),
    "alltoall": ("all_to_all", "alltoall", lambda a: ()),
    "alltoall_base": ("all_to_all_single", "alltoall_base", lambda a: ()),
    "barrier": ("barrier", "barrier", lambda a: ()),
}
# --8<-- [end:collectives]


class CheckedGroup(dist.ProcessGroup):
    """A process group that checks each operation across ranks, then runs it on the real backend."""

    def __init__(self, inner, inner_name: str, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.inner = inner  # the real backend: ProcessGroupGloo or ProcessGroupNCCL
        self.inner_name = inner_name  # "gloo" or "nccl": what DistEnv.backend reports
        self.store = store  # this group's own PrefixStore: every rank posts its fingerprints here
        self.timeout = timeout  # how long to wait for a late rank: less than the group's own timeout
        self.seq = 0  # collectives issued on this group so far
        self.channels: dict = {}  # (op, peer, tag) -> sends or recvs so far on that channel
        self.error = ""  # once raised, every later operation on the group raises it again
        device = torch.device("cuda" if inner_name == "nccl" else "cpu")
        self._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, inner)  # what we don't wrap: unchecked

    @staticmethod
    def name_for(inner_name: str) -> str:  # the backend's registered name, and what dist.get_backend says
        return f"miniddp_debug_{inner_name}"

    def getBackendName(self) -> str:
        return self.name_for(self.inner_name)

    # --8<-- [start:check]
    def check(self, op: str, agreed, args, kwargs) -> None:
        """Post this rank's fingerprint of the next collective, wait for every rank's, compare."""
        if self.error:
            raise CollectiveMismatchError(self.error)
        self.seq += 1
        seq, me = self.seq, self.rank()
        keys = [f"c/{seq}/{r}" for r in range(self.size())]
        mine = Fingerprint.here(seq, op, reduce_op_and_root(args, kwargs), agreed)
        # compare_set, not set: if the others already gave up on us, our slot holds their verdict
        self.store.compare_set(keys[me], "", pickle.dumps(mine))
        try:
            self.store.wait(keys, self.timeout)
        except dist.DistStoreError:  # someone is late: fill their slots with a verdict that names them
            self._name_late_ranks(seq, keys)
        message = self._compare([pickle.loads(v) for v in self.store.multi_get(keys)])
        if seq > 2:  # every rank has read #seq-2 by now: keep the store small
            self.store.delete_key(f"c/{seq - 2}/{me}")
        if message:
            self._fail(message)

    def _compare(self, prints: list[Fingerprint]) -> str:
        """'' when every rank issued the same collective, else the message every rank raises."""
        votes = [p.agreed() for p in prints]
        if len(set(votes)) == 1 or any(p.failed for p in prints):  # the lowest rank's verdict, on every rank
            return next((p.failed for p in prints if p.failed), "")
        labels = ("sequence", "op", "reduce op/root", "shapes/dtypes", "issuer (user code or miniddp)")
        differ = ", ".join(label for i, label in enumerate(labels) if len({v[i] for v in votes}) > 1)
        ranks, odd = dist.get_process_group_ranks(self), [r for r, v in enumerate(votes) if votes.count(v) == 1]
        if len(prints) > 2 and len(set(votes)) == 2 and len(odd) == 1:
            differ += f"; rank {ranks[odd[0]]} is the odd one out"
        rows = "".join(f"\n  rank {ranks[r]}: {p}" for r, p in enumerate(prints))
        return (f"ranks issued different collectives as #{prints[0].seq} on the process group of ranks {ranks}, "
                f"differing in {differ}:{rows}\nEvery rank must issue the same collectives in the same order: look "
                "for a branch on the rank or on the data (an if, a dict's keys, a config) before these lines.")
    # --8<-- [end:check]

    # --8<-- [start:stall]
    def _name_late_ranks(self, seq: int, keys: list[str]) -> None:
        """Write a verdict naming the late ranks into their empty slots. compare_set: the first writer
        wins, and a rank that arrives right now keeps its own slot (then it was not late after all)."""
        posted, ranks = [_peek(self.store, k) for k in keys], dist.get_process_group_ranks(self)
        last = [_peek(self.store, f"c/{seq - 1}/{r}") for r in range(len(keys))]
        late = "; ".join(f"rank {ranks[r]} issued nothing after " + (str(pickle.loads(last[r])) if last[r] else
                         "joining the group") for r, v in enumerate(posted) if v is None)
        rows = "".join(f"\n  rank {ranks[r]}: {pickle.loads(v)}" for r, v in enumerate(posted) if v is not None)
        verdict = pickle.dumps(Fingerprint(seq, "failed", failed=(
            f"{late}.\nThe others waited {self.timeout.total_seconds():g} s ({TIMEOUT_ENV}, default 0.9 x the group "
            f"timeout) on the process group of ranks {ranks}:{rows}\nThe late rank is stuck (I/O, a data loader, "
            "a deadlock) or took a branch that skips this collective.")))
        for key, value in zip(keys, posted):
            if value is None:
                self.store.compare_set(key, "", verdict)
    # --8<-- [end:stall]

    def _fail(self, message: str, post: bool = False) -> None:
        self.error = message
        if post:  # a peer waiting at our next collective reads this instead of timing out
            self.store.set(f"c/{self.seq + 1}/{self.rank()}", pickle.dumps(Fingerprint(0, "failed", failed=message)))
        raise CollectiveMismatchError(message)

    # --8<-- [start:p2p]
    def send(self, tensors, dst: int, tag: int):
        self.check_p2p("send", tensors, dst, tag)
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        self.check_p2p("recv", tensors, src, tag)
        return self.inner.recv(tensors, src, tag)

    def check_p2p(self, op: str, tensors, peer: int, tag: int) -> None:
        """Post this end of a send/recv pair; the end that arrives second compares. Nobody waits:
        a send that waited for its receiver would deadlock a ring where every rank sends first."""
        if self.error:
            raise CollectiveMismatchError(self.error)
        me, n = self.rank(), self.channels.get((op, peer, tag), 0) + 1
        self.channels[(op, peer, tag)] = n
        src, dst = (me, peer) if op == "send" else (peer, me)
        key = f"p/{src}>{dst}/{tag}/{n}/"
        mine = Fingerprint.here(n, op, f"{src}->{dst}, tag {tag}", tensors)
        self.store.set(key + op, pickle.dumps(mine))
        theirs = _peek(self.store, key + ("recv" if op == "send" else "send"))
        if theirs is None:  # the peer is not there yet: it will compare
            return
        theirs = pickle.loads(theirs)
        for end in ("send", "recv"):
            self.store.delete_key(key + end)
        if theirs.failed:  # the peer raised on this channel's previous message
            self._fail(theirs.failed)
        if _sizes(mine) == _sizes(theirs):
            return
        ranks, (received, sent) = dist.get_process_group_ranks(self), sorted([mine, theirs], key=lambda p: p.op)
        message = (f"a send and its recv disagree on the process group of ranks {ranks}:\n  rank {ranks[src]}: "
                   f"{sent}\n  rank {ranks[dst]}: {received}\nThe receiver's buffer needs the sender's dtype and size.")
        # The peer's send (or recv) is already posted: complete it with zeros of its size so it does
        # not hang; it raises at its next operation on this channel or group, reading our record.
        zeros = [torch.zeros(s, dtype=getattr(torch, d), device=tensors[0].device) for d, s in theirs.tensors]
        getattr(self.inner, op)(zeros, peer, tag).wait()
        self.store.set(f"p/{src}>{dst}/{tag}/{n + 1}/{op}", pickle.dumps(Fingerprint(0, op, failed=message)))
        self._fail(message, post=True)
    # --8<-- [end:p2p]


# --8<-- [start:wrap]
def _checked(method: str, op: str, inner_method: str, agreed):
    def run(self, *args, **kwargs):
        self.check(op, agreed(args), args, kwargs)
        return getattr(self.inner, inner_method)(*args, **kwargs)

    run.__name__ = run.__qualname__ = method
    return run


for _method, (_op, _inner, _agreed) in _COLLECTIVES.items():
    setattr(CheckedGroup, _method, _checked(_method, _op, _inner, _agreed))
# --8<-- [end:wrap]
