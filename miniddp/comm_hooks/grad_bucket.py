"""The comm hook contract: ``hook(state, bucket) -> Future[Tensor]`` and the bucket it receives.

What
    ``GradBucket`` has the methods of ``torch.distributed.GradBucket`` (``index()``,
    ``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``), so
    torch's own hooks run unchanged. ``checked_future`` checks what a hook returns, ``hook_result``
    what its future holds.

Why
    The hook is the one place to change what crosses the wire (compression, another
    collective) without touching bucketing, overlap or ordering around it.

How torch differs
    torch's ``GradBucket`` is a C++ object (``torch/csrc/distributed/c10d/comm.hpp``) made by
    ``reducer.cpp``; its checks of a hook's result are C++ ``TORCH_CHECK``s.
"""

from __future__ import annotations

import inspect

import torch


# --8<-- [start:grad_bucket]
class GradBucket:
    """One bucket as a comm hook sees it: the methods of ``torch.distributed.GradBucket``."""

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool):
        self._index = index  # position in reduction order
        self._buffer = buffer  # the flat gradients, all of this bucket's parameters end to end
        self._gradients = gradients  # views into the buffer, shaped like the parameters
        self._parameters = parameters
        self._is_last = is_last  # hooks with per-step state (PowerSGD) count steps on the last bucket

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


def hook_name(hook) -> str:
    """How errors name a hook; ``None`` is the reducer's default path (a SUM all-reduce, no hook)."""
    return "(the default all-reduce)" if hook is None else getattr(hook, "__qualname__", repr(hook))


def _what(hook) -> str:
    """The subject of an error about a bucket's future: the comm hook, or, with none registered, the
    reducer's own all-reduce (a learner who registered no hook must not read of one)."""
    return "the reducer's all-reduce" if hook is None else f"comm hook {hook_name(hook)}"


# --8<-- [start:registration]
def check_registration(state, hook, *, registered: bool, started: bool) -> None:
    """What ``register_comm_hook`` refuses, as torch does: a non-callable, a hook that cannot take
    ``(state, bucket)``, a second hook, or one registered after the first forward."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
    try:
        inspect.signature(hook).bind(state, None)
    except TypeError as err:
        raise TypeError(f"register_comm_hook: hook must take (state, bucket): {err}") from None
    except ValueError:  # a callable without an inspectable signature: find out when it is called
        pass
    if registered:
        raise RuntimeError("register_comm_hook can only be called once per model (torch: the same); "
                           "to change the hook, wrap the model again")
    if started:
        raise RuntimeError("register_comm_hook must be called before the first forward: a hook with state "
                           "(PowerSGD's error feedback, its step count) has to see every step")
# --8<-- [end:registration]


def checked_future(hook, future, index: int):
    """``future``, if ``hook`` returned one for bucket ``index``; else a TypeError saying what a hook returns."""
    if not isinstance(future, torch._C.Future):
        raise TypeError(f"{_what(hook)} returned {type(future).__name__} for bucket {index}: a hook "
                        "returns a torch.futures.Future of the averaged bucket, e.g. "
                        "dist.all_reduce(bucket.buffer(), async_op=True).get_future()")
    return future


def hook_result(hook, index: int, value, buffer: torch.Tensor) -> torch.Tensor:
    """The tensor in a hook's completed future, checked against the bucket ``buffer`` it stands for."""
    tensor = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value  # c10d futures hold lists
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_what(hook)}'s future for bucket {index} holds {type(value).__name__}; "
                        "it must hold the averaged bucket as one tensor")
    if tensor.numel() != buffer.numel() or not tensor.is_floating_point():
        raise ValueError(f"{_what(hook)}'s future for bucket {index} holds a {tensor.dtype} tensor of "
                         f"{tensor.numel()} elements; it must hold the averaged buffer(): {buffer.numel()} elements "
                         f"of {buffer.dtype} (another floating dtype is cast back, as torch does)")
    return tensor
