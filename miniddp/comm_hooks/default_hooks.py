"""The default hooks: average a bucket at full precision, or in float16 / bfloat16.

What
    ``allreduce_hook`` averages a bucket as torch's does: divide by the group size, all-reduce
    SUM. ``fp16_compress_hook`` and ``bf16_compress_hook`` send half the bytes and cast the
    average back. A hook gets the bucket undivided and divides it itself (torch's contract). Each
    declares that it issues its one collective inside the call (``call_order.py``).

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

from ..collectives.byte_count import all_reduce
from .call_order import issues_collectives_in_call


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


# --8<-- [start:allreduce]
@issues_collectives_in_call  # one all-reduce, issued before it returns
def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket: divide by the group size, then sum over ranks (torch's ``allreduce_hook``).
    DDP without a hook gives the same mean, dividing as it copies each gradient in (``Bucket.put``)."""
    group = _group(process_group)
    tensor = bucket.buffer()
    tensor.div_(group.size())  # mean = sum / N, divided first as torch does: no overflow in low precision
    return all_reduce(tensor, group).then(lambda fut: fut.value()[0])
# --8<-- [end:allreduce]


# --8<-- [start:compress]
def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Cast to ``dtype`` (half the bytes), average, cast back into the bucket's own buffer: torch's arithmetic,
    which the spec compares bit for bit: ``buffer.to(dtype).div_(group.size())`` (cast, then divide), all-reduce
    SUM that copy (only it is sent: the spec counts the bytes), then a future of ``buffer`` holding the mean."""
    ### BEGIN SOLUTION
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())  # divide first: float16 overflows above 65504

    def decompress(fut):
        return buffer.copy_(fut.value()[0])  # in place: no second full-precision buffer

    return all_reduce(compressed, group).then(decompress)
    ### END SOLUTION


@issues_collectives_in_call  # one all-reduce, issued before it returns
def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """``_compress_hook`` in float16: 10 mantissa bits, range up to 65504 (gradients that underflow become 0)."""
    ### BEGIN SOLUTION
    return _compress_hook(torch.float16, process_group, bucket)
    ### END SOLUTION


@issues_collectives_in_call  # one all-reduce, issued before it returns
def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """``_compress_hook`` in bfloat16: float32's range, 7 mantissa bits. gloo sums bfloat16 (torch's hook refuses
    gloo)."""
    ### BEGIN SOLUTION
    return _compress_hook(torch.bfloat16, process_group, bucket)
    ### END SOLUTION
# --8<-- [end:compress]
