"""no_sync: local accumulation, where the forward must sit, and which micro-step syncs."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks

from models import MODELS


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _batch(rank, micro):
    torch.manual_seed(100 * rank + micro)
    return torch.randn(4, 8), torch.randn(4, 4)


def _accumulate(rank, world_size, k):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    plain = copy.deepcopy(model)  # no DDP at all: the local sum of gradients
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.001)
    inside = []
    for micro in range(k):
        x, y = _batch(rank, micro)
        F.mse_loss(plain(x), y).backward()
        if micro < k - 1:
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
            inside.append(_grads(model).clone())
        else:
            F.mse_loss(ddp(x), y).backward()  # the last micro-batch syncs the accumulated sum
    local_sum = _grads(plain)
    mean_of_sums = local_sum.clone()
    dist.all_reduce(mean_of_sums)
    mean_of_sums /= world_size
    return inside, local_sum, _grads(model), mean_of_sums


def test_inside_no_sync_gradients_stay_local_then_sync_averages_the_sums():
    results = run_on_ranks(_accumulate, 2, args=(3,), timeout=60)
    (inside0, local0, synced0, mean0), (inside1, local1, synced1, _) = results
    assert not torch.allclose(inside0[-1], inside1[-1]), ("inside no_sync the ranks' gradients became equal: they "
                                                          "must stay each rank's own local sums")  # no communication
    for rank, synced in enumerate((synced0, synced1)):
        assert torch.allclose(synced, mean0, atol=1e-6), (
            f"rank {rank}: after the synced backward the gradients differ from the mean over ranks of the local sums "
            f"of all 3 micro-batches by {(synced - mean0).abs().max().item():.2e}")
    assert not torch.allclose(local0, synced0)  # the sync really changed something


def _ours_and_torchs(rank):
    """The same model wrapped by miniddp and by torch (pairs of (ddp, module)), and one batch."""
    torch.manual_seed(0)
    model, twin = MODELS["mlp"](), MODELS["mlp"]()
    twin.load_state_dict(model.state_dict())
    ours = miniddp.DistributedDataParallel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = TorchDDP(twin)
    return {"ours": (ours, model), "torch": (theirs, twin)}, _batch(rank, 0)


def _was_synced(model, world_size) -> bool:
    """Gradients were averaged iff every rank holds the same ones."""
    g = _grads(model)
    total = g.clone()
    dist.all_reduce(total)
    return torch.allclose(g * world_size, total, atol=1e-6)


def _forward_placement(rank, world_size, which):
    pairs, (x, y) = _ours_and_torchs(rank)
    out = {}
    for name, (ddp, m) in pairs.items():
        if which == "forward_inside":
            with ddp.no_sync():
                loss = F.mse_loss(ddp(x), y)
            loss.backward()  # outside, but the forward was inside: no sync
        else:
            loss = F.mse_loss(ddp(x), y)
            with ddp.no_sync():
                loss.backward()  # inside, but the forward was outside: syncs
        out[name] = _was_synced(m, world_size)
    return out


@pytest.mark.parametrize("which, synced", [("forward_inside", False), ("backward_inside", True)],
                         ids=["forward_inside_no_sync", "only_backward_inside_no_sync"])
def test_what_counts_is_where_the_forward_ran_as_in_torch(which, synced):
    for rank, out in enumerate(run_on_ranks(_forward_placement, 2, args=(which,), timeout=60)):
        assert out["torch"] == synced  # torch's DDP: the oracle
        assert out["ours"] == synced, (f"rank {rank}, {which.replace('_', ' ')} no_sync: the gradients were "
                                       f"{'' if out['ours'] else 'not '}averaged; torch's DDP "
                                       f"{'averages' if synced else 'does not'}")


def _forward_in_between(rank, world_size, mode):
    pairs, (x, y) = _ours_and_torchs(rank)
    synced = {}
    for name, (ddp, m) in pairs.items():
        out = ddp(x)  # a synced forward...
        if mode == "no_grad":
            with torch.no_grad():
                ddp(x + 1)  # ...then a forward for targets or metrics...
        else:
            with ddp.no_sync():
                ddp(x + 1)
        F.mse_loss(out, y).backward()  # ...must not disarm the first one's sync
        synced[name] = _was_synced(m, world_size)
    return synced


@pytest.mark.parametrize("mode", ["no_grad", "no_sync"])
def test_a_forward_in_between_does_not_disarm_the_pending_sync(mode):
    for synced in run_on_ranks(_forward_in_between, 2, args=(mode,), timeout=60):
        assert synced == {"ours": True, "torch": True}


def test_should_sync_syncs_the_last_micro_batch_of_each_window():
    for k, n, expected in ((4, 10, [3, 7, 9]), (1, None, list(range(10))), (4, None, [3, 7])):
        syncs = [s for s in range(10 if n is None else n) if miniddp.should_sync(s, k, num_batches=n)]
        assert syncs == expected, f"should_sync(step, {k}, num_batches={n}) is True at steps {syncs}, not {expected}"
    for n, k, expected in ((10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 5, [3])):
        windows = miniddp.accumulation_windows(n, k)
        assert windows == expected, f"accumulation_windows({n}, {k}) is {windows}, not {expected}"


@pytest.mark.parametrize("bad", [0, -2])
def test_accumulation_steps_must_be_positive(bad):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        miniddp.should_sync(0, bad)


def _off_by_one(step, k, n):  # the classic bug: sync the *first* micro-batch of each window
    return step % k == 0


# --8<-- [start:schedule_oracle]
def _train_with_schedule(rank, world_size, schedule, k, n):
    """Accumulate over windows chosen by ``schedule``; compare with one process on all batches."""
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    oracle = copy.deepcopy(model)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt, opt_oracle = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(oracle.parameters(), lr=0.1)
    windows = miniddp.accumulation_windows(n, k)
    step, start = 0, 0
    for length in windows:
        batches = []
        for micro in range(length):
            x, y = _batch(rank, step)
            sync = schedule(step, k, n)
            with (miniddp.no_sync(ddp) if not sync else torch.enable_grad()):
                (F.mse_loss(ddp(x), y) / length).backward()
            batches.append((step, x, y))
            step += 1
        opt.step()
        opt.zero_grad()
        for s in range(start, step):  # the oracle sees every rank's micro-batches of the window
            for r in range(world_size):
                xr, yr = _batch(r, s)
                (F.mse_loss(oracle(xr), yr) / (length * world_size)).backward()
        opt_oracle.step()
        opt_oracle.zero_grad()
        start = step
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), oracle.parameters()))
# --8<-- [end:schedule_oracle]


def _right(step, k, n):
    return miniddp.should_sync(step, k, n)


def test_the_schedule_matches_one_process_and_the_off_by_one_does_not():
    right = run_on_ranks(_train_with_schedule, 2, args=(_right, 4, 10), timeout=60)
    wrong = run_on_ranks(_train_with_schedule, 2, args=(_off_by_one, 4, 10), timeout=60)
    assert max(right) < 1e-5, (f"4 micro-batches per window, no_sync on all but the last (should_sync), 10 in all: "
                               f"the parameters differ from one process on every rank's batches by {max(right):.2e}")
    assert min(wrong) > 1e-3  # the test can tell: syncing the first micro-batch is caught
