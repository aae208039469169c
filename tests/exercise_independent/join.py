"""An independent correct solution of ``join``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: ``exchange_round`` is an ``all_gather`` of a row per rank
(active, then the hooks' flags; a joined rank sends zeros) read column by column, not one all-reduce of a
one-hot vector. ``Join.__exit__`` keeps its own bookkeeping: it counts the rounds it shadowed and knows
it finished last when it shadowed none; once a round finds nobody active, the source of the final model
is agreed by one more collective, an all-reduce MAX of the last finishers' ranks (as torch's ``Join``
finds its last joiner), instead of reading ``last_active``.
"""


from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..process_group.fingerprint import issued_as

WARN_AFTER_ROUNDS = 1000  # torch warns when joined ranks shadow this many iterations


class EarlyTerminationError(RuntimeError):
    """``throw_on_early_termination=True`` and some rank ran out of inputs; raised on every rank."""


# --8<-- [start:round]
@dataclass(frozen=True)
class Round:
    """What one grad-enabled forward will do, agreed by every rank (active or joined)."""

    active: tuple[int, ...]  # group ranks that still have data in this iteration
    flags: dict[str, bool]  # each flag the hooks name (JoinHook.round_flags): set if any active rank set it

    @property
    def source(self) -> int:
        """Where buffers come from: the highest active rank (rank 0 may have joined)."""
        return max(self.active)


@issued_as("join round")
def exchange_round(world_size: int, rank: int, device, group, *, active: bool, flags: dict[str, bool]) -> Round:
    """One all-gather of each rank's ``[active, flags...]``: a joined rank sends zeros."""
    names = list(flags)
    mine = torch.tensor([int(active)] + [int(active and flags[n]) for n in names], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).tolist()  # table[r] = rank r's (active, flags...)
    return Round(active=tuple(r for r, row in enumerate(table) if row[0]),
                 flags={n: any(row[1 + i] for row in table) for i, n in enumerate(names)})
# --8<-- [end:round]


# --8<-- [start:interface]
class JoinHook:
    """What a joined rank does for one ``Joinable`` (torch's ``JoinHook``); both methods do nothing here."""

    round_flags: tuple[str, ...] = ()  # the flags this hook reads from each Round

    def main_hook(self, plan: Round) -> None:
        """One iteration of the active ranks: issue the collectives they issue, in their order, with zeros."""

    def post_hook(self, source: int) -> None:
        """Every rank has joined; ``source`` is the highest rank among the last to finish."""


class Joinable(ABC):
    """What ``Join`` needs from the object it drives (torch's ``Joinable``)."""

    join_context: Join | None = None  # the open Join, set and cleared by Join: the object's forward notifies it

    @abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The hook a joined rank runs; ``kwargs`` are the ones given to ``Join``."""

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """Where the round's small tensor lives."""

    @property
    @abstractmethod
    def join_process_group(self):
        """The ranks that join together."""
# --8<-- [end:interface]


class Join:
    """Context manager for uneven inputs around a list of ``Joinable``; see the module docstring."""

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs):
        if not isinstance(joinables, (list, tuple)) or not joinables:
            raise TypeError("Join takes a non-empty list of joinables: Join([ddp])")
        self.joinables = list(joinables)  # the first one's forward runs the rounds
        self.enable = enable  # False: a plain no-op context (torch's flag)
        self.throw = throw_on_early_termination  # raise everywhere as soon as one rank runs out
        self.kwargs = kwargs  # for each joinable's join_hook (DDP: divide_by_initial_world_size)
        self.hooks: dict[int, JoinHook] = {}  # id(joinable) -> its hook, while the context is open
        self.flag_names: list[str] = []  # the hooks' round_flags, sorted: the round's columns after "active"
        self.group, self.device = self.joinables[0].join_process_group, self.joinables[0].join_device
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)  # our rank inside the joinables' group
        self.last_active: tuple[int, ...] = ()  # who was active in the latest round with anyone active

    def __enter__(self):
        if self.enable:
            if any(j.join_context is not None for j in self.joinables):
                raise RuntimeError("a joinable is already in an open Join; do not nest them")
            self.hooks = {id(j): j.join_hook(**self.kwargs) for j in self.joinables}
            self.flag_names = sorted({n for h in self.hooks.values() for n in h.round_flags})
            for j in self.joinables:
                j.join_context = self
        return self

    def hook_of(self, joinable: Joinable) -> JoinHook:
        return self.hooks[id(joinable)]

    # --8<-- [start:notify]
    def notify(self, **flags: bool) -> Round:
        """Called by an active rank's grad-enabled forward: take part in this iteration's round."""
        if not set(flags) <= set(self.flag_names):
            raise ValueError(f"Join.notify: no hook names the flags {sorted(set(flags) - set(self.flag_names))}")
        plan = self._round(active=True, flags={n: bool(flags.get(n)) for n in self.flag_names})
        self.last_active = plan.active
        if self.throw and len(plan.active) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(plan.active))
            raise EarlyTerminationError(f"rank(s) {missing} exhausted their inputs (throw_on_early_termination=True); "
                                        f"raising on every rank, rank {self.rank} included")
        return plan
    # --8<-- [end:notify]

    def _round(self, active: bool, flags: dict[str, bool]) -> Round:
        return exchange_round(self.world_size, self.rank, self.device, self.group, active=active, flags=flags)

    # --8<-- [start:exit]
    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        for j in self.joinables:
            j.join_context = None
        if exc_type is not None:  # an error inside the loop: propagate it, do not shadow anything
            return False
        shadowed = 0  # iterations of the active ranks this rank answered with zeros
        while True:
            plan = self._round(active=False, flags={n: False for n in self.flag_names})
            if not plan.active:  # everyone is here: nothing left to shadow
                break
            if self.throw:  # the active ranks raise in this same round (notify)
                raise EarlyTerminationError(f"rank {self.rank} exhausted its inputs (throw_on_early_termination="
                                            "True); raising on every rank")
            for j in self.joinables:
                self.hooks[id(j)].main_hook(plan)
            shadowed += 1
            if shadowed == WARN_AFTER_ROUNDS:
                warnings.warn(f"rank {self.rank} has shadowed {shadowed} iterations of ranks {list(plan.active)} "
                              "in join(): the inputs are very uneven", UserWarning, stacklevel=2)
        finished_last = shadowed == 0  # active in the last round that had anyone active
        claim = torch.tensor([self.rank if finished_last else -1], dtype=torch.int64, device=self.device)
        dist.all_reduce(claim, op=dist.ReduceOp.MAX, group=self.group)
        for j in self.joinables:
            self.hooks[id(j)].post_hook(int(claim.item()))
        return False
    # --8<-- [end:exit]
