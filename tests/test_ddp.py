"""miniddp.DistributedDataParallel against torch's DDP, side by side in one process group.

Every rank builds the model from a *different* seed (so the wrap's broadcast is
tested), deep-copies it, wraps one copy in miniddp's DDP and one in torch's, and
feeds both the same per-rank batches. After every backward the gradients must
match; after every optimizer step the parameters (and buffers) must match, and
be identical on every rank.
"""

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.testing import backend_params

from models import MODELS

TORCH_ONLY = {"tracer"}


def _torch_ddp(model, options, device):
    opts = {k: v for k, v in options.items() if k not in TORCH_ONLY}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames broadcast_buffers
        return TorchDDP(model, device_ids=[device] if device.type == "cuda" else None, **opts)


def _max_diff(a, b):
    if a is None or b is None:
        assert a is None and b is None, "one side has a gradient, the other has None"
        return 0.0
    return (a.double() - b.double()).abs().max().item()


# --8<-- [start:parity]
def _parity(rank, world_size, backend, model_name, options, steps, accumulation, branch_on):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(1000 + rank)  # different on every rank: only the wrap makes them equal
    mine = MODELS[model_name]().to(device)
    theirs = copy.deepcopy(mine)
    ours = miniddp.DistributedDataParallel(mine, **options)
    ref = _torch_ddp(theirs, options, device)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    worst_grad = worst_param = 0.0
    for step in range(steps):
        for micro in range(accumulation):
            torch.manual_seed(10_000 * step + 100 * micro + rank)  # each rank its own shard
            x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
            if model_name == "branchy":
                mine.use_branch = theirs.use_branch = branch_on(step, rank, micro)
            last = micro == accumulation - 1
            for model, opt in ((ours, opt_ours), (ref, opt_ref)):
                with nullcontext() if last else model.no_sync():
                    F.mse_loss(model(x), y).backward()
            for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
                worst_grad = max(worst_grad, _max_diff(p.grad, q.grad))
        opt_ours.step()
        opt_ref.step()
        opt_ours.zero_grad()
        opt_ref.zero_grad()
        for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()):
            worst_param = max(worst_param, _max_diff(a, b))
    flat = torch.cat([p.detach().double().flatten() for p in mine.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    spread = max((e - everyone[0]).abs().max().item() for e in everyone)
    return worst_grad, worst_param, spread
# --8<-- [end:parity]


def _always(step, rank, micro):
    return True


def _some_ranks(step, rank, micro):  # rank 0 skips the branch on even steps: unused on *some* ranks
    return not (rank == 0 and step % 2 == 0)


def _no_rank_on_odd_steps(step, rank, micro):  # nobody uses it on odd steps: unused on *every* rank
    return step % 2 == 0


def _only_before_the_sync(step, rank, micro):  # used under no_sync, unused in the synced micro-step
    return micro == 0 or (rank == 1 and step % 2 == 0)


CASES = {
    "mlp": ("mlp", {}, 1, _always),
    "tied_weights": ("tied", {}, 1, _always),
    "frozen": ("frozen", {}, 1, _always),
    "batchnorm_buffers": ("batchnorm", {}, 1, _always),
    "batchnorm_no_broadcast": ("batchnorm", {"broadcast_buffers": False}, 1, _always),
    "mixed_dtypes": ("mixed_dtypes", {}, 1, _always),
    "many_tiny_buckets": ("mlp", {"bucket_cap_mb": 0.0005}, 1, _always),
    "bucket_view": ("mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, 1, _always),
    "accumulation": ("mlp", {"bucket_cap_mb": 0.001}, 3, _always),
    "accumulation_bucket_view": ("tied", {"gradient_as_bucket_view": True}, 3, _always),
    "reverse_order_rebuild": ("reverse_order", {"bucket_cap_mb": 0.001}, 1, _always),
    "unused_on_some_ranks": ("branchy", {"find_unused_parameters": True}, 1, _some_ranks),
    "unused_on_every_rank": ("branchy", {"find_unused_parameters": True, "bucket_cap_mb": 0.001}, 1,
                             _no_rank_on_odd_steps),
    "unused_bucket_view": ("branchy", {"find_unused_parameters": True, "gradient_as_bucket_view": True}, 2,
                           _some_ranks),
    # a gradient accumulated under no_sync counts even if the synced micro-step does not use the parameter
    "unused_only_in_synced_micro_step": ("branchy", {"find_unused_parameters": True}, 3, _only_before_the_sync),
    "unused_only_in_synced_micro_step_view": ("branchy", {"find_unused_parameters": True,
                                                          "gradient_as_bucket_view": True}, 3, _only_before_the_sync),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_ddp(case):
    model_name, options, accumulation, branch_on = CASES[case]
    world_size = 3 if case in ("mlp", "unused_on_some_ranks", "mixed_dtypes") else 2
    results = run_on_ranks(_parity, world_size, args=("gloo", model_name, options, 4, accumulation, branch_on),
                           timeout=90)
    for rank, (grad_diff, param_diff, spread) in enumerate(results):
        assert grad_diff < 1e-5, f"{case}, rank {rank}: gradients differ from torch DDP by {grad_diff:.2e}"
        assert param_diff < 1e-5, f"{case}, rank {rank}: parameters differ from torch DDP by {param_diff:.2e}"
        assert spread == 0.0, f"{case}, rank {rank}: ranks hold different parameters ({spread:.2e} apart)"


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"world{n}")
def test_matches_torch_ddp_at_several_world_sizes(world_size):
    results = run_on_ranks(_parity, world_size, args=("gloo", "mlp", {"bucket_cap_mb": 0.001}, 3, 2, _always),
                           timeout=90)
    for rank, (grad_diff, param_diff, spread) in enumerate(results):
        assert max(grad_diff, param_diff) < 1e-5, (f"{world_size} ranks, rank {rank}: gradients differ from torch "
                                                   f"DDP by {grad_diff:.2e}, parameters by {param_diff:.2e}")
        assert spread == 0.0, f"{world_size} ranks, rank {rank}: ranks hold different parameters ({spread:.2e} apart)"


@pytest.mark.parametrize("backend", backend_params(1))
def test_world_of_one_on_every_backend(backend):
    # one GPU cannot hold two NCCL ranks: the NCCL path is checked at world size 1
    [(grad_diff, param_diff, _)] = run_on_ranks(_parity, 1, args=(backend, "mlp", {}, 2, 1, _always),
                                                backend=backend, timeout=90)
    assert grad_diff < 1e-5 and param_diff < 1e-5


def _gloo_on_cuda(rank, world_size):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    torch.manual_seed(rank)
    model = MODELS["mlp"]().to(device)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.001)
    torch.manual_seed(100 + rank)
    x = torch.randn(6, 8, device=device)
    F.mse_loss(ddp(x), torch.zeros(6, 4, device=device)).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    mean = grads.clone()
    dist.all_reduce(mean)
    return (grads - mean / world_size).abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_with_two_gloo_ranks():
    # one GPU cannot hold two NCCL ranks, but two gloo ranks can share it: this runs the
    # CUDA code paths (bucket buffers, views, copies on the GPU) with real communication
    assert max(run_on_ranks(_gloo_on_cuda, 2, timeout=120)) < 1e-6


# --8<-- [start:whole_batch]
def _against_one_process(rank, world_size, steps):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    oracle = copy.deepcopy(model)  # trained alone on the whole global batch
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt, opt_oracle = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (ddp, oracle))
    for step in range(steps):
        torch.manual_seed(step)
        x, y = torch.randn(4 * world_size, 8), torch.randn(4 * world_size, 4)
        F.mse_loss(ddp(x[rank::world_size]), y[rank::world_size]).backward()  # my shard
        F.mse_loss(oracle(x), y).backward()  # everything
        opt.step()
        opt_oracle.step()
        opt.zero_grad()
        opt_oracle.zero_grad()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), oracle.parameters()))
# --8<-- [end:whole_batch]


def test_equals_one_process_on_the_global_batch():
    for rank, diff in enumerate(run_on_ranks(_against_one_process, 3, args=(5,), timeout=60)):
        assert diff < 1e-5, (f"rank {rank}: after 5 steps on its shard, the parameters differ from one process "
                             f"trained on the whole global batch by {diff:.2e}")


def _without_ddp(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    torch.manual_seed(rank)
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_negative_without_averaging_ranks_have_different_gradients():
    a, b = run_on_ranks(_without_ddp, 2, timeout=60)
    assert not torch.allclose(a, b)  # so the equalities above are not vacuous


def _no_process_group(rank, world_size):
    dist.destroy_process_group()
    try:
        miniddp.DistributedDataParallel(MODELS["mlp"]())
    except RuntimeError as err:
        return str(err)


def test_wrapping_without_a_process_group_says_what_to_call():
    [message] = run_on_ranks(_no_process_group, 1, timeout=30)
    assert "init_distributed" in message


def _bad_args(rank, world_size):
    errors = []
    for kwargs in ({"bucket_cap_mb": 0}, {"bucket_cap_mb": -1}, {"device_ids": [0, 1]}):
        try:
            miniddp.DistributedDataParallel(MODELS["mlp"](), **kwargs)
        except ValueError as err:
            errors.append(str(err))
    frozen = MODELS["mlp"]().requires_grad_(False)
    try:
        miniddp.DistributedDataParallel(frozen)
    except RuntimeError as err:  # torch's type (test_DistributedDataParallel_requires_grad)
        errors.append(str(err))
    return errors


def test_bad_arguments_are_named():
    [errors] = run_on_ranks(_bad_args, 1, timeout=30)
    assert len(errors) == 4
    assert "bucket_cap_mb=0" in errors[0] and "bucket_cap_mb=-1" in errors[1]
    assert "device_ids" in errors[2] and "requires_grad" in errors[3]


def _inputs_follow_device_ids(rank, world_size):
    torch.cuda.set_device(0)  # one GPU, two gloo ranks
    model = MODELS["mlp"]().cuda()
    ddp = miniddp.DistributedDataParallel(model, device_ids=[0])
    x = {"x": torch.randn(6, 8)}  # CPU inputs, nested in a dict, as a data loader yields them
    out = ddp(**x)
    F.mse_loss(out, torch.zeros(6, 4, device="cuda")).backward()
    return str(out.device), str(model.fc1.weight.grad.device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inputs_move_to_the_device_in_device_ids_as_in_torch():
    assert run_on_ranks(_inputs_follow_device_ids, 2, timeout=120) == [("cuda:0", "cuda:0")] * 2
