"""``FSDPState``: the hooks around each unit's forward and backward, the root's end of backward, and prefetch.

What
    Every unit's module gets a forward pre-hook (gather; cast floating inputs to ``param_dtype``; pass the inputs
    through an identity whose backward frees the unit: its whole backward is then done) and a forward hook
    (free the parameters unless ``reshard_after_forward=False`` or the unit is the root; hooks on the outputs'
    gradients that gather again before the unit's backward). The root, the outermost unit, is found at the first
    forward; it owns the step: at the first backward hook it queues a callback for the end of the backward, which
    reduce-scatters what no hook did yet, waits for every reduce-scatter (so the optimizer may step as soon as
    ``backward()`` returns) and registers the shards everywhere. Prefetch: the first step records the order in which
    units run their forward and their backward, and checks it is the same on every rank; from then on each unit,
    before it computes, posts the all-gather of the unit that comes next, so that it travels while this one
    computes. A unit that runs out of the recorded order is refused; so is, in the first step, a unit that is not
    the one every other rank runs at that point (a small all-gather per unit, once).

Why
    Without prefetch every all-gather waits in line before its unit computes; with it only the first one does (the
    Ultra-Scale Playbook, "ZeRO-3": "prefetching"). The same order on every rank is what keeps the ranks' collectives
    paired.

How torch differs
    FSDP2 (``_fully_shard/_fsdp_state.py``) prefetches one unit ahead in the backward by the reverse of the forward
    order, and in the forward only where ``set_modules_to_forward_prefetch`` says; it runs the end of the backward
    through ``Variable._execution_engine.queue_callback`` as here, and it does not check that ranks agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .fsdp_param_group import FSDPParamGroup, prefetch


class UnitOrderError(RuntimeError):
    """A unit ran where the recorded order has another, or ranks recorded different orders."""


class FSDPState:
    """One per ``fully_shard`` call: its unit, and, for the root, every unit below it and the recorded orders."""

    def __init__(self, module: torch.nn.Module, unit: FSDPParamGroup):
        self.module, self.unit = module, unit
        self.root: FSDPState | None = None  # found at the first forward
        self.units: list[FSDPState] = []  # the root's: every state in its tree, itself first
        self.orders = {"forward": [], "backward": []}  # the root's: units in the order they ran
        self.recorded = {"forward": False, "backward": False}
        self.position = {"forward": 0, "backward": 0}
        self.callback_queued = False
        # looked up at each call, not bound now: a test (or an exercise) may swap the methods of the class
        module.register_forward_pre_hook(lambda m, args, kwargs: self._pre_forward(m, args, kwargs), prepend=True,
                                         with_kwargs=True)
        module.register_forward_hook(lambda m, args, output: self._post_forward(m, args, output))

    # --8<-- [start:forward]
    def _pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._find_root()
        root, recompute = self.root, _in_backward()  # recompute: activation checkpointing runs it again
        if root is self and not recompute:
            root.position["forward"] = 0
        self.unit.ran = True
        if not recompute:
            root._advance("forward", self)  # ours posted first (if not prefetched), the next unit's behind it
        self.unit.unshard()
        dtype = self.unit.policy.param_dtype
        if dtype is not None:
            args, kwargs = tree_map(lambda x: _cast(x, dtype), (args, kwargs))
        if torch.is_grad_enabled() and not self.unit.in_backward:
            args, kwargs = _after_their_backward(self.unit, (args, kwargs))
        return args, kwargs

    def _post_forward(self, module, args, output):
        root, unit = self.root, self.unit
        if unit.in_backward:  # recomputed by activation checkpointing: the backward is about to use them
            return output
        recompute = _in_backward()  # reentrant checkpointing: its backward of these outputs follows at once
        outputs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if not torch.is_grad_enabled() or not outputs:  # no backward will come: back to the shards
            if root is self:
                root._end_forward_only()
            elif unit.reshard_after_forward:
                unit.reshard()
            return output
        for t in outputs:
            t.register_hook(self._pre_backward)
        if unit.reshard_after_forward and root is not self and not recompute:
            unit.reshard(mid_step=True)
        if root is self:
            root.recorded["forward"] = True
        return output
    # --8<-- [end:forward]

    # --8<-- [start:backward]
    def _pre_backward(self, grad):
        root, unit = self.root, self.unit
        if not root.callback_queued:
            root.callback_queued = True
            root.position["backward"] = 0
            torch.autograd.Variable._execution_engine.queue_callback(root._end_backward)
        if not unit.in_backward:
            unit.in_backward = True
            root._advance("backward", self)
            unit.unshard()
        return grad

    def _end_backward(self) -> None:
        """The root, when the whole backward is done: every unit's gradients sent and landed, shards registered."""
        ran = [s.unit for s in self.units if s.unit.ran]
        for unit in ran:
            if not unit.reduced:  # parameters no gradient reached (or the root's): their zeros are sent
                unit.reduce_gradients()
        for unit in ran:
            unit.land_gradients()
        for state in self.units:
            state.unit.reshard()
            state.unit.end_step()
        self.callback_queued = False
        self.recorded["backward"] = True
    # --8<-- [end:backward]

    # --8<-- [start:prefetch]
    def _advance(self, phase: str, state: FSDPState) -> None:
        """The root: ``state``'s unit runs now in ``phase``; record it (first step) or post the next one's gather."""
        order, at = self.orders[phase], self.position[phase]
        self.position[phase] = at + 1
        if not self.recorded[phase]:
            self._agree(phase, at, state)
            order.append(state)
            return
        if at >= len(order) or order[at] is not state:
            expected = order[at].unit.name if at < len(order) else "nothing"
            raise UnitOrderError(f"fully_shard: unit {state.unit.name!r} ran {phase} step {at + 1} where the first "
                                 f"step ran {expected!r}: prefetch needs the same order of units every step")
        state.unit.issue_gather()  # ours first (a no-op if it was prefetched), then the next one behind it
        prefetch([s.unit for s in order], at)
    # --8<-- [end:prefetch]

    def _end_forward_only(self) -> None:
        for state in self.units:
            state.unit.reshard()
            state.unit.end_step()
        self.recorded["forward"] = True

    def _find_root(self) -> None:
        """The first unit to run forward is the root: every unit in its module's tree is its, named by its path."""
        self.units = []
        for path, module in self.module.named_modules():
            state = getattr(module, "_fsdp_state", None)
            if state is None:
                continue
            if state.root is not None and state is not self:
                raise RuntimeError(f"fully_shard: {state.unit.name!r} already ran under another root: call the "
                                   "outermost fully_shard module, every step")
            state.root = self
            state.unit.name = path or "the root"
            for p in state.unit.params:
                p.name = f"{path}.{p.name}" if path else p.name
            self.units.append(state)

    def _agree(self, phase: str, at: int, state: FSDPState) -> None:
        """First step only: every rank runs the same unit here (one small all-gather), before any of its collectives
        could pair with another unit's on another rank."""
        group = self.unit.group
        mine = torch.tensor([self.units.index(state)], dtype=torch.int64, device=self.unit.device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        differ = [r for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
        if differ:
            names = [self.units[int(t)].unit.name for t in everyone]
            raise UnitOrderError(f"fully_shard: in the first step's {phase}, unit {at + 1} is {names[0]!r} on rank 0 "
                                 f"but another on ranks {differ} ({names}): every rank must run the same units in "
                                 "the same order")


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward runs once their gradient is computed: the unit's is done."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


def _after_their_backward(unit, inputs):
    """``inputs`` with the tensors that require a gradient passed through ``_PostBackward``."""
    flat, spec = tree_flatten(inputs)
    where = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
    if where:
        for i, out in zip(where, _PostBackward.apply(unit, *(flat[i] for i in where))):
            flat[i] = out
    return tree_unflatten(flat, spec)


def _in_backward() -> bool:
    """Inside a backward (a hook, or a forward that checkpointing recomputes there)."""
    return torch._C._current_graph_task_id() != -1


def _cast(x, dtype):
    return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
