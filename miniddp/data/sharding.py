"""Sharding: which samples each rank reads, so that together they read the dataset once.

What
    ``ShardSampler(dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False)``
    is a ``Sampler`` that yields this rank's share of the dataset's indices. Every
    rank builds the *same* permutation of ``range(len(dataset))`` (``torch.randperm``
    seeded with ``seed + epoch``), pads it (or trims it, with ``drop_last``) to a
    multiple of ``num_replicas``, and keeps every ``num_replicas``-th index starting at
    its rank: ``indices[rank:total_size:num_replicas]``. Call ``set_epoch(e)`` at the
    start of each epoch, or every epoch sees the same order. The spec compares it
    with torch's ``DistributedSampler`` index for index (``__iter__`` says how).

Why
    Data parallelism splits a global batch across ranks. Two properties make the
    split correct: (1) the shards are disjoint and together cover the data, so an
    epoch reads each sample once (up to padding); (2) every rank gets the same
    number of samples, so every rank runs the same number of steps and no rank
    waits forever in an all-reduce the others never start. Striding by rank also
    makes step ``k``'s *global* batch a contiguous slice of the permutation,
    ``indices[k*B:(k+1)*B]`` for a global batch ``B``, whatever ``num_replicas``
    is: the reason training on N ranks can equal one process on the global batch.

How torch differs
    It does not, by design: this is ``torch.utils.data.DistributedSampler``
    (``torch/utils/data/distributed.py``), rewritten and held to it index for index
    by ``tests/test_sharding.py``. Two differences in the errors only: a
    ``num_replicas`` below 1 is a ``ValueError`` here (torch divides by zero
    later), and every message names the argument and the fix. Hugging Face's
    Trainer and Accelerate use torch's sampler (Accelerate wraps it as
    ``BatchSamplerShard`` when it shards a DataLoader itself).
"""

from __future__ import annotations

import json
import operator
import warnings
from collections.abc import Iterator, Sized
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def _default_replicas_and_rank(num_replicas, rank) -> tuple[int, int]:
    """Fill whichever of ``num_replicas`` / ``rank`` is ``None`` from the process group."""
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    if not (dist.is_available() and dist.is_initialized()):
        missing = " and ".join(n for n, v in (("num_replicas", num_replicas), ("rank", rank)) if v is None)
        raise ValueError(  # torch raises ValueError here too (from dist.get_world_size)
            f"ShardSampler: {missing} not given and torch.distributed is not initialised; "
            "call torch.distributed.init_process_group() (or miniddp.init_distributed()) first, "
            "or pass num_replicas=<world size> and rank=<this process's rank>"
        )
    if num_replicas is None:
        num_replicas = dist.get_world_size()
    if rank is None:
        rank = dist.get_rank()
    return num_replicas, rank


def _check_int(name: str, value) -> int:
    """An integer (numpy's too, via ``__index__``), else a ``ValueError`` naming the field."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"ShardSampler: {name}={value!r} must be an int") from None


class ShardSampler(Sampler[int]):
    """This rank's indices of ``dataset``: ``torch.utils.data.DistributedSampler``, rebuilt."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        num_replicas, rank = _default_replicas_and_rank(num_replicas, rank)
        num_replicas, rank = _check_int("num_replicas", num_replicas), _check_int("rank", rank)
        if num_replicas < 1:
            raise ValueError(
                f"ShardSampler: num_replicas={num_replicas} must be >= 1; it is the number of "
                "processes sharing the data, usually torch.distributed.get_world_size()"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"ShardSampler: rank={rank} must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}; "
                "pass this process's rank (torch.distributed.get_rank(), or RANK from torchrun)"
            )
        self.dataset = dataset  # anything with __len__; only its length is used
        self.num_replicas = num_replicas  # how many ranks share the data
        self.rank = rank  # which share this is, 0 .. num_replicas-1
        self.shuffle = shuffle  # permute (with seed + epoch) or keep dataset order
        self.seed = seed  # must be the same on every rank, or shards overlap
        self.drop_last = drop_last  # trim the tail instead of padding it
        self.epoch = 0  # set_epoch() changes it; part of the shuffle's seed
        self.iterated_epoch: int | None = None  # the epoch of the last __iter__: a repeat means no set_epoch
        self.num_samples = self._num_samples(len(dataset))  # indices this rank yields
        self.total_size = self.num_samples * num_replicas  # indices all ranks yield together
        self._agreement = _agreement_number(num_replicas, rank)  # compared across ranks at the first __iter__

    # --8<-- [start:num_samples]
    def _num_samples(self, n: int) -> int:
        """Samples per rank: ``ceil(n / num_replicas)`` (the tail padded), or ``n // num_replicas`` with drop_last."""
        ### BEGIN SOLUTION
        if self.drop_last:
            return n // self.num_replicas  # torch writes ceil((n - R) / R): the same number
        return -(-n // self.num_replicas)  # ceil(n / R) without floats
        ### END SOLUTION
    # --8<-- [end:num_samples]

    # --8<-- [start:iter]
    def __iter__(self) -> Iterator[int]:
        """``g = torch.Generator(); g.manual_seed(seed + epoch)``, ``indices = torch.randperm(len(dataset),
        generator=g).tolist()`` (``list(range(len(dataset)))`` without shuffle); padded to ``total_size`` by
        appending it again from its start (as many times round as it takes), or with drop_last cut to its first
        ``total_size``; then this rank's ``indices[rank:total_size:num_replicas]``, ``num_samples`` of them."""
        self._warn_if_set_epoch_was_forgotten()
        if self._agreement is not None:
            number, self._agreement = self._agreement, None  # once
            check_same_on_every_rank(number, self.rank, self.num_replicas,
                                     {"seed": self.seed, "len(dataset)": len(self.dataset), "shuffle": self.shuffle,
                                      "drop_last": self.drop_last})
        ### BEGIN SOLUTION
        n = len(self.dataset)
        if self.shuffle:  # the same permutation on every rank: same seed, same epoch
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))

        if self.drop_last:  # trim the tail: every rank still gets num_samples
            indices = indices[: self.total_size]
        else:  # pad by wrapping around from the start, as often as needed (n < R)
            while len(indices) < self.total_size:
                indices += indices[: self.total_size - len(indices)]
        assert len(indices) == self.total_size, (len(indices), self.total_size)

        shard = indices[self.rank : self.total_size : self.num_replicas]  # stride by rank
        assert len(shard) == self.num_samples, (len(shard), self.num_samples)
        return iter(shard)
        ### END SOLUTION
    # --8<-- [end:iter]

    def __len__(self) -> int:
        return self.num_samples

    def _warn_if_set_epoch_was_forgotten(self) -> None:
        """A second pass with the same epoch replays the same order (torch's sampler stays silent)."""
        if self.shuffle and self.iterated_epoch == self.epoch:
            warnings.warn(f"ShardSampler is iterated again with epoch={self.epoch}: every epoch will see the same "
                          "order. Call sampler.set_epoch(epoch) at the start of each epoch, on every rank.",
                          UserWarning, stacklevel=3)
        self.iterated_epoch = self.epoch

    # --8<-- [start:set_epoch]
    def set_epoch(self, epoch: int) -> None:
        """Store ``epoch`` (the shuffle uses ``seed + epoch``): call it at the start of every epoch, on every rank."""
        ### BEGIN SOLUTION
        self.epoch = epoch
        ### END SOLUTION
    # --8<-- [end:set_epoch]

    def __repr__(self) -> str:
        return (f"ShardSampler(len(dataset)={len(self.dataset)}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"epoch={self.epoch})")


AGREE_TIMEOUT_S = 5.0  # how long a first __iter__ waits for the other ranks' settings; then it goes on unchecked
_samplers_built = 0  # ShardSamplers of the default group built in this process: the n-th pairs up across ranks


def _agreement_number(num_replicas: int, rank: int) -> int | None:
    """This sampler's number among the default group's samplers, or None when it shards something else."""
    global _samplers_built
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if num_replicas != dist.get_world_size() or rank != dist.get_rank():
        return None
    _samplers_built += 1
    return _samplers_built


# --8<-- [start:agreement]
def check_same_on_every_rank(number: int, rank: int, world_size: int, settings: dict) -> None:
    """The n-th sampler of every rank must shard with the same settings, or the shards overlap (a seed
    that differs per rank: torch's sampler stays silent). Through the group's store, not a collective:
    a rank that iterates alone waits ``AGREE_TIMEOUT_S`` at most, then goes on unchecked."""
    store = dist.distributed_c10d._get_default_store()
    key = f"miniddp/shard_sampler/{number}"
    store.set(f"{key}/{rank}", json.dumps(settings))
    try:
        store.wait([f"{key}/{r}" for r in range(world_size)], timedelta(seconds=AGREE_TIMEOUT_S))
    except RuntimeError:  # the others are not iterating (yet): nothing to compare with
        return
    everyone = [json.loads(store.get(f"{key}/{r}")) for r in range(world_size)]
    differ = [name for name in settings if len({json.dumps(s[name]) for s in everyone}) > 1]
    if differ:
        values = "; ".join(f"{name}: " + ", ".join(f"rank {r} {s[name]!r}" for r, s in enumerate(everyone))
                           for name in differ)
        verb = "differs" if len(differ) == 1 else "differ"
        raise ValueError(f"ShardSampler: {', '.join(differ)} {verb} across ranks ({values}): every rank must "
                         "shard the same dataset with the same settings, or the shards overlap and some samples "
                         "are never seen. Pass the same seed on every rank (not seed + rank)")
# --8<-- [end:agreement]
