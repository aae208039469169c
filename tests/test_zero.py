"""ZeRO-1 (miniddp.ZeroRedundancyOptimizer) against torch's ZeroRedundancyOptimizer and one plain AdamW.

Every rank builds the model from a different seed (the DDP wrap makes them equal), then trains three copies
on the same per-rank batches: DDP + our ZeRO, DDP + torch's ZeRO, and (for the oracle) one process's plain AdamW
on the whole global batch. Ours and torch's see identical averaged gradients, so their parameters must be
bitwise equal; against the single process, whose gradient is one mean over the global batch instead of a mean of
per-rank means, to 1e-5. Each rank keeps optimizer state only for the parameters it owns.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.engine.join import Join
from miniddp.launching.spawn import run_on_ranks
from miniddp.zero.zero_partition import partition_by_size
from miniddp.zero.zero_redundancy_optimizer import ZeroRedundancyOptimizer

STEPS = 4


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12),
                               torch.nn.ReLU(), torch.nn.Linear(12, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _wrap(kind, model):
    if kind == "miniddp":
        return miniddp.DistributedDataParallel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return TorchDDP(model)


def _flat(tensors):
    return torch.cat([t.detach().double().flatten() for t in tensors])


def _diff(a, b):
    return (_flat(a) - _flat(b)).abs().max().item()


def _spread(tensors):
    """The largest difference between this rank's tensors and any other rank's."""
    flat = _flat(tensors)
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return max((e - flat).abs().max().item() for e in everyone)


def _state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _train(ddp, opt, steps, rank, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step, rank)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


# --8<-- [start:parity]
def _parity(rank, world_size, kind, skip_broadcast):
    torch.set_num_threads(1)
    ours_model, theirs_model = _model(1000 + rank), _model(1000 + rank)
    ours, theirs = _wrap(kind, ours_model), _wrap(kind, theirs_model)
    opt = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.01)
    ref = TorchZeRO(theirs.parameters(), torch.optim.AdamW, lr=0.01)
    if skip_broadcast:  # the negative control: each rank updates only its own shard
        opt._sync_params = lambda: None
    single = copy.deepcopy(ours_model)  # after the wrap: rank 0's parameters, as the others
    single_opt = torch.optim.AdamW(single.parameters(), lr=0.01)
    _train(ours, opt, STEPS, rank)
    _train(theirs, ref, STEPS, rank)
    for step in range(STEPS):  # one process, the whole global batch
        batches = [_batch(step, r) for r in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        F.mse_loss(single(x), y).backward()
        single_opt.step()
        single_opt.zero_grad()
    params = list(ours_model.parameters())
    owner = {id(p): r for r, groups in enumerate(opt.owned) for g in groups for p in g}
    owners = [owner[id(p)] for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    owned_with_state = sorted(index[id(p)] for p in opt.optim.state)
    return dict(vs_torch=_diff(params, theirs_model.parameters()), vs_single=_diff(params, single.parameters()),
                spread=_spread(params), owners=owners, torch_owners=[ref._param_to_rank[p] for p in
                                                                     theirs_model.parameters()],
                owned_with_state=owned_with_state, mine=sorted(i for i, o in enumerate(owners) if o == rank),
                state_bytes=_state_bytes(opt.optim), torch_state_bytes=_state_bytes(ref.optim),
                single_state_bytes=_state_bytes(single_opt))
# --8<-- [end:parity]


@pytest.mark.parametrize("kind", ["miniddp", "torch"])
def test_matches_torch_zero_and_one_process(kind):
    results = run_on_ranks(_parity, 2, args=(kind, False), timeout=120)
    for rank, r in enumerate(results):
        assert r["vs_torch"] == 0.0, f"rank {rank}: differs from torch's ZeRO by {r['vs_torch']:.2e}"
        assert r["vs_single"] < 1e-5, f"rank {rank}: differs from one process's AdamW by {r['vs_single']:.2e}"
        assert r["spread"] == 0.0
        assert r["owners"] == r["torch_owners"]  # the same partition as torch's
        assert r["owned_with_state"] == r["mine"] and r["mine"]  # state only for the owned parameters
        assert r["state_bytes"] == r["torch_state_bytes"]
    total = sum(r["state_bytes"] for r in results)
    assert total == results[0]["single_state_bytes"]  # sharded, not repeated: the whole state once
    assert all(r["state_bytes"] < 0.75 * total for r in results)  # about half each on two ranks


def test_negative_without_the_broadcast_ranks_diverge():
    results = run_on_ranks(_parity, 2, args=("miniddp", True), timeout=120)
    assert all(r["spread"] > 0 and r["vs_torch"] > 0 for r in results)


def test_partition_is_greedy_by_size():
    params = [torch.zeros(n) for n in (3, 10, 4, 7)]
    owned = partition_by_size([{"params": params[:2]}, {"params": params[2:]}], 2)
    # group 0: 10 -> rank 0, 3 -> rank 1; group 1 (totals 10, 3): 7 -> rank 1, 4 -> rank 1 (10 vs 10: rank 0)
    assert [[[p.numel() for p in g] for g in rank] for rank in owned] == [[[10], [4]], [[3], [7]]]


def _add_group_and_round_trip(rank, world_size):
    torch.set_num_threads(1)
    model, twin = _model(7), _model(7)
    ours, theirs = _wrap("miniddp", model), _wrap("miniddp", twin)
    opt = ZeroRedundancyOptimizer(list(model.parameters())[:4], torch.optim.AdamW, lr=0.01)
    ref = TorchZeRO(list(twin.parameters())[:4], torch.optim.AdamW, lr=0.01)
    _train(ours, opt, 2, rank)
    _train(theirs, ref, 2, rank)
    opt.add_param_group({"params": list(model.parameters())[4:], "lr": 0.02})
    ref.add_param_group({"params": list(twin.parameters())[4:], "lr": 0.02})
    _train(ours, opt, 2, rank, first=2)
    _train(theirs, ref, 2, rank, first=2)
    after_add = _diff(model.parameters(), twin.parameters())
    opt.consolidate_state_dict(to=0)
    ref.consolidate_state_dict(to=0)
    refused = False
    if rank == 1:
        try:
            opt.state_dict()
        except RuntimeError:
            refused = True
    box = [opt.state_dict() if rank == 0 else None]
    if rank == 0:  # the same format and values as torch's consolidated state dict
        theirs_sd = ref.state_dict()
        assert box[0]["state"].keys() == theirs_sd["state"].keys()
        for i, s in box[0]["state"].items():
            assert all(torch.equal(v, theirs_sd["state"][i][k]) for k, v in s.items())
        assert [g["lr"] for g in box[0]["param_groups"]] == [g["lr"] for g in theirs_sd["param_groups"]]
    dist.broadcast_object_list(box, src=0)
    restored_model = copy.deepcopy(model)
    restored = ZeroRedundancyOptimizer(list(restored_model.parameters())[:4], torch.optim.AdamW, lr=0.5)
    restored.add_param_group({"params": list(restored_model.parameters())[4:], "lr": 0.5})
    restored.load_state_dict(box[0])
    restored_ddp = _wrap("miniddp", restored_model)
    _train(ours, opt, 3, rank, first=4)
    _train(restored_ddp, restored, 3, rank, first=4)
    return after_add, refused, _diff(model.parameters(), restored_model.parameters()), _spread(model.parameters())


def test_add_param_group_and_state_dict_round_trip():
    results = run_on_ranks(_add_group_and_round_trip, 2, timeout=120)
    after_add, refused, continued, spread = zip(*results)
    assert after_add == (0.0, 0.0)  # add_param_group: bitwise torch's
    assert refused == (False, True)  # state_dict only where consolidated
    assert continued == (0.0, 0.0)  # training continues identically after load_state_dict
    assert spread == (0.0, 0.0)


# --8<-- [start:join]
def _uneven(rank, world_size):
    torch.set_num_threads(1)
    steps = 5 + 2 * rank  # rank 1 has two more batches than rank 0
    ours_model, theirs_model = _model(1000 + rank), _model(1000 + rank)
    ours, theirs = _wrap("miniddp", ours_model), _wrap("torch", theirs_model)
    opt = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.01)
    ref = TorchZeRO(theirs.parameters(), torch.optim.AdamW, lr=0.01)
    with Join([ours, opt]):
        _train(ours, opt, steps, rank)
    with TorchJoin([theirs, ref]):
        _train(theirs, ref, steps, rank)
    return _diff(ours_model.parameters(), theirs_model.parameters()), _spread(ours_model.parameters())
# --8<-- [end:join]


def test_uneven_inputs_under_join_match_torch():
    for vs_torch, spread in run_on_ranks(_uneven, 2, timeout=120):
        assert vs_torch == 0.0 and spread == 0.0


@pytest.mark.parametrize("name", ["parameters_as_bucket_view", "overlap_with_ddp"])
def test_unbuilt_options_are_refused(name):
    with pytest.raises(NotImplementedError):
        ZeroRedundancyOptimizer(_model(0).parameters(), torch.optim.AdamW, lr=0.01, **{name: True})


def _adapter(rank, world_size):
    torch.set_num_threads(1)
    get_sharded_optimizer = lambda params, optimizer_cls, **kwargs: miniddp.ZeroRedundancyOptimizer(  # noqa: E731
        params, optimizer_cls, **kwargs)
    model, plain_model = _model(3), _model(3)
    sharded = get_sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(3):  # the same batch on every rank: the same gradients, no DDP needed
        x, y = _batch(step, 0)
        for m, o in ((model, sharded), (plain_model, plain)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    return _diff(model.parameters(), plain_model.parameters())


def test_cs336_adapter_steps_like_the_plain_optimizer():
    assert run_on_ranks(_adapter, 2, timeout=120) == [0.0, 0.0]
