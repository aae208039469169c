"""An independent correct solution of ``sharded_optimizer``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: the partition is written out with a heap of (load, rank) instead of calling
``partition_by_size``; the local groups are built key by key; the step copies the options in only; the
parameters travel as one flat broadcast per owner and dtype (packed with ``torch.cat``, unpacked by each
non-owner) instead of one broadcast per parameter. The rest of the class is the skeleton's as
``miniddp exercise start sharded_optimizer`` writes it today.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from ..engine.join import Joinable, JoinHook, Round
from ..process_group.clean_exit import group_or_default


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
        # Greedy by size, written out: a heap of (elements so far, rank) gives the least loaded rank, the lowest
        # on ties; the loads carry over from group to group, so a new group leaves the old owners alone.
        loads = [(0, rank) for rank in range(self.world_size)]
        owned = [[[] for _ in self.param_groups] for _ in range(self.world_size)]
        for g, group in enumerate(self.param_groups):
            order = sorted(range(len(group["params"])), key=lambda i: (-group["params"][i].numel(), i))
            for i in order:
                load, rank = heapq.heappop(loads)
                owned[rank][g].append(group["params"][i])
                heapq.heappush(loads, (load + group["params"][i].numel(), rank))
        self.owned = owned
        self.params = [p for group in self.param_groups for p in group["params"]]  # global index -> parameter

    def _local_groups(self) -> list[dict]:
        """This rank's param groups: each global group's options with only the parameters we own (maybe none)."""
        groups = []
        for g, group in enumerate(self.param_groups):
            local = {key: value for key, value in group.items() if key != "params"}
            local["params"] = list(self.owned[self.rank][g])
            groups.append(local)
        return groups

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
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value
        loss = self.optim.step(closure, **kwargs) if closure is not None else self.optim.step(**kwargs)
        self._sync_params()
        return loss

    def _sync_params(self) -> None:
        """Every rank receives every other rank's updated shard: one flat broadcast per owner and dtype, packed
        and unpacked in the partition's order on every rank."""
        group = self.process_group
        for owner in range(self.world_size):
            by_dtype = {}
            for params in self.owned[owner]:
                for p in params:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for params in by_dtype.values():
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
                if owner != self.rank:
                    with torch.no_grad():
                        for p, value in zip(params, flat.split([p.numel() for p in params])):
                            p.copy_(value.view_as(p))
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
