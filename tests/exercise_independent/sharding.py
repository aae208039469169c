"""An independent correct solution of ``sharding``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: the sample count comes from ``divmod`` (full rounds, plus one if a
tail is left and padded); the padding cycles the permutation with ``itertools.cycle``/``islice``
(however many times it must wrap) and the same ``islice`` trims with ``drop_last``; the rank's share is a
column of the padded permutation viewed as a ``(num_samples, num_replicas)`` tensor, not a stride slice.
The permutation itself can only be ``torch.randperm`` seeded with ``seed + epoch`` on a fresh
``torch.Generator``: the spec demands torch's indices, index for index.
"""

from __future__ import annotations

import itertools
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
        """Samples per rank: round up (pad) by default, round down (trim) with drop_last."""
        rounds, left_over = divmod(n, self.num_replicas)  # full rounds of one sample per rank, and the tail
        padded = left_over and not self.drop_last  # the tail becomes one more (padded) round, or is dropped
        return rounds + 1 if padded else rounds
    # --8<-- [end:num_samples]

    # --8<-- [start:iter]
    def __iter__(self) -> Iterator[int]:
        self._warn_if_set_epoch_was_forgotten()
        if self._agreement is not None:
            number, self._agreement = self._agreement, None  # once
            check_same_on_every_rank(number, self.rank, self.num_replicas,
                                     {"seed": self.seed, "len(dataset)": len(self.dataset), "shuffle": self.shuffle,
                                      "drop_last": self.drop_last})
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)  # the same on every rank: one shared permutation
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        # pad by wrapping around the permutation (as often as needed), or trim the tail with drop_last
        padded = torch.tensor(list(itertools.islice(itertools.cycle(order.tolist()), self.total_size)),
                              dtype=torch.long)
        # row k holds step k's samples of every rank; this rank reads its column
        mine = padded.view(self.num_samples, self.num_replicas)[:, self.rank]
        return iter(mine.tolist())
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
        """Reseed the shuffle: call at the start of every epoch, on every rank, with the same value."""
        self.epoch = int(epoch)
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
