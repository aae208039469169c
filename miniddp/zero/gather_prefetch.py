"""ZeRO-1/2's post-step all-gather, hidden behind the next forward: ``GatherPrefetch(ddp)``.

What
    ``ZeroOptimizer.step()`` posts the exchanges that bring every rank's updated pieces into the parameters
    (``post``) and returns; each parameter is waited for when it is next *handed out*. Every module of the DDP
    that holds parameters gets a ``WaitingParameters`` as its ``_parameters``: reading ``module.weight`` waits for
    that parameter's exchange (``reached``); walking them (``parameters()``, ``state_dict()``, ``load_state_dict``,
    ``.to()``, pickling) waits for all of that module's. The first forward records the order in which the
    parameters are first read; from the first step on (after one all-gather that checks every rank recorded the
    same order, or an error naming the rank) the exchanges are posted in that order, one parameter at a time on
    gloo (one bucket at a time elsewhere), so the first layers' parameters arrive first: gloo's messages between
    a pair complete in the order they were posted. What must not wait: DDP's own check, before the module runs,
    that the parameters are still those it wrapped (``quiet``, from DDP's forward pre-hook to the module's).

Why
    Over a slow link the all-gather after the step is the exposed half of ZeRO's communication: DDP's
    all-reduce hides behind the backward, and nothing hid the all-gather (ZeRO-2's step was ~1.5x DDP's at
    1 Gbit/s, ``docs/performance.md``). Posted early, it runs while the next forward computes the first layers.
    Waiting at the *access* (not at a module's forward pre-hook) is what makes it exact for every use: a tied
    weight waits wherever it is first read, a parent reading ``self.child.weight`` waits there, a test that reads
    ``model.parameters()`` after the last step waits there. What escapes it is a reference held from before
    the step (``w = model.weight`` kept aside): a gradient for a parameter still in flight raises in the backward
    (``check``); call ``ZeroOptimizer.wait_for_parameters()`` before such reads, or pass ``prefetch=False``.

How torch and DeepSpeed differ
    DeepSpeed's stage 1/2 (``stage_1_and_2.py``, ``all_gather_dp_groups``) all-gathers right after the step and
    waits, as ``prefetch=False`` here. Its ZeRO-3 prefetches the next parameters by a trace recorded in the
    first iteration (``PartitionedParameterCoordinator``), re-recorded when the order changes; its parameters
    are empty outside a module's forward (``GatheredParameters`` to read them). torch FSDP2 (``fully_shard``)
    keeps DTensor shards and all-gathers each unit in its forward pre-hook, prefetching the next unit
    (``set_modules_to_forward_prefetch``). Both free the full parameters; here they stay whole, so the access
    itself is the place to wait.
"""

from __future__ import annotations

import atexit
import weakref
import zlib

import torch
import torch.distributed as dist

from ..collectives import shard_collectives
from ..collectives.byte_count import record
from ..collectives.shard_collectives import all_gather_pieces
from ..process_group.debug_backend import backend_name

_live: weakref.WeakSet = weakref.WeakSet()  # every GatherPrefetch of this process, for the exit's wait
_exit_registered = False  # _wait_at_exit is registered with atexit once, after the process group exists


class WaitingParameters(dict):
    """A module's ``_parameters`` that waits for a parameter's exchange before handing it out."""

    def __init__(self, params: dict, prefetch: GatherPrefetch):
        super().__init__(params)
        self.prefetch = prefetch

    def __getitem__(self, name):  # module.weight (nn.Module.__getattr__)
        param = dict.__getitem__(self, name)
        self.prefetch.reached(param)
        return param

    def get(self, name, default=None):
        return self[name] if name in self else default

    def items(self):  # parameters(), named_parameters(), state_dict(), load_state_dict(), _apply()
        for param in dict.values(self):
            self.prefetch.reached(param)
        return dict.items(self)

    def values(self):
        self.items()
        return dict.values(self)

    def __reduce_ex__(self, protocol):  # deepcopy, pickle: a plain dict of the gathered parameters
        return dict, (list(self.items()),)


class _Exchange:
    """The works that bring one parameter (gloo) or one bucket (elsewhere) to this rank; waited for once."""

    def __init__(self, works):
        self.works, self.done = works, False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True


class GatherPrefetch:
    """Records the forward's order, posts ZeRO's all-gathers in it, and waits for each at its parameter's use."""

    def __init__(self, ddp, index_of: dict[int, int]):
        self.ddp = ddp  # the DistributedDataParallel: its module is watched, its group looked up at each use
        self.index_of = index_of  # id(parameter) -> its index in DDP's reducer: the same on every rank
        self.pending: dict[int, _Exchange] = {}  # id(parameter) -> the exchange still writing (or reading) it
        self.quiet = False  # inside DDP's forward, before the module: DDP checks identities, reads no values
        self.recording: dict[int, None] | None = None  # first forward: ids in the order they are first read
        self.order: list[int] | None = None  # reducer indices, first read first (the unread ones last)
        self.agreed_by_all = False  # every rank recorded the same order (checked once)
        for module in ddp.module.modules():
            if module._parameters:
                module._parameters = WaitingParameters(module._parameters, self)
        for param in dict.fromkeys(p for m in ddp.module.modules() for p in dict.values(m._parameters)):
            if id(param) in index_of:
                param.register_hook(self._checker(param))
        ddp.register_forward_pre_hook(self._enter_ddp)
        ddp.register_forward_hook(self._leave, always_call=True)
        ddp.module.register_forward_pre_hook(self._begin_forward, prepend=True)
        ddp.module.register_forward_hook(self._end_forward, always_call=True)
        _live.add(self)
        global _exit_registered
        if not _exit_registered:  # after init_distributed's own atexit (which destroys the group): so run before it
            atexit.register(_wait_at_exit)
            _exit_registered = True

    # --8<-- [start:wait]
    def reached(self, param: torch.Tensor) -> None:
        """``param`` is being handed out: record it (first forward), and wait for its exchange."""
        if self.quiet:
            return
        if self.recording is not None:
            self.recording.setdefault(id(param))
        exchange = self.pending.pop(id(param), None)
        if exchange is not None:
            exchange.wait()

    def wait_all(self) -> None:
        """Every exchange still in flight: before the optimizer writes the parameters, and wherever a caller
        reads them by a reference held from before the step."""
        exchanges, self.pending = self.pending, {}
        for exchange in dict.fromkeys(exchanges.values()):
            exchange.wait()

    def _checker(self, param: torch.Tensor):
        pid, index = id(param), self.index_of[id(param)]

        def check(grad):  # a gradient means the forward used it: it must have been waited for first
            if pid in self.pending:
                raise RuntimeError(
                    f"ZeroOptimizer: parameter {index} of the DDP ({self.ddp.reducer.names[index]}) was used by "
                    "the forward while its all-gather from the last step was still in flight (read through a "
                    "reference held from before the step, not through its module): call "
                    "zero.wait_for_parameters() before the forward, or ZeroOptimizer(..., prefetch=False)")
        return check
    # --8<-- [end:wait]

    # DDP's forward, before the module's: it checks that the parameters are those it wrapped (identity, dtype,
    # device), which must not wait. A no_sync forward snapshots versions that a copy into a piece would change
    # (off gloo the gathered chunks are copied in): there, everything lands first.
    def _enter_ddp(self, ddp, args) -> None:
        if not ddp.require_backward_grad_sync and backend_name(ddp.process_group) != "gloo":
            self.wait_all()
        self.quiet = True

    def _leave(self, ddp, args, output) -> None:
        self.quiet = False

    def _begin_forward(self, module, args) -> None:
        self.quiet = False
        if self.order is None and self.recording is None:
            self.recording = {}

    def _end_forward(self, module, args, output) -> None:
        if self.recording is not None:
            seen = [self.index_of[p] for p in self.recording if p in self.index_of]
            self.order = seen + sorted(set(self.index_of.values()) - set(seen))
            self.recording = None

    # --8<-- [start:agree]
    def agreed(self, group) -> bool:
        """Whether every rank recorded its first forward, in the same order (a collective, until it is so):
        the exchanges pair up message by message, so every rank must post them in one order."""
        if self.agreed_by_all:
            return True
        mine = -1 if self.order is None else zlib.crc32(torch.tensor(self.order, dtype=torch.int64).numpy())
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, torch.tensor([mine], dtype=torch.int64), group=group)
        hashes = [int(h) for h in everyone]
        if -1 in hashes:  # a rank has not run a forward yet: this step gathers as without prefetch
            return False
        differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if differ:
            raise RuntimeError(f"ZeroOptimizer(prefetch=True): rank {differ[0]} read the parameters in its first "
                               "forward in another order than rank 0; the all-gathers are posted in that order and "
                               "must pair up: give every rank the same forward, or pass prefetch=False")
        self.agreed_by_all = True
        return True
    # --8<-- [end:agree]

    # --8<-- [start:post]
    def post(self, buckets: list[tuple], group) -> None:
        """Post each bucket's exchange (``(pieces_by_rank, chunk, like)``, as ``all_gather_pieces`` takes it) in
        the recorded order, and return. gloo: one parameter at a time, each from its owners' pieces straight into
        the others' (as ``all_gather_pieces`` sends them); elsewhere one all-gather per bucket."""
        position = {index: i for i, index in enumerate(self.order)}
        if backend_name(group) != "gloo":
            for bucket in sorted(buckets, key=lambda b: min(position[p.index] for ps in b[0] for p in ps)):
                exchange = _Exchange([all_gather_pieces(*bucket, group)])
                self.pending.update((id(p.param), exchange) for pieces in bucket[0] for p in pieces)
            return
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        owners: dict[int, list] = {}  # reducer index -> its piece on each rank (None: that rank holds none of it)
        for pieces_by_rank, chunk, like in buckets:
            record("all_gather", like.new_empty(1).expand(chunk))  # counted as a chunk, as all_gather_pieces does
            for r, pieces in enumerate(pieces_by_rank):
                for piece in pieces:
                    owners.setdefault(piece.index, [None] * n)[r] = piece
        for index in sorted(owners, key=position.__getitem__):
            ops = []
            for k in range(1, n):  # every pair's messages in one order: the recorded one
                to, source = (rank + k) % n, (rank - k) % n
                ops += _ops(dist.isend, owners[index][rank], to, group)
                ops += _ops(dist.irecv, owners[index][source], source, group)
            if ops:
                piece = next(p for p in owners[index] if p is not None)
                self.pending[id(piece.param)] = _Exchange(dist.batch_isend_irecv(ops))
    # --8<-- [end:post]


def _ops(op, piece, peer: int, group) -> list:
    """``op`` (isend or irecv) of ``piece``'s values with group rank ``peer``, cut as ``shard_collectives`` cuts."""
    if piece is None:
        return []
    size = max(1, shard_collectives.SEGMENT_BYTES // piece.tensor.element_size())
    return [dist.P2POp(op, part, dist.get_global_rank(group, peer), group) for part in piece.tensor.split(size)]


def _wait_at_exit() -> None:
    """A peer whose group is destroyed mid-exchange fails its partner: the last step's exchanges land first (a
    group you destroy yourself: call ``ZeroOptimizer.wait_for_parameters()`` first)."""
    for prefetch in list(_live):
        prefetch.wait_all()
