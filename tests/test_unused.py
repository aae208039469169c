"""Unused parameters: the graph walk, and the error in the same backward when not allowed."""

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.engine.unused import UnusedParameterError, unused_parameters
from miniddp.launching.spawn import run_on_ranks

from models import MODELS


def test_graph_walk_finds_exactly_the_parameters_off_the_path():
    model = MODELS["branchy"]()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    model.use_branch = False
    found = unused_parameters(model(torch.randn(2, 8)), params)
    assert found == [2, 3], f"branch skipped: found {found} ({[names[i] for i in found]}), not [2, 3] (branch.*)"
    model.use_branch = True
    found = unused_parameters(model(torch.randn(2, 8)), params)
    assert found == [], f"every layer used: found {found} ({[names[i] for i in found]}) unused"
    found = unused_parameters({"out": [model(torch.randn(2, 8))]}, params)  # nested outputs
    assert found == [], f"outputs nested as {{'out': [tensor]}}: found {found} ({[names[i] for i in found]}) unused"


def _unused_without_flag(rank, world_size, unused_on):
    torch.manual_seed(0)
    model = MODELS["branchy"]()
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    model.use_branch = rank not in unused_on
    start = time.monotonic()
    try:
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    except UnusedParameterError as err:
        return "raised in the same backward", err.names, str(err), time.monotonic() - start
    return "no error", [], "", 0.0


@pytest.mark.parametrize("unused_on", [(0, 1), (1,)], ids=["every_rank", "one_rank"])
def test_missing_gradient_raises_on_every_rank_in_the_same_backward(unused_on):
    results = run_on_ranks(_unused_without_flag, 2, args=(unused_on,), timeout=60)
    for rank, (what, names, message, seconds) in enumerate(results):
        assert what == "raised in the same backward"
        assert names == ["branch.weight", "branch.bias"] or names == ["branch.bias", "branch.weight"]
        assert "find_unused_parameters=True" in message  # raised: a hang would be the harness's RankTimeout
        if rank in unused_on:
            assert "On this rank, no gradient for" in message


def _torch_is_silent_until_the_next_iteration(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["branchy"]()
    model.use_branch = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = TorchDDP(model)
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()  # silently incomplete
    try:
        ddp(torch.randn(4, 8))
    except RuntimeError as err:
        return "next forward raised" if "finished reduction" in str(err) else str(err)
    return "no error"


def test_torch_only_notices_at_the_next_forward():
    # the contrast the docs describe: torch DDP's first backward returns without complaint
    assert run_on_ranks(_torch_is_silent_until_the_next_iteration, 2, timeout=60) == ["next forward raised"] * 2


def _flag_without_unused(rank, world_size):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"](), find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    return [str(w.message) for w in caught]


def test_flag_set_but_nothing_unused_warns_once():
    for messages in run_on_ranks(_flag_without_unused, 2, timeout=60):
        assert len([m for m in messages if "no parameter was unused" in m]) == 1


def _unused_everywhere_keeps_grad(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["branchy"]()
    ddp = miniddp.DistributedDataParallel(model, find_unused_parameters=True)
    model.use_branch = True
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    kept = model.branch.weight.grad.clone()
    model.use_branch = False  # now unused on every rank: its .grad must stay as it was
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    return torch.equal(model.branch.weight.grad, kept)


def test_parameter_unused_on_every_rank_keeps_its_gradient():
    for rank, kept in enumerate(run_on_ranks(_unused_everywhere_keeps_grad, 2, timeout=60)):
        assert kept, (f"rank {rank}: branch.weight, unused on every rank in the second backward "
                      "(find_unused_parameters=True), lost the .grad the first backward gave it")
