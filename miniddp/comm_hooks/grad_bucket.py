"""The comm hook contract: ``hook(state, bucket) -> Future[Tensor]`` and the bucket it receives.

What
    ``GradBucket`` has the methods of ``torch.distributed.GradBucket`` (``index()``,
    ``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``), so
    torch's own hooks run unchanged. ``check_registration`` is what ``register_comm_hook`` refuses,
    ``checked_future`` checks what a hook returns, ``hook_result`` what its future holds.

Why
    The hook is the one place to change what crosses the wire (compression, another
    collective) without touching bucketing, overlap or ordering around it.

How torch differs
    torch's ``GradBucket`` is a C++ object (``torch/csrc/distributed/c10d/comm.hpp``) made by
    ``reducer.cpp``; its checks of a hook's result are C++ ``TORCH_CHECK``s. Its registration checks
    (``_check_comm_hook`` in ``torch/nn/parallel/distributed.py``) compare annotations as written: one that
    ``from __future__ import annotations`` turned into a string is refused there, evaluated here; miniddp's
    ``GradBucket`` is accepted beside torch's. The errors have torch's types and start with torch's words.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist


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
    """What ``register_comm_hook`` refuses, with torch's types and torch's words first: a non-callable, a hook
    that cannot take ``(state, bucket)``, a ``bucket`` or return annotation other than torch's contract, a second
    hook, or one registered after the first forward."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. Got a {type(hook).__name__}: pass a function "
                        "hook(state, bucket) -> torch.futures.Future[torch.Tensor]")
    signature = _signature(hook)
    if signature is not None:
        try:
            bound = signature.bind(state, None)
        except TypeError as err:
            raise TypeError(f"register_comm_hook: hook must take (state, bucket): {err}") from None
        _check_annotations(signature, list(bound.arguments))
    if registered:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once. A model has "
                           "one comm hook; to change it, wrap the model again")
    if started:
        raise RuntimeError("register_comm_hook must be called before the first forward: a hook with state "
                           "(PowerSGD's error feedback, its step count) has to see every step")


def _signature(hook) -> inspect.Signature | None:
    """The hook's signature, its annotations evaluated (``from __future__ import annotations`` makes them strings);
    as written if they do not evaluate here; None if it has none (a builtin: found out when it is called)."""
    for eval_str in (True, False):
        try:
            return inspect.signature(hook, eval_str=eval_str)
        except ValueError:
            return None
        except Exception:  # noqa: BLE001 - an annotation that fails to evaluate: read them as written
            continue
    return None


def _check_annotations(signature: inspect.Signature, names: list[str]) -> None:
    """torch's ``_check_comm_hook``: an annotated bucket is a ``GradBucket`` (torch's, or miniddp's, which has its
    methods), an annotated return a ``torch.futures.Future[torch.Tensor]``. An annotation still a string (it did
    not evaluate) is not judged; torch compares the string itself and refuses it."""
    empty = inspect.Parameter.empty
    bucket = signature.parameters[names[1]].annotation if len(names) > 1 else empty  # the parameter bound to it
    if not isinstance(bucket, str) and bucket not in (empty, dist.GradBucket) and not (
            isinstance(bucket, type) and issubclass(bucket, GradBucket)):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket. Got {bucket!r}; "
                         "miniddp's comm_hooks.GradBucket is accepted too")
    returned = signature.return_annotation
    if not isinstance(returned, str) and returned is not empty and returned != torch.futures.Future[torch.Tensor]:
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
                         f"Got {returned!r}: a hook returns a future of the averaged bucket")
# --8<-- [end:registration]


def checked_future(hook, future, index: int):
    """``future``, if ``hook`` returned one for bucket ``index``; else torch's RuntimeError, which names what a
    hook returns."""
    if not isinstance(future, torch._C.Future):
        raise RuntimeError(f"callback must return a torch.futures.Future object, but got {type(future).__name__}: "
                           f"{_what(hook)} returned it for bucket {index}; a hook returns a torch.futures.Future of "
                           "the averaged bucket, e.g. dist.all_reduce(bucket.buffer(), async_op=True).get_future()")
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
