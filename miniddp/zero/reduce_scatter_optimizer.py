"""ZeRO stages 1 and 2 through DDP's engine: ``ZeroOptimizer(ddp, optimizer_class, stage, **defaults)``.

What
    It attaches to a ``DistributedDataParallel`` before its first forward: each bucket is reduce-scattered instead
    of all-reduced (``gradient_shards.ReduceScatterMean``), and this rank's optimizer (``self.optim``, an
    ``optimizer_class``) steps only its ``Piece``s of the parameters, with the shard of the averaged gradient as
    their ``.grad``. ``step()`` then posts the all-gather of the updated parameters and returns; each parameter is
    waited for where it is next read, so the exchange runs behind the next forward (``gather_prefetch.py``;
    ``prefetch=False``: waited for in ``step()``, as inside a ``Join``). Its
    ``param_groups`` are the whole model's (schedulers change them); ``state_dict()`` gathers the full state in
    ``torch.optim``'s format, and ``load_state_dict`` cuts it again, so a checkpoint moves between world sizes.
    It may hold part of the DDP (``params=``): the rest keep DDP's averaged ``.grad`` for another optimizer
    (``gradient_shards.PartlyHeld``). A group added later is stepped; a parameter outside DDP's buckets is owned
    whole by one rank, as under torch's ``ZeroRedundancyOptimizer``, and broadcast after the step.

    - stage 1: the full gradient exists during backward (accumulation under ``no_sync`` is DDP's, full-size) and
      DDP's buckets keep their memory; only the optimizer state is sharded.
    - stage 2: each ``.grad`` is dropped as its bucket goes out, the buckets give their memory back after the
      backward, and only the gradient's shard remains. Every backward should sync: ``no_sync`` still works (and is
      exact), but it keeps full-size gradients between micro-batches, the memory stage 2 exists to save.

Why
    DDP holds the whole model, gradient and optimizer state on every rank. Sharding the state and the gradient
    costs no extra communication: a reduce-scatter and an all-gather move the bytes of one all-reduce (the
    Ultra-Scale Playbook, "ZeRO-1", "ZeRO-2"; Rajbhandari et al., arXiv 1910.02054).

How torch and DeepSpeed differ
    torch's ``ZeroRedundancyOptimizer`` (``zero_redundancy_optimizer.py`` here) keeps DDP's all-reduce and
    broadcasts each parameter from its owner: ZeRO-1 with an all-reduce's bytes *plus* a broadcast's. DeepSpeed's
    ``DeepSpeedZeroOptimizer`` (``stage_1_and_2.py``) is this class's model: flat partitions, a reduce-scatter,
    an all-gather, clipping on the shards; it refuses ``no_sync`` under stage 2, and waits for its all-gather in
    ``step()``. Only elementwise optimizers (SGD,
    Adam, AdamW, ...) give the same step on pieces as on whole tensors; one that reads a whole tensor (LAMB's
    trust ratio, Adafactor's factored moments) does not, as in DeepSpeed's flat partitions. DeepSpeed reduces
    only its own optimizer's gradients and takes one optimizer (Muon and AdamW as one ``MuonWithAuxAdam``); here
    a second optimizer beside ZeRO gets DDP's averages, as beside torch's ``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..collectives.shard_collectives import all_gather_pieces, broadcast
from ..engine.join import Joinable, JoinHook, Round
from .gather_prefetch import GatherPrefetch
from .gradient_shards import BucketMemory, PartlyHeld, ReduceScatterMean, Shards
from .zero_partition import partition_by_size


class ReduceScatterJoinHook(JoinHook):
    """A joined rank's share of an iteration: the step's all-gathers, when the active ranks' backward synced."""

    round_flags = ("will_sync",)  # the active ranks' backward synced, so their step follows (DDP's flag, or ours)

    def __init__(self, zero: ZeroOptimizer):
        self.zero = zero

    def main_hook(self, plan: Round) -> None:
        if plan.flags["will_sync"]:  # its shard got the active ranks' mean (gradient_shards.land_joined): step, gather
            self.zero._step(None, prefetch=False)  # as the active ranks, inside their Join: waited for
            self.zero.zero_grad()  # the active ranks zero theirs in their loop; a joined rank has none


class ZeroOptimizer(torch.optim.Optimizer, Joinable):
    """ZeRO stage 1 or 2 of ``ddp``'s parameters with a local ``optimizer_class``; see the module docstring."""

    # --8<-- [start:attach]
    def __init__(self, ddp, optimizer_class: type[torch.optim.Optimizer], stage: int = 2, params=None, *,
                 prefetch: bool = True, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer(stage={stage!r}): stage is 1 (optimizer state) or 2 (and gradients); "
                             "stage 0 is plain DDP with optimizer_class, stage 3 is not implemented in miniddp")
        reducer = ddp.reducer
        _check_attachable(ddp)
        self.attached = False  # add_param_group, called by Optimizer.__init__, lays out only once we are set up
        super().__init__(ddp.parameters() if params is None else params, defaults)
        self.stage, self.ddp = stage, ddp
        self.world_size, self.rank = reducer.world_size, dist.get_rank(reducer.group)
        # the shards are cut from these buckets: the reducer keeps them, never rebuilding them in arrival order
        reducer.set_bucket_assignment([b.indices for b in reducer.buckets], final=True)
        self.shards = Shards(reducer.buckets, self.rank, self.world_size)
        reducer.add_observer(BucketMemory(reducer, self.shards))  # stage 2 freed them: memory back at each backward
        self.pieces_of = [self.shards.pieces if r == self.rank else Shards(reducer.buckets, r, self.world_size).pieces
                          for r in range(self.world_size)]  # pieces_of[rank][bucket]: whose elements are whose
        self.reduce_scatter = ReduceScatterMean(self.shards, self.world_size, frees_gradients=stage == 2)
        self._lay_out()
        index_of = {id(p): i for b in reducer.buckets for i, p in zip(b.indices, b.params)}
        self.prefetch = GatherPrefetch(ddp, index_of) if prefetch else None  # step's all-gather, waited at use
        self.optim = optimizer_class(self._local_groups(), **defaults)  # steps this rank's pieces only
        self.defaults = self.optim.defaults  # every option (AdamW's betas too), so state_dict() loads anywhere
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in local.items() if k != "params"})
        self.attached = True
    # --8<-- [end:attach]

    # --8<-- [start:layout]
    def _lay_out(self) -> None:
        """Who steps what, from the param groups. A parameter in DDP's buckets is held in pieces (``Shards``); one
        outside them (not in this DDP, or left out of its buckets) is owned whole by the rank torch's
        ``ZeroRedundancyOptimizer`` gives it (``partition_by_size`` over the same groups), stepped there with its
        local gradient and broadcast, as torch's is. Buckets with parameters no group holds are all-reduced
        (``PartlyHeld``): another optimizer steps those, with DDP's averaged ``.grad``."""
        reducer = self.ddp.reducer
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        bucketed = {id(p) for bucket in reducer.buckets for p in bucket.params}
        self.held = {i for b in reducer.buckets for i, p in zip(b.indices, b.params) if id(p) in mine}
        owned = partition_by_size(self.param_groups, self.world_size)  # owned[rank][group], whole parameters
        self.owner = {id(p): rank for rank, groups in enumerate(owned) for group in groups for p in group
                      if id(p) not in bucketed and p.requires_grad}  # a frozen one is never stepped, never sent
        self.outside = [p for group in self.param_groups for p in group["params"] if id(p) in self.owner]
        everything = len(self.held) == sum(len(b.indices) for b in reducer.buckets)
        reducer.set_collective(self.reduce_scatter if everything else
                               PartlyHeld(self.reduce_scatter, self.shards, self.held), owner="ZeroOptimizer")

    def _local_groups(self) -> list[dict]:
        """Each param group's options with this rank's pieces of its parameters and the outside ones it owns."""
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        mine = [[] for _ in self.param_groups]
        for pieces in self.shards.pieces:
            for piece in pieces:
                if id(piece.param) in group_of:  # a parameter no group holds is not stepped (as torch.optim)
                    mine[group_of[id(piece.param)]].append(piece.tensor)
        for param in self.outside:
            if self.owner[id(param)] == self.rank:
                mine[group_of[id(param)]].append(param)
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": ps}
                for group, ps in zip(self.param_groups, mine)]

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim``'s checks and defaults; once attached, the group is laid out as the others were (its
        pieces and owned parameters join the local optimizer), so the next ``step()`` steps it, as torch's does."""
        super().add_param_group(param_group)
        if self.attached:
            self.wait_for_parameters()
            self._lay_out()
            self.optim.add_param_group(self._local_groups()[-1])
            self.param_groups[-1].update({k: v for k, v in self.optim.param_groups[-1].items() if k != "params"})
    # --8<-- [end:layout]

    # --8<-- [start:step]
    def step(self, closure=None):
        """Step this rank's pieces, then post the all-gather of each bucket's parameters from the ranks' chunks:
        each parameter is waited for where it is next read (``gather_prefetch.py``). Inside a ``Join``, or with
        ``prefetch=False``, they are waited for here."""
        return self._step(closure, prefetch=self.join_context is None)

    def _step(self, closure, prefetch: bool):
        if self.join_context is not None and self.join_context.joinables[0] is self:
            self.join_context.notify(will_sync=True)
        self.wait_for_parameters()  # the last step's exchanges still write into (and read) what this one steps
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})  # lr as the scheduler set it
        loss = self.optim.step(closure)
        self._gather_parameters(prefetch and self.prefetch is not None)
        return loss

    def _gather_parameters(self, prefetch: bool) -> None:
        """Each bucket's held pieces from their owners, each outside parameter from its owner: every exchange
        posted before any is waited for. ``prefetch``: the buckets' are posted in the forward's order and left
        in flight, once every rank has recorded the same order."""
        group = self.ddp.reducer.group
        buckets = []
        for b, bucket in enumerate(self.shards.buckets):
            pieces = [[piece for piece in owner[b] if piece.index in self.held] for owner in self.pieces_of]
            if any(pieces):  # a bucket no group holds is another optimizer's, stepped alike on every rank
                buckets.append((pieces, self.shards.chunk[b], bucket.buffer))
        if prefetch and self.prefetch.agreed(group):
            self.prefetch.post(buckets, group)
            buckets = []
        pending = [all_gather_pieces(*bucket, group) for bucket in buckets]
        pending += [broadcast(p.detach(), dist.get_global_rank(group, self.owner[id(p)]), group) for p in self.outside]
        for work in pending:
            work.wait()

    def wait_for_parameters(self) -> None:
        """Wait for the last step's all-gathers: before reading parameters through references kept from before
        the step (reads through their modules wait by themselves), or destroying the process group yourself."""
        if self.prefetch is not None:
            self.prefetch.wait_all()
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients and every parameter's ``.grad`` (a ``no_sync`` backward leaves full ones)."""
        self.shards.zero_grad()
        super().zero_grad(set_to_none=True)

    # --8<-- [start:clip]
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole averaged gradient, from the shards: each rank's sum of
        squares, summed over ranks (one all-reduce), then each shard scaled. Returns the total norm, in the
        parameters' promoted dtype as torch's is, and the coefficient is computed from it as torch computes it.
        (torch's function on ``model.parameters()`` sees no ``.grad`` here: call this one.)"""
        grads = [p.grad for p in self._pieces() if p.grad is not None]
        device = self.shards.buckets[0].buffer.device
        squares = torch.stack([g.double().square().sum() for g in grads]).sum() if grads else \
            torch.zeros((), dtype=torch.float64, device=device)
        dist.all_reduce(squares, group=self.ddp.reducer.group)
        dtypes = [p.dtype for group in self.param_groups for p in group["params"] if p.requires_grad]
        norm = squares.sqrt().to(functools.reduce(torch.promote_types, dtypes, dtypes[0] if dtypes else torch.float32))
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's arithmetic, in the norm's dtype
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return norm
    # --8<-- [end:clip]

    def _pieces(self) -> list[torch.Tensor]:
        return [p for group in self.optim.param_groups for p in group["params"]]

    # --8<-- [start:state_dict]
    def state_dict(self) -> dict:
        """The whole optimizer's state in ``torch.optim``'s format (global parameter indices), on every rank: a
        collective (each rank sends its pieces' state once)."""
        self.wait_for_parameters()  # a checkpoint's model and optimizer describe one step
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        local = [(index[id(piece.param)], piece.start, _to_cpu(self.optim.state[piece.tensor]))
                 for pieces in self.shards.pieces for piece in pieces
                 if id(piece.param) in index and piece.tensor in self.optim.state]
        local += [(index[id(p)], 0, _to_cpu(self.optim.state[p])) for p in self.outside if p in self.optim.state]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, local, group=self.ddp.reducer.group)
        parts: dict[int, list] = {}
        for i, start, state in sorted((x for rank in everyone for x in rank), key=lambda x: x[:2]):
            parts.setdefault(i, []).append(state)
        params = [p for g in self.param_groups for p in g["params"]]
        state = {i: {k: (torch.cat([s[k] for s in pieces]).view_as(params[i]) if _elementwise(v) else v)
                     for k, v in pieces[0].items()} for i, pieces in parts.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep each of this rank's pieces' slice of the full state (any world size saved it) and the options."""
        self.wait_for_parameters()
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self.optim.state.clear()
        for pieces in self.shards.pieces:
            for piece in pieces:
                saved = state_dict["state"].get(index.get(id(piece.param)))
                if saved is not None:
                    self.optim.state[piece.tensor] = {
                        k: (v.detach().reshape(-1)[piece.start : piece.stop].clone().to(piece.tensor.device)
                            if _elementwise(v) else v.detach().clone() if torch.is_tensor(v) else v)
                        for k, v in saved.items()}
        for param in self.outside:  # owned whole: the whole state, on its owner
            saved = state_dict["state"].get(index[id(param)])
            if saved is not None and self.owner[id(param)] == self.rank:
                self.optim.state[param] = {k: (v.detach().clone().to(param.device) if _elementwise(v) else
                                               v.detach().clone() if torch.is_tensor(v) else v)
                                           for k, v in saved.items()}
    # --8<-- [end:state_dict]

    def join_hook(self, **kwargs) -> ReduceScatterJoinHook:
        return ReduceScatterJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.shards.buckets[0].buffer.device

    @property
    def join_process_group(self):
        return self.ddp.reducer.group


# --8<-- [start:refusals]
def _check_attachable(ddp) -> None:
    """What ZeRO through the engine cannot take, refused in one line before anything changes."""
    reducer = ddp.reducer
    if ddp._started:
        raise RuntimeError("ZeroOptimizer must attach before DDP's first forward (the shards are cut from the "
                           "buckets the first backward fills)")
    if reducer.registered_hook is not None or reducer.collective_owner is not None:
        raise RuntimeError("ZeroOptimizer: this DDP already has a comm hook or a ZeroOptimizer; the bucket's "
                           "collective is ZeRO's reduce-scatter, so wrap the model again without the hook")
    if reducer.as_view:
        raise ValueError("ZeroOptimizer: gradient_as_bucket_view=True makes .grad live in the bucket, which ZeRO "
                         "frees; wrap with gradient_as_bucket_view=False")
    if ddp.auto_cap is not None:
        raise ValueError("ZeroOptimizer: bucket_cap_mb='auto' rebuilds the buckets after the first step; ZeRO "
                         "keeps the first ones: give a number of MiB")
    if any(reducer.sparse):
        raise ValueError(f"ZeroOptimizer: {reducer.names[reducer.sparse.index(True)]} gets sparse gradients "
                         "(sparse=True) and ZeRO shards dense buckets; use sparse=False, or plain DDP")
# --8<-- [end:refusals]


def _elementwise(value) -> bool:
    return torch.is_tensor(value) and value.dim() > 0  # Adam's moments; its 0-d "step" is one number per piece


def _to_cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
