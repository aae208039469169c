"""Communication hooks: what happens to a bucket between "its gradients are ready" and ".grad".

What
    A comm hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``:
    it receives one bucket (a ``GradBucket``: ``index()``, ``buffer()``,
    ``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``, the
    methods of ``torch.distributed.GradBucket``), starts whatever communication
    it likes, and returns a future of the *averaged* flat buffer, which the
    reducer writes back into ``.grad``. ``allreduce_hook`` is what DDP does
    without a hook (and what miniddp's reducer runs by default);
    ``fp16_compress_hook`` and ``bf16_compress_hook`` send half the bytes;
    ``powerSGD_hook`` (``powersgd.py``, re-exported here) sends a rank-r
    factorisation. ``count_bytes()`` tallies what these hooks hand to
    collectives, so a benchmark can print bytes per step.

Why
    On a slow network the all-reduce *is* the step (the issue this module comes
    from measured half of every step in communication on 2 gloo ranks). The
    hook is the one place to change what crosses the wire without touching the
    bucketing, the overlap or the ordering around it.

How torch differs
    Same contract and the same hook functions as
    ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``; torch's own
    hooks run unchanged on miniddp. torch refuses ``bf16_compress_hook`` unless it
    was built with CUDA and NCCL >= 2.10 (a check on the hook's *name* in
    ``DistributedDataParallel._check_comm_hook``); gloo in torch 2.13 sums bf16
    fine, so ours runs on gloo. Without a hook, torch's reducer divides each
    gradient by the world size while copying it into the bucket
    (``at::mul_out`` in ``reducer.cpp``) and runs a C++ sum; miniddp runs the
    Python ``allreduce_hook`` on a bucket marked ``pre_divided`` for the same
    saving: one pass over the gradients instead of two. torch does not count
    bytes; its ``PowerSGDState.compression_stats()`` counts elements.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist


# --8<-- [start:grad_bucket]
class GradBucket:
    """One bucket as a comm hook sees it: the methods of ``torch.distributed.GradBucket``."""

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool, pre_divided: bool = False):
        self._index = index  # position in reduction order
        self._buffer = buffer  # the flat gradients, all of this bucket's parameters end to end
        self._gradients = gradients  # views into the buffer, shaped like the parameters
        self._parameters = parameters
        self._is_last = is_last  # hooks with per-step state (PowerSGD) count steps on the last bucket
        self.pre_divided = pre_divided  # miniddp only: already divided by the world size (the default path)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer  # torch's fp16_compress_wrapper swaps in a float16 copy
# --8<-- [end:grad_bucket]


class ByteCount:
    """Payload bytes handed to collectives by miniddp's hooks (and the reducer's used-counts), by collective.

    Payload is the size of the tensors passed in. What one rank puts on the
    wire depends on the algorithm: a ring all-reduce sends 2(n-1)/n of its
    payload, an all-gather n-1 times it (``wire_bytes``).
    """

    def __init__(self):
        self.by_op: dict[str, int] = {}  # "all_reduce" -> bytes

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def wire_bytes(self, world_size: int) -> float:
        """Bytes one rank sends with ring algorithms (gloo and NCCL both use rings for large messages)."""
        factor = {"all_reduce": 2 * (world_size - 1) / world_size, "all_gather": world_size - 1}
        return sum(n * factor.get(op.split()[0], 1) for op, n in self.by_op.items())


_counters: list[ByteCount] = []  # the open count_bytes() blocks of this process
_lock = threading.Lock()  # PowerSGD's second all-reduce is issued from a comm thread


@contextmanager
def count_bytes():
    """``with count_bytes() as sent: loss.backward()`` -> ``sent.total``, ``sent.by_op``."""
    counter = ByteCount()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def record(op: str, tensor: torch.Tensor) -> None:
    """Add ``tensor``'s bytes to every open ``count_bytes()``."""
    with _lock:
        for counter in _counters:
            counter.by_op[op] = counter.by_op.get(op, 0) + tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group) -> torch.futures.Future:
    """``dist.all_reduce(tensor, async_op=True)`` as a future, counted."""
    record("all_reduce", tensor)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def hook_name(hook) -> str:
    return getattr(hook, "__qualname__", repr(hook))


def hook_result(hook, index: int, value, buffer: torch.Tensor) -> torch.Tensor:
    """The tensor in a hook's completed future, checked against the bucket ``buffer`` it stands for."""
    tensor = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value  # c10d futures hold lists
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"comm hook {hook_name(hook)}'s future for bucket {index} holds {type(value).__name__}; "
                        "it must hold the averaged bucket as one tensor")
    if tensor.numel() != buffer.numel() or not tensor.is_floating_point():
        raise ValueError(f"comm hook {hook_name(hook)}'s future for bucket {index} holds a {tensor.dtype} tensor of "
                         f"{tensor.numel()} elements; it must hold the averaged buffer(): {buffer.numel()} elements "
                         f"of {buffer.dtype} (another floating dtype is cast back, as torch does)")
    return tensor


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


# --8<-- [start:allreduce]
def allreduce_hook(process_group, bucket) -> torch.futures.Future:
    """Average the bucket: divide by the world size, sum over ranks. Without a hook, DDP does this."""
    group = _group(process_group)
    tensor = bucket.buffer()
    if not getattr(bucket, "pre_divided", False):  # the reducer divided while copying in: not twice
        tensor.div_(group.size())  # before the sum, as torch does: no overflow in low precision
    return all_reduce(tensor, group).then(lambda fut: fut.value()[0])
# --8<-- [end:allreduce]


# --8<-- [start:compress]
def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future:
    """Cast to ``dtype`` (half the bytes), average, cast back into the bucket's own buffer."""
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())  # divide first: float16 overflows above 65504

    def decompress(fut):
        return buffer.copy_(fut.value()[0])  # in place: no second full-precision buffer

    return all_reduce(compressed, group).then(decompress)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future:
    """Send float16: 10 mantissa bits, range up to 65504 (gradients that underflow become 0)."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future:
    """Send bfloat16: float32's range, 7 mantissa bits. gloo sums bfloat16 (torch 2.13; torch's hook refuses gloo)."""
    return _compress_hook(torch.bfloat16, process_group, bucket)
# --8<-- [end:compress]


# --8<-- [start:in_call]
def issues_everything_in_call(hook) -> bool:
    """Does ``hook`` issue all its collectives before it returns (none from a future's callback)? Then the
    reducer may hand bucket k+1 over while bucket k still travels: the order of issue is the order of calls.
    True for the default path and the compression hooks (ours and torch's); PowerSGD is not."""
    if hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
        return True
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as theirs
    except ImportError:  # a torch without comm hooks
        return False
    return hook in (theirs.allreduce_hook, theirs.fp16_compress_hook)
# --8<-- [end:in_call]


from .powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook  # noqa: E402  (uses all_reduce above)

# --8<-- [start:by_name]
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")  # Accelerate's DDPCommunicationHookType


def hook_by_name(name: str, process_group=None, powersgd_rank: int = 1, powersgd_start_iter: int = 1_000):
    """``(state, hook)`` for a ``--ddp_comm_hook`` name (``None`` for "no"), as Accelerate's
    ``DistributedDataParallelKwargs(comm_hook=...)`` builds it; PowerSGD's state gets the rank and start step."""
    if name == "no":
        return None
    if name in ("fp16", "bf16"):
        return process_group, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[name]
    if name in ("power_sgd", "batched_power_sgd"):
        state = PowerSGDState(process_group, matrix_approximation_rank=powersgd_rank,
                              start_powerSGD_iter=powersgd_start_iter)
        return state, powerSGD_hook if name == "power_sgd" else batched_powerSGD_hook
    raise ValueError(f"ddp_comm_hook={name!r} must be one of {', '.join(COMM_HOOKS)}")
# --8<-- [end:by_name]


__all__ = ["COMM_HOOKS", "ByteCount", "GradBucket", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook",
           "bf16_compress_hook", "count_bytes", "fp16_compress_hook", "hook_by_name", "powerSGD_hook"]
