"""ShardSampler: the same indices as torch's DistributedSampler, and the properties that make it right.

The oracle is ``torch.utils.data.DistributedSampler``: for every dataset length,
replica count, rank, seed, epoch, ``shuffle`` and ``drop_last``, ours must yield
the same indices in the same order. The properties are tested on their own too,
so a reader sees *why* those indices are right: shards are disjoint, cover the
data, have equal lengths, and step k's global batch does not depend on how many
ranks share it.
"""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from miniddp.data.sharding import ShardSampler
from miniddp.launching.spawn import RankError, run_on_ranks
from miniddp.testing import backend_params


class Sized:
    """A dataset that is only a length: samplers never look at the items."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def shards(n, replicas, epoch=0, **kw):
    """Every rank's indices for one configuration, in rank order."""
    samplers = [ShardSampler(Sized(n), replicas, r, **kw) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


configs = st.fixed_dictionaries({
    "n": st.integers(0, 200),
    "replicas": st.integers(1, 12),
    "shuffle": st.booleans(),
    "seed": st.integers(-(2**31), 2**31),
    "drop_last": st.booleans(),
})


# --8<-- [start:parity]
@settings(max_examples=300, deadline=None)
@given(cfg=configs, rank_frac=st.floats(0, 1, exclude_max=True), epoch=st.integers(0, 10_000))
def test_same_indices_as_torch_distributed_sampler(cfg, rank_frac, epoch):
    rank = int(rank_frac * cfg["replicas"])
    kw = dict(shuffle=cfg["shuffle"], seed=cfg["seed"], drop_last=cfg["drop_last"])
    ours = ShardSampler(Sized(cfg["n"]), cfg["replicas"], rank, **kw)
    theirs = DistributedSampler(Sized(cfg["n"]), cfg["replicas"], rank, **kw)
    ours.set_epoch(epoch)
    theirs.set_epoch(epoch)
    case = f"len {cfg['n']}, rank {rank} of {cfg['replicas']}, epoch {epoch}, {kw}"
    _same_indices(list(ours), list(theirs), case)
    assert len(ours) == len(theirs), f"{case}: len(sampler) is {len(ours)}, torch's {len(theirs)}"
    assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size), (
        f"{case}: (num_samples, total_size) is {(ours.num_samples, ours.total_size)}, torch's "
        f"{(theirs.num_samples, theirs.total_size)}")


def _same_indices(ours, theirs, case):
    if ours != theirs:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise AssertionError(f"{case}: {len(ours)} indices, torch's {len(theirs)}; the first difference at "
                             f"position {at}: {ours[at:at + 3]} where torch yields {theirs[at:at + 3]}")
# --8<-- [end:parity]


@pytest.mark.parametrize("n,replicas", [(0, 1), (0, 4), (1, 1), (1, 7), (3, 10), (5, 5), (6, 4), (2, 9), (17, 16)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop_last"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffle"])
def test_edge_cases_match_torch(n, replicas, drop_last, shuffle):
    """Empty datasets, fewer samples than ranks (padding wraps several times), one rank."""
    for rank in range(replicas):
        kw = dict(shuffle=shuffle, drop_last=drop_last, seed=3)
        ours, theirs = ShardSampler(Sized(n), replicas, rank, **kw), DistributedSampler(Sized(n), replicas, rank, **kw)
        _same_indices(list(ours), list(theirs), f"len {n}, rank {rank} of {replicas}, {kw}")


def test_padding_wraps_several_times_when_fewer_samples_than_ranks():
    # 2 samples, 5 ranks: [0, 1] + [0, 1] + [0] -> every rank gets exactly one index
    assert shards(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]
    assert shards(2, 5, shuffle=False, drop_last=True) == [[]] * 5  # nothing left to share


# --8<-- [start:properties]
@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_every_rank_gets_the_same_number_of_samples(cfg):
    """Equal lengths -> equal step counts -> no rank left waiting in an all-reduce."""
    n, replicas = cfg.pop("n"), cfg.pop("replicas")
    lengths = [len(s) for s in shards(n, replicas, **cfg)]
    assert len(set(lengths)) == 1, f"len {n}, {replicas} ranks, {cfg}: the ranks get {lengths} samples"


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_shards_cover_the_data_and_overlap_only_by_padding(cfg):
    n, replicas = cfg.pop("n"), cfg.pop("replicas")
    everything = [i for s in shards(n, replicas, **cfg) for i in s]
    counts = Counter(everything)
    case, twice = f"len {n}, {replicas} ranks, {cfg}", sorted(i for i, c in counts.items() if c > 1)
    if cfg["drop_last"]:  # the tail is dropped, nothing repeats
        assert len(everything) == n - n % replicas, f"{case}: {len(everything)} indices in all, not {n - n % replicas}"
        assert not twice, f"{case}: indices {twice[:5]} are read more than once"
    else:  # all of the data, plus exactly total_size - n padded repeats
        missing = sorted(set(range(n)) - set(everything))
        assert not missing, f"{case}: indices {missing[:5]} are never read"
        padded = len(everything) - n
        assert padded == (-n) % replicas, f"{case}: {padded} padded repeats, not {(-n) % replicas}"
    if n % replicas == 0:  # no padding needed: the shards are disjoint
        assert not twice, f"{case}: no padding is needed, yet indices {twice[:5]} are read more than once"


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 300), per_step=st.sampled_from([12, 24, 36]), seed=st.integers(0, 99),
       epoch=st.integers(0, 5))
def test_global_batch_is_the_same_set_whatever_the_split(n, per_step, seed, epoch):
    """Step k's global batch is perm[k*B:(k+1)*B] whether 1, 2, 3, 4, 6 or 12 ranks share it."""
    def global_batches(replicas):
        local = per_step // replicas  # per-rank batch size: B = local * replicas
        parts = shards(n, replicas, epoch, seed=seed, shuffle=True, drop_last=True)
        steps = len(parts[0]) // local  # full steps only (all ranks have the same length)
        return [sorted(i for p in parts for i in p[k * local:(k + 1) * local]) for k in range(steps)]

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    full_steps = n // per_step
    reference = [sorted(perm[k * per_step:(k + 1) * per_step]) for k in range(full_steps)]
    for replicas in (1, 2, 3, 4, 6, 12):
        batches = global_batches(replicas)[:full_steps]
        case = f"len {n}, seed {seed}, epoch {epoch}, {replicas} ranks of {per_step // replicas} samples"
        assert len(batches) == full_steps, f"{case}: {len(batches)} full steps of {per_step}, not {full_steps}"
        for k, (got, want) in enumerate(zip(batches, reference)):
            assert got == want, (f"{case}: step {k}'s global batch is not the permutation's samples "
                                 f"{k * per_step} to {(k + 1) * per_step - 1}")
# --8<-- [end:properties]


@pytest.mark.filterwarnings("ignore::UserWarning")  # miniddp's warning for the repeat; a learner's file need not
def test_without_set_epoch_every_epoch_has_the_same_order():
    sampler = ShardSampler(Sized(50), num_replicas=2, rank=0)
    first, second = list(sampler), list(sampler)
    assert first == second, "two passes without set_epoch must give the same order"  # the trap
    sampler.set_epoch(1)
    assert list(sampler) != first, "set_epoch(1) must reshuffle: epoch 1 gave epoch 0's order"
    sampler.set_epoch(0)
    assert list(sampler) == first, "set_epoch(0) again must give epoch 0's order back"  # deterministic


def test_a_different_seed_per_rank_overlaps_and_misses_samples():
    """The other trap: seeding the sampler with the rank makes each rank shuffle differently."""
    parts = [list(ShardSampler(Sized(40), 2, r, seed=r)) for r in range(2)]  # seed=rank: wrong
    assert set(parts[0]) & set(parts[1])  # some samples twice per epoch...
    assert set(parts[0]) | set(parts[1]) != set(range(40))  # ...and some never


def test_shuffle_false_is_strided_dataset_order():
    assert shards(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_works_as_a_dataloader_sampler():
    ds = TensorDataset(torch.arange(20))
    sampler = ShardSampler(ds, num_replicas=3, rank=1, seed=7)
    seen = [int(x) for (batch,) in DataLoader(ds, batch_size=4, sampler=sampler) for x in batch]
    assert seen == list(DistributedSampler(ds, num_replicas=3, rank=1, seed=7))


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_replicas=2, rank=2), "rank=2"),
    (dict(num_replicas=2, rank=-1), "rank=-1"),
    (dict(num_replicas=0, rank=0), "num_replicas=0"),
    (dict(num_replicas=-3, rank=0), "num_replicas=-3"),
    (dict(num_replicas=2.0, rank=0), "num_replicas=2.0"),
    (dict(num_replicas=2, rank="0"), "rank='0'"),
])
def test_invalid_rank_or_replicas_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ShardSampler(Sized(10), **kwargs)


def test_numpy_integers_are_accepted():
    import numpy as np

    sampler = ShardSampler(Sized(10), np.int64(3), np.int32(1))
    assert (sampler.num_replicas, sampler.rank) == (3, 1) and type(sampler.rank) is int
    assert list(sampler) == list(DistributedSampler(Sized(10), 3, 1))


def test_torch_also_rejects_an_out_of_range_rank():
    with pytest.raises(ValueError):
        DistributedSampler(Sized(10), num_replicas=2, rank=2)


@pytest.mark.parametrize("kwargs", [{}, {"num_replicas": 2}, {"rank": 0}])
def test_defaults_need_an_initialised_process_group(kwargs):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        ShardSampler(Sized(10), **kwargs)


# --- on real ranks: the defaults come from the process group -----------------------------------

def _default_shard(rank, world_size, n):
    sampler = ShardSampler(Sized(n), seed=5)
    sampler.set_epoch(2)
    assert (sampler.num_replicas, sampler.rank) == (world_size, rank)
    return list(sampler)


@pytest.mark.parametrize("backend", backend_params(3))
def test_defaults_come_from_torch_distributed(backend):
    got = run_on_ranks(_default_shard, 3, args=(11,), backend=backend, timeout=60)
    for rank, indices in enumerate(got):
        expected = DistributedSampler(Sized(11), 3, rank, seed=5)
        expected.set_epoch(2)
        assert indices == list(expected)


def _bad_rank(rank, world_size):
    ShardSampler(Sized(4), rank=world_size)  # num_replicas from the group, rank out of range


def test_a_rank_out_of_range_fails_on_the_ranks_with_a_clear_error():
    with pytest.raises(RankError) as info:
        run_on_ranks(_bad_rank, 2, timeout=60)
    assert isinstance(info.value.__cause__, ValueError)
    assert "rank=2 must be in [0, 1]" in str(info.value.__cause__)
