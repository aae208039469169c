"""The generic ``Join`` for uneven inputs: ranks out of data shadow the collectives of any ``Joinable``.

What
    ``Join`` is a context manager around the training loop for a list of ``Joinable`` objects
    (``Join([ddp])``, ``ddp.join()``; later ``Join([ddp, optimizer])``). Every grad-enabled
    forward of a rank with data starts with one small all-reduce, the *round* (``Join.notify``,
    run by the first joinable, DDP): who is still active, plus the flags the hooks name
    (``JoinHook.round_flags``; DDP's: will this backward sync, is the bucket rebuild due), each
    set if any active rank set it. A rank out of data answers rounds in ``__exit__``: each joinable's
    ``JoinHook.main_hook``, in list order, issues what the active ranks are about to issue, until
    a round finds nobody active; then each ``post_hook`` gives every rank the last finisher's
    state. DDP's hook is ``ddp.DDPJoinHook``.

Why
    Collectives match by order, not by name: with 10 batches on rank 0 and 9 on rank 1, rank 0's
    tenth backward all-reduces its buckets while rank 1 waits at a barrier or saves a checkpoint,
    a hang or gloo pairing differently sized messages. ``drop_last=False``, a ``DataLoader`` that
    filters samples or batches packed per rank make uneven inputs common.

How torch differs
    The interface of ``torch/distributed/algorithms/join.py`` (``Join``, ``Joinable``,
    ``JoinHook``; DDP's ``_DDPJoinHook``), a list of joinables on one process group and device, as
    torch's. torch's active ranks announce themselves, say whether they sync and pick the buffer
    source in three all-reduces; we fold them into one of a ``world_size`` + flags vector (``world_size + 2``
    with DDP), handed to every ``main_hook``. A
    ``dist.all_reduce`` of your own on an active rank has no partner (torch: the same).
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
    """One SUM all-reduce over ``group`` of ``[active one-hot..., flags...]`` (``world_size + len(flags)`` floats on
    ``device``, the flags in ``flags``' order): an active rank sends 1 in its slot and its flags, a joined rank
    zeros. Returns the ``Round``: the ranks whose slot is set, ascending; each flag set if any active rank set it."""
    ### BEGIN SOLUTION
    names = list(flags)
    vector = torch.zeros(world_size + len(names), device=device)
    if active:
        vector[rank] = 1
        for i, name in enumerate(names):
            vector[world_size + i] = float(flags[name])
    dist.all_reduce(vector, group=group)
    counts = vector.tolist()
    return Round(active=tuple(r for r in range(world_size) if counts[r] > 0),
                 flags={name: counts[world_size + i] > 0 for i, name in enumerate(names)})
    ### END SOLUTION
# --8<-- [end:round]


# --8<-- [start:interface]
class JoinHook:
    """What a joined rank does for one ``Joinable`` (torch's ``JoinHook``); both methods do nothing here."""

    round_flags: tuple[str, ...] = ()  # the flags this hook reads from each Round (an active rank's notify sets them)

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


def _checked(joinables) -> list:
    """torch's ``Join`` takes a list, on one process group and one device: refuse anything else in one line."""
    if not isinstance(joinables, (list, tuple)):
        raise TypeError(f"Join takes a list of joinables, as torch's does: Join([ddp]) (or ddp.join()), "
                        f"got {type(joinables).__name__}")
    if not joinables:
        raise ValueError("Join needs at least one joinable: Join([ddp])")
    first = joinables[0]
    for j in joinables:
        if not all(hasattr(j, a) for a in ("join_hook", "join_device", "join_process_group")):  # duck-typed, as torch
            raise TypeError(f"Join's joinables must be Joinable (join_hook, join_device, join_process_group); "
                            f"got {type(j).__name__}")
        if j.join_process_group is not first.join_process_group or j.join_device != first.join_device:
            raise ValueError(f"Join's joinables must share one process group and device: {type(j).__name__} "
                             f"differs from {type(first).__name__} (torch: the same)")
    if len({id(j) for j in joinables}) < len(joinables):
        raise ValueError("Join got the same joinable twice; list each once")
    return list(joinables)


class Join:
    """Context manager for uneven inputs around a list of ``Joinable``; see the module docstring."""

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs):
        self.joinables = _checked(joinables)  # whose collectives the joined ranks shadow; the first runs the rounds
        self.enable = enable  # False: a plain no-op context (torch's flag)
        self.throw = throw_on_early_termination  # raise everywhere as soon as one rank runs out
        self.kwargs = kwargs  # for every joinable's join_hook (DDP: divide_by_initial_world_size)
        self.hooks: list[JoinHook] = []  # the joinables' hooks, in their order, while the context is open
        self.flag_names: tuple[str, ...] = ()  # every hook's round_flags, once each, in list order: the round's
        group = self.joinables[0].join_process_group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)  # our rank inside the joinables' group
        self.last_active: tuple[int, ...] = ()  # who was active in the latest round with anyone active

    def __enter__(self):
        if self.enable:
            for joinable in self.joinables:
                if joinable.join_context is not None:
                    raise RuntimeError(f"this {type(joinable).__name__} is already in an open Join (join()); "
                                       "do not nest them")
            self.hooks = [joinable.join_hook(**self.kwargs) for joinable in self.joinables]
            self.flag_names = tuple(dict.fromkeys(name for hook in self.hooks for name in hook.round_flags))
            for joinable in self.joinables:
                joinable.join_context = self
        return self

    def hook_of(self, joinable: Joinable) -> JoinHook:
        """The hook of ``joinable`` in this open context (DDP's forward asks for its own)."""
        return next(h for j, h in zip(self.joinables, self.hooks) if j is joinable)

    # --8<-- [start:notify]
    def notify(self, **flags: bool) -> Round:
        """Called by an active rank's grad-enabled forward: take part in this iteration's round, with its flags
        (DDP's: ``will_sync``, ``rebuild``); a flag some hook names and ``flags`` omits is sent unset."""
        unknown = sorted(set(flags) - set(self.flag_names))
        if unknown:
            raise ValueError(f"Join.notify got flags {unknown} that no hook names in round_flags {self.flag_names}")
        plan = self._round(active=True, flags={name: bool(flags.get(name, False)) for name in self.flag_names})
        self.last_active = plan.active
        if self.throw and len(plan.active) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(plan.active))
            raise EarlyTerminationError(f"rank(s) {missing} exhausted their inputs (throw_on_early_termination=True); "
                                        f"raising on every rank, rank {self.rank} included")
        return plan
    # --8<-- [end:notify]

    def _round(self, *, active: bool, flags: dict[str, bool]) -> Round:
        first = self.joinables[0]
        return exchange_round(self.world_size, self.rank, first.join_device, first.join_process_group,
                              active=active, flags=flags)

    # --8<-- [start:exit]
    def __exit__(self, exc_type, exc, tb):
        """This rank is out of data: answer rounds (``self._round``, inactive, every flag of ``self.flag_names``
        unset) until one finds nobody active. At
        each other round: remember its ranks in ``last_active``; with ``self.throw`` raise
        ``EarlyTerminationError`` naming this rank (``f"rank {self.rank} ..."``), else ``main_hook(plan)`` of every
        hook in ``self.hooks``, in order (warning once at ``WARN_AFTER_ROUNDS``). Then every hook's
        ``post_hook(max(last_active))``, or ``world_size - 1`` while ``last_active`` is empty (no rank ever had
        data)."""
        if not self.enable:
            return False
        for joinable in self.joinables:
            joinable.join_context = None
        if exc_type is not None:  # an error inside the loop: propagate it, do not shadow anything
            return False
        ### BEGIN SOLUTION
        rounds = 0
        while True:  # this rank is out of data: answer rounds until nobody is active
            plan = self._round(active=False, flags=dict.fromkeys(self.flag_names, False))
            if not plan.active:
                break
            self.last_active = plan.active
            if self.throw:
                raise EarlyTerminationError(f"rank {self.rank} exhausted its inputs (throw_on_early_termination=True)")
            rounds += 1
            if rounds == WARN_AFTER_ROUNDS:
                warnings.warn(f"rank {self.rank} has shadowed {rounds} iterations of the other ranks: the inputs are "
                              "very uneven; consider balancing the shards", stacklevel=2)
            for hook in self.hooks:  # in list order, as the active ranks issue them
                hook.main_hook(plan)
        # everyone takes the state of the highest rank among the last to finish
        for hook in self.hooks:
            hook.post_hook(max(self.last_active) if self.last_active else self.world_size - 1)
        ### END SOLUTION
        return False
    # --8<-- [end:exit]
