"""The default hooks: average a bucket at full precision, or in float16 / bfloat16.

What
    ``allreduce_hook`` is what DDP does without a hook; ``fp16_compress_hook`` and
    ``bf16_compress_hook`` send half the bytes and cast the average back.
    ``issues_everything_in_call`` tells the reducer which hooks issue all their collectives
    inside the call (these) and which may issue more from a future's callback (PowerSGD).

Why
    On a slow link the all-reduce is the step: halving its bytes halves that part.

How torch differs
    Same functions as ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``. torch
    refuses ``bf16_compress_hook`` unless built with CUDA and NCCL >= 2.10 (a check on the hook's
    name in ``DistributedDataParallel._check_comm_hook``); gloo in torch 2.13 sums bfloat16, so ours
    runs on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .byte_count import all_reduce


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
