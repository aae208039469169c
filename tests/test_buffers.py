"""Module state: shape check and broadcast at wrap; buffers rebroadcast before each forward."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import miniddp
from miniddp.engine.buffers import ParameterMismatchError, broadcast_coalesced
from miniddp.launching.spawn import RankError, run_on_ranks

from models import MODELS


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _wrap_copies_rank0(rank, world_size):
    torch.manual_seed(rank)  # every rank builds a different model
    model = MODELS["batchnorm"]()
    model.bn.running_mean.fill_(float(rank))  # and different buffers
    mine = _state(model)
    miniddp.DistributedDataParallel(model)
    return mine, _state(model)


def test_wrap_broadcasts_parameters_and_buffers_from_rank_0():
    results = run_on_ranks(_wrap_copies_rank0, 3, timeout=60)
    rank0_before = results[0][0]
    for rank, (before, after) in enumerate(results):
        for name in rank0_before:
            assert torch.equal(after[name], rank0_before[name]), (rank, name)
    assert not torch.equal(results[1][0]["fc1.weight"], rank0_before["fc1.weight"])  # they did differ


class _Recorder(nn.Module):
    """Wraps the BatchNorm model and records its running mean as each forward begins."""

    def __init__(self):
        super().__init__()
        self.inner = MODELS["batchnorm"]()
        self.log = []

    def forward(self, x):
        self.log.append(self.inner.bn.running_mean.clone())
        return self.inner(x)


def _buffers_seen_by_forward(rank, world_size, broadcast):
    torch.manual_seed(0)
    model = _Recorder()
    ddp = miniddp.DistributedDataParallel(model, broadcast_buffers=broadcast)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        F.mse_loss(ddp(torch.randn(8, 8) + rank), torch.zeros(8, 4)).backward()
    return torch.stack(model.log)


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_buffers", "no_broadcast"])
def test_buffers_equal_rank_0s_at_every_forward_only_when_broadcast(broadcast):
    a, b = run_on_ranks(_buffers_seen_by_forward, 2, args=(broadcast,), timeout=60)
    if broadcast:
        for step, (x, y) in enumerate(zip(a, b)):  # each forward starts from rank 0's running stats
            assert torch.equal(x, y), f"broadcast_buffers=True: at forward {step} rank 1's running_mean is not rank 0's"
    else:
        assert torch.equal(a[0], b[0]), "the wrap must make the buffers equal"  # equal only before anyone trained...
        assert not torch.allclose(a[1:], b[1:]), ("broadcast_buffers=False: the ranks' running means became equal; "
                                                  "each must keep its own")  # ...then BatchNorm statistics drift apart


def _buffers_before_and_after(rank, world_size):
    torch.manual_seed(0)
    model = _Recorder()
    ddp = miniddp.DistributedDataParallel(model, broadcast_buffers=True)
    after = []  # this rank's running mean at the end of each step (its own forward updated it)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        F.mse_loss(ddp(torch.randn(8, 8) + rank), torch.zeros(8, 4)).backward()
        after.append(model.inner.bn.running_mean.clone())
    return torch.stack(model.log), torch.stack(after)


def test_each_forward_starts_from_rank_0s_buffers_not_another_ranks():
    """Equal on every rank is not enough: the buffers must be rank 0's (torch broadcasts from rank 0)."""
    results = run_on_ranks(_buffers_before_and_after, 3, timeout=60)
    rank0_after = results[0][1]
    for rank, (seen, _) in enumerate(results):  # forward k+1 starts from rank 0's state after step k
        for step in range(1, len(seen)):
            owner = next((r for r, (_, after) in enumerate(results) if torch.equal(seen[step], after[step - 1])), None)
            assert torch.equal(seen[step], rank0_after[step - 1]), (
                f"rank {rank}'s forward {step} starts from {'no rank' if owner is None else f'rank {owner}'}'s "
                f"running_mean after step {step - 1}, not rank 0's")
    assert not torch.equal(results[0][1], results[2][1])  # the ranks' own updates differ: the check can fail


def _two_forwards_one_backward(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["batchnorm"]()
    ddp = miniddp.DistributedDataParallel(model, broadcast_buffers=True)
    torch.manual_seed(rank)
    real, fake = torch.randn(8, 8), torch.randn(8, 8)
    loss = ddp(real).pow(2).mean() + ddp(fake).pow(2).mean()  # e.g. a GAN discriminator
    loss.backward()  # must not fail with "modified by an inplace operation"
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_two_forwards_before_one_backward():
    a, b = run_on_ranks(_two_forwards_one_backward, 2, timeout=60)
    assert torch.allclose(a, b), "after two forwards and one backward the ranks' gradients differ"


def _mismatch(rank, world_size, kind):
    if kind == "shape":
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if rank == 2 else 2))
    else:
        layers = [nn.Linear(4, 4)] + ([nn.Linear(4, 4)] if rank == 1 else [])
        model = nn.Sequential(*layers)
    miniddp.DistributedDataParallel(model)


def test_shape_mismatch_is_named_on_every_rank_without_hanging():
    with pytest.raises(RankError) as info:
        run_on_ranks(_mismatch, 3, args=("shape",), timeout=60, grace=10)
    assert isinstance(info.value.__cause__, ParameterMismatchError)
    message = str(info.value)
    assert "1.weight" in message and "rank 2" in message and "(2, 4)" in message and "(3, 4)" in message


def test_different_parameter_counts_are_named():
    with pytest.raises(RankError, match=r"rank 0 has 2 parameters, rank 1 has 4.*1\.weight"):
        run_on_ranks(_mismatch, 2, args=("count",), timeout=60, grace=10)


def _naive_broadcast(tensors):  # one broadcast per tensor: the reference
    for t in tensors:
        dist.broadcast(t, src=0)


def _coalesced_vs_naive(rank, world_size):
    torch.manual_seed(rank)
    tensors = [torch.randn(7), torch.randn(3, 3).double(), torch.arange(5) * (rank + 1), torch.randn(11)]
    copies = [t.clone() for t in tensors]
    broadcast_coalesced(tensors, bucket_bytes=40)  # tiny buckets: several messages per dtype
    _naive_broadcast(copies)
    return all(torch.equal(a, b) for a, b in zip(tensors, copies))


def test_coalesced_broadcast_equals_one_broadcast_per_tensor():
    for rank, same in enumerate(run_on_ranks(_coalesced_vs_naive, 3, timeout=60)):
        assert same, f"rank {rank}: broadcast_coalesced(bucket_bytes=40) gave other values than a broadcast per tensor"
