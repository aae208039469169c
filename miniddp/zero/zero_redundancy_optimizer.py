"""ZeRO stage 1 as torch builds it: each rank steps its own shard, then every parameter is broadcast from its owner.

What
    ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` wraps ``optimizer_class`` (``torch.optim.AdamW``,
    ...). Its ``param_groups`` are the whole model's; a local ``optimizer_class`` instance (``self.optim``) holds
    only the parameters this rank owns (``zero_partition.partition_by_size``). ``step()`` updates the owned shard
    from the (already averaged) gradients, then every parameter is broadcast from its owner, so every rank ends
    the step with the same full model. It is a ``Joinable``: a rank out of data answers those broadcasts.

Why
    Plain data parallelism repeats the optimizer state on every rank: with Adam, two fp32 values per parameter,
    more than the parameters themselves. ZeRO-1 (Rajbhandari et al., arXiv 1910.02054, "P_os") stores it once
    across the ranks, about ``1/world_size`` per rank, for one broadcast of the parameters per step.

How torch differs
    torch's ``torch/distributed/optim/zero_redundancy_optimizer.py`` has the same partition, the same
    per-parameter broadcasts in rank order, and the same ``consolidate_state_dict`` / ``state_dict`` format
    (global parameter indices). We refuse ``parameters_as_bucket_view=True`` and ``overlap_with_ddp=True`` (torch:
    flat buckets per rank; the step inside DDP's comm hook), and the functional optimizers they need. torch's join
    hook steps at every round; ours only when the active ranks' backward syncs (a step follows it), so gradient
    accumulation under ``no_sync`` does not unpair the broadcasts. Like torch's, a joined rank steps its shard with
    whatever ``.grad`` it last had (``None`` after ``zero_grad()``: no update), since DDP's join lands no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.join import Joinable, JoinHook, Round
from ..process_group.clean_exit import group_or_default
from .zero_partition import partition_by_size


class ZeroRedundancyJoinHook(JoinHook):
    """A joined rank's share of one iteration: the step's broadcasts (torch: ``_ZeROJoinHook``)."""

    round_flags = ("will_sync",)  # the active ranks' backward synced, so their step follows (DDP's flag, or ours)

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self, plan: Round) -> None:
        if plan.flags["will_sync"]:  # the active ranks' backward synced: their step (and its broadcasts) follows
            self.zero.step()


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """ZeRO-1 with torch's signature; see the module docstring."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults):
        for name, value in (("parameters_as_bucket_view", parameters_as_bucket_view),
                            ("overlap_with_ddp", overlap_with_ddp)):
            if value:
                raise NotImplementedError(f"ZeroRedundancyOptimizer({name}=True) is not implemented in miniddp; "
                                          f"leave {name}=False (per-parameter broadcasts after a plain step)")
        self.initialized = False  # add_param_group, called by Optimizer.__init__, partitions only once we are set up
        self.optimizer_class = optimizer_class  # the local optimizer's class, e.g. torch.optim.AdamW
        self._process_group = process_group  # None: the default group, looked up at each use (as DDP's)
        self._all_state_dicts: list[dict] = []  # the ranks' local state dicts, on the consolidating rank only
        super().__init__(params, defaults)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._partition()
        self.optim = optimizer_class(self._local_groups(), **defaults)  # our shard's optimizer and its state
        self.initialized = True

    @property
    def process_group(self):
        return group_or_default(self._process_group)

    def _partition(self) -> None:
        """``self.owned[rank][group]``: the parameters of each group each rank owns (``partition_by_size``)."""
        ### BEGIN SOLUTION
        self.owned = partition_by_size(self.param_groups, self.world_size)  # owned[rank][group]: parameters
        ### END SOLUTION
        self.params = [p for group in self.param_groups for p in group["params"]]  # global index -> parameter

    def _local_groups(self) -> list[dict]:
        """This rank's param groups: each global group's options with only the parameters we own (maybe none)."""
        ### BEGIN SOLUTION
        return [{**group, "params": mine} for group, mine in zip(self.param_groups, self.owned[self.rank])]
        ### END SOLUTION

    def _copy_options(self, source: list[dict], target: list[dict]) -> None:
        """Options (lr, betas, ... as a scheduler changes them) from one list of groups to the other."""
        for src, dst in zip(source, target):
            dst.update({k: v for k, v in src.items() if k != "params"})

    def add_param_group(self, param_group: dict) -> None:
        """Add a group on every rank (a collective afterwards): the new parameters are partitioned after the
        existing ones, which keep their owners (the running sizes are replayed group by group)."""
        super().add_param_group(param_group)
        if self.initialized:
            self._partition()
            self.optim.add_param_group(self._local_groups()[-1])

    # --8<-- [start:step]
    def step(self, closure=None, **kwargs):
        """Step our shard with the local optimizer, then broadcast every parameter from its owner, rank by rank."""
        if self.join_context is not None and self.join_context.joinables[0] is self:
            self.join_context.notify(will_sync=True)  # alone in Join: this step is the iteration
        ### BEGIN SOLUTION
        self._copy_options(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._copy_options(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss
        ### END SOLUTION

    def _sync_params(self) -> None:
        """Every rank receives every other rank's updated shard: one broadcast per parameter, the same order on
        every rank (owner by owner, group by group, the partition's order)."""
        ### BEGIN SOLUTION
        group = self.process_group
        handles = []
        for owner in range(self.world_size):
            source = dist.get_global_rank(group, owner)
            for params in self.owned[owner]:
                handles += [dist.broadcast(p.detach(), src=source, group=group, async_op=True) for p in params]
        for handle in handles:
            handle.wait()
        ### END SOLUTION
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient, owned or not (the backward writes them all)."""
        super().zero_grad(set_to_none=set_to_none)

    # --8<-- [start:state_dict]
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local state dict on rank ``to`` (a collective: call it on every rank)."""
        local = _to_cpu(self.optim.state_dict())
        gathered = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(self.process_group, to),
                           group=self.process_group)
        self._all_state_dicts = gathered if self.rank == to else []

    def state_dict(self) -> dict:
        """The whole optimizer's state, in ``torch.optim``'s format (``state`` keyed by the global parameter index,
        ``param_groups`` with global indices), on the rank that consolidated; a ``RuntimeError`` elsewhere."""
        if not self._all_state_dicts:
            raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first")
        index = {id(p): i for i, p in enumerate(self.params)}
        state = {}
        for rank, local in enumerate(self._all_state_dicts):
            local_params = [p for params in self.owned[rank] for p in params]  # the local optimizer's indices
            for local_index, value in local["state"].items():
                state[index[id(local_params[local_index])]] = value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep the state of the parameters this rank owns (re-partitioned here, so any world size works) and
        every group's options; call it on every rank with the same ``state_dict``."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        self._copy_options(state_dict["param_groups"], self.param_groups)
        self._copy_options(self.param_groups, self.optim.param_groups)
        mine = {id(p) for params in self.owned[self.rank] for p in params}
        self.optim.state.clear()
        for i, value in state_dict["state"].items():
            param = self.params[int(i)]
            if id(param) in mine:
                self.optim.state[param] = {k: _placed(v, param.device) for k, v in value.items()}
    # --8<-- [end:state_dict]

    # --8<-- [start:join]
    def join_hook(self, **kwargs) -> ZeroRedundancyJoinHook:
        return ZeroRedundancyJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.params[0].device

    @property
    def join_process_group(self):
        return self.process_group
    # --8<-- [end:join]


def _to_cpu(value):
    """A copy of a (nested) state dict with its tensors on the CPU, for pickling to another rank."""
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _placed(value, device: torch.device):
    """A state tensor on its parameter's device; 0-d ones (Adam's ``step``) stay on the CPU, as torch keeps them."""
    if torch.is_tensor(value) and value.dim() > 0:
        return value.detach().clone().to(device)
    return value.detach().clone() if torch.is_tensor(value) else value
