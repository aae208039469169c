"""``FSDPParamGroup``: one unit's parameters, gathered before it computes and reduce-scattered after its backward.

What
    A unit (one ``fully_shard`` call) owns ``FSDPParam``s. ``issue_gather`` posts one all-gather of its shards, cast
    to ``param_dtype`` and laid end to end, and returns at once (a prefetch); ``unshard`` waits for it, copies each
    parameter's rows into its full tensor and registers the full tensors under the module's names. ``reshard`` gives
    their memory back: between steps the shards are registered again, mid-step (after the forward, before the
    backward) a ``FreedParameter`` is. ``reduce_gradients`` runs once the unit's backward has left every gradient:
    the full gradients, padded and cast to ``reduce_dtype``, laid out rank by rank, one reduce-scatter posted (the
    parameters are freed once the gradient of the unit's inputs is computed too: ``post_backward``); this
    rank's sum lands later (``land_gradients``), divided by the world size and cast to the shard's dtype, in (or
    added to) ``shard.grad``. Without sync the gradients stay full, accumulated in ``reduce_dtype``.

Why
    Gather, compute, discard: only the unit that computes is ever whole. One collective per unit, not one per
    parameter, keeps the count of messages at that of DDP's buckets (the unit is FSDP's bucket).

How torch differs
    FSDP2's ``FSDPParamGroup`` (``_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``) does the same with
    copy-in/copy-out kernels and streams, and fires the post-backward from an autograd function on the unit's
    inputs, as here for the reshard (after the unit's whole backward); the reduce-scatter here starts as soon as a
    hook on each full tensor has counted every gradient in (the root's end-of-backward callback takes the rest).
    torch divides by the world size around a sum as well where the backend has no average.
"""

from __future__ import annotations

import torch

from ..collectives.shard_collectives import all_gather, reduce_scatter
from .fsdp_param import FSDPParam
from .mixed_precision import MixedPrecisionPolicy


class FSDPParamGroup:
    """A unit: its ``FSDPParam``s, their state (sharded, gathering, unsharded) and their pending collectives."""

    def __init__(self, params: list[FSDPParam], name: str, group, world_size: int, policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool):
        self.params, self.name, self.group, self.world_size = params, name, group, world_size
        self.device = params[0].shard.device if params else torch.device("cpu")  # its collectives' tensors
        self.policy, self.reshard_after_forward = policy, reshard_after_forward
        self.grad_params = [p for p in params if p.requires_grad]
        self.offsets = _offsets([p.shard_numel for p in params])
        self.grad_offsets = _offsets([p.shard_numel for p in self.grad_params])
        self.state = "sharded"  # "gathering" (an all-gather in flight) or "unsharded"
        self.pending_gather = None  # (work, flat output)
        self.pending_reduce = None  # (future, flat output)
        self.requires_gradient_sync = True
        self.arrived: set[int] = set()  # ids of full tensors whose gradient this backward left
        self.ran = self.reduced = self.in_backward = False  # this step: forward ran, gradients sent, backward began
        self.inputs_done = False  # this step: the gradient of the unit's inputs is computed
        for p in self.grad_params:
            p.unsharded.register_post_accumulate_grad_hook(self._on_gradient)

    # --8<-- [start:gather]
    def issue_gather(self) -> None:
        """Post the all-gather of every shard (cast to the compute dtype); a no-op if gathered or in flight."""
        if self.state != "sharded" or not self.params:
            return
        ### BEGIN SOLUTION
        dtype = self.params[0].unsharded.dtype
        mine = torch.cat([p.shard.detach().reshape(-1).to(dtype) for p in self.params])
        out = mine.new_empty(self.world_size * mine.numel())
        self.pending_gather = (all_gather(out, mine, self.group), out)
        self.state = "gathering"
        ### END SOLUTION

    def unshard(self) -> None:
        """The full parameters, registered under the module's names (waiting for a prefetched gather)."""
        ### BEGIN SOLUTION
        self.issue_gather()
        if self.state == "gathering":
            work, out = self.pending_gather
            work.wait()
            rows = out.view(self.world_size, -1)
            for p, start in zip(self.params, self.offsets):
                p.fill(rows[:, start : start + p.shard_numel])
            self.pending_gather, self.state = None, "unsharded"
        for p in self.params:
            p.register("unsharded")
        ### END SOLUTION

    def reshard(self, mid_step: bool = False) -> None:
        """Free the full parameters; register the shards (between steps) or a ``FreedParameter`` (mid-step)."""
        ### BEGIN SOLUTION
        if self.state == "gathering":  # a prefetch nobody used: it is a collective, so it is finished
            self.pending_gather[0].wait()
            self.pending_gather = None
        for p in self.params:
            p.free()
            p.register("freed" if mid_step else "shard")
        self.state = "sharded"
        ### END SOLUTION
    # --8<-- [end:gather]

    # --8<-- [start:reduce]
    def _on_gradient(self, full: torch.Tensor) -> None:
        self.arrived.add(id(full))
        if len(self.arrived) == len(self.grad_params) and not self.reduced:  # every gradient is in: send them
            self.reduce_gradients()
            self._reshard_after_backward()

    def post_backward(self) -> None:
        """The gradient of the unit's inputs is computed: nothing in the unit's backward reads its parameters any
        more (a frozen one included, which no gradient count would wait for)."""
        self.inputs_done = True
        self._reshard_after_backward()

    def _reshard_after_backward(self) -> None:
        if self.reduced and self.inputs_done:
            self.reshard()

    def reduce_gradients(self) -> None:
        """Post the reduce-scatter of the unit's full gradients (zeros for one that got none), or, without sync,
        keep them for the next backward."""
        self.reduced = True
        ### BEGIN SOLUTION
        if not self.grad_params:
            return
        dtype = self.policy.gradient_dtype(self.grad_params[0].dtype)
        if not self.requires_gradient_sync:
            for p in self.grad_params:
                p.keep_gradient(dtype)
            return
        total = sum(p.shard_numel for p in self.grad_params)
        send = torch.empty(self.world_size, total, dtype=dtype, device=self.device)  # row r: rank r's pieces
        for p, start in zip(self.grad_params, self.grad_offsets):
            p.write_gradient(send[:, start : start + p.shard_numel])
        out = send.new_empty(total)
        self.pending_reduce = (reduce_scatter(out, send.view(-1), self.group), out)
        ### END SOLUTION

    def land_gradients(self) -> None:
        """Wait for the reduce-scatter; this rank's sum over ranks, divided by N, into (or onto) ``shard.grad``."""
        ### BEGIN SOLUTION
        if self.pending_reduce is None:
            return
        future, out = self.pending_reduce
        future.wait()
        self.pending_reduce = None
        out.div_(self.world_size)
        for p, start in zip(self.grad_params, self.grad_offsets):
            mean = out[start : start + p.shard_numel].view(p.shard_shape).to(p.shard.dtype)
            p.shard.grad = mean if p.shard.grad is None else p.shard.grad.add_(mean)
        ### END SOLUTION
    # --8<-- [end:reduce]

    def end_step(self) -> None:
        self.arrived.clear()
        self.ran = self.reduced = self.in_backward = self.inputs_done = False


# --8<-- [start:prefetch]
def prefetch(order: list[FSDPParamGroup], at: int) -> None:
    """``order[at]``, a unit of the order recorded in the first step, is about to compute: post the gather of the
    unit that runs after it, so that it travels while this one computes (after the last unit, nothing)."""
    ### BEGIN SOLUTION
    if at + 1 < len(order):
        order[at + 1].issue_gather()
    ### END SOLUTION
# --8<-- [end:prefetch]


def _offsets(sizes: list[int]) -> list[int]:
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts
