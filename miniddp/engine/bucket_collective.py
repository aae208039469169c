"""A bucket's collective: what goes on the wire for a complete bucket, and where its result lands. The reducer's
second seam.

What
    ``BucketCollective`` is what the reducer asks of a complete bucket, and all it asks: ``name`` (how labels
    and stall errors call it: "bucket 3 all-reduce"), ``divisor`` (each gradient is divided by it on its way
    into the bucket), ``issue(bucket, flat, is_last, group)`` (start the collective, return its future),
    ``result(bucket, value)`` (the completed future's tensor, checked) and ``land(bucket, result, counts,
    as_view)`` (where the result goes). ``call_order``: may the next bucket go out while this one's future is
    pending (``comm_hooks/call_order.py``). The reducer takes one through ``Reducer.set_collective``. Two
    implementations here:

    - ``AllReduceMean``, the default path: divided by N on the way in, one SUM all-reduce, the mean written
      back whole into every ``.grad``; ``dividing_by(n)`` is the same with another N (join's active ranks);
    - ``CommHook``: a registered hook gets the undivided bucket and returns a future of its mean (torch's
      contract), written back whole.

    ZeRO-2 is the third (``zero/gradient_shards.py``): a reduce-scatter of each bucket, divided on the way in,
    after which each rank ``land``s only its own shard of the mean. What only one client asks lives with that
    client: join's questions (``dividing_by``, ``land_joined``) are the ``JoinAware`` protocol of
    ``ddp_join.py``; who set the collective, and which comm hook is registered, are the reducer's record
    (``Reducer.set_collective``, ``set_comm_hook``); ZeRO-2's memory is an observer of the reducer.

Why
    The reducer's order (buckets complete, go out in bucket order, are waited for at the end of backward) is
    the same whatever crosses the wire; what crosses it, and what each rank keeps, is the part that changes
    from plain DDP to compression hooks to sharded gradients.

How torch differs
    ``reducer.cpp`` holds one ``comm_hook_``: without a registered one it runs the built-in all-reduce
    (``_AllReduceBySumCommHook``, dividing by ``div_factor_`` on the way in), and always copies the future's
    tensor back into the bucket (``finalize_bucket_dense``). ZeRO-2 is not in torch's DDP: DeepSpeed's
    stage 2 (``deepspeed/runtime/zero/stage_1_and_2.py``) reduce-scatters its own buckets from its own hooks.
"""

from __future__ import annotations

import torch

from ..collectives.byte_count import all_reduce
from ..comm_hooks.call_order import CallOrder
from ..comm_hooks.grad_bucket import checked_future, hook_result


# --8<-- [start:interface]
class BucketCollective:
    """The interface; the answers here are those every implementation so far shares."""

    name = "collective"  # how labels and stall errors call it: "bucket 3 all-reduce"
    divisor = 1  # each gradient is divided by this on its way into the bucket
    call_order = CallOrder(None)  # the next bucket may go out before this one's future completes

    def issue(self, bucket, flat: torch.Tensor, is_last: bool, group) -> torch.futures.Future:
        """Start the collective of ``bucket`` on ``flat`` (its buffer, or zeros of its layout); return a future."""
        raise NotImplementedError

    def result(self, bucket, value) -> torch.Tensor:
        """The tensor in the completed future, checked against the bucket."""
        return hook_result(None, bucket.index, value, bucket.buffer)

    def land(self, bucket, result: torch.Tensor, counts: list[int], as_view: bool) -> None:
        """Where the result goes: here, the mean written back whole into each parameter's ``.grad``."""
        bucket.write_back(result, counts, as_view)
# --8<-- [end:interface]


class AllReduceMean(BucketCollective):
    """The default path: divided by N on the way in, so a SUM all-reduce gives the mean."""

    name = "all-reduce"

    def __init__(self, divisor: int):
        self.divisor = divisor  # the world size, or the ranks still active (join)

    def issue(self, bucket, flat, is_last, group):
        return all_reduce(flat, group)

    # join's protocol (ddp_join.JoinAware): the mean over the ranks still active, and nothing lands on a
    # joined rank, whose .grad stays as it was
    def dividing_by(self, n: int) -> AllReduceMean:
        return AllReduceMean(n)

    def land_joined(self, bucket, result: torch.Tensor, counts: list[int]) -> None:
        pass


class CommHook(BucketCollective):
    """A registered hook: ``hook(state, GradBucket)`` returns a future of the bucket's mean (torch's contract).
    Under join it is used unchanged: the hook divides by itself, as torch's hooks do."""

    name = "comm hook"

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        self.call_order = CallOrder(hook)  # only a hook that issues everything inside the call overlaps

    def issue(self, bucket, flat, is_last, group):
        return checked_future(self.hook, self.hook(self.state, bucket.for_hook(is_last, flat)), bucket.index)

    def result(self, bucket, value) -> torch.Tensor:
        return hook_result(self.hook, bucket.index, value, bucket.buffer)


def collective_for(state, hook, world_size: int) -> BucketCollective:
    """A registered ``hook``'s collective, or the default path's (``hook`` None)."""
    return AllReduceMean(world_size) if hook is None else CommHook(state, hook)
