"""join(): uneven inputs, with torch DDP's join() on the same uneven data as the oracle.

Every rank gets a different number of batches. miniddp's DDP and torch's train
the same model (built from a different seed on every rank, so the wrap matters)
on the same batches, each inside its own ``join()``; afterwards the parameters
and buffers must equal torch's and be identical on every rank. Without join the
same loop fails, with an error that names the rank that ran out of data.
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
from miniddp.engine.join import EarlyTerminationError, Join, Joinable, JoinHook
from miniddp.launching.spawn import run_on_ranks

from models import MODELS


def _batches(rank, count, accumulation):
    out = []
    for step in range(count):
        for micro in range(accumulation):
            g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
            out.append((torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g), micro == accumulation - 1))
    return out


def _train(ddp, batches, join_kwargs):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ddp.join(**join_kwargs) if join_kwargs is not None else nullcontext():
        for x, y, last in batches:
            with nullcontext() if last else ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
            if last:
                opt.step()
                opt.zero_grad()


def _state(module):
    return torch.cat([t.detach().double().flatten() for t in module.state_dict().values()])


def _flat(tensors):
    return torch.cat([t.detach().double().flatten() for t in tensors] or [torch.zeros(0, dtype=torch.double)])


# --8<-- [start:parity]
def _join_parity(rank, world_size, model_name, options, steps_per_rank, accumulation, join_kwargs):
    torch.manual_seed(1000 + rank)  # different on every rank: only the wrap makes them equal
    mine = MODELS[model_name]()
    theirs = copy.deepcopy(mine)
    batches = _batches(rank, steps_per_rank[rank], accumulation)  # uneven: a different count per rank
    _train(miniddp.DistributedDataParallel(mine, **options), batches, join_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(TorchDDP(theirs, **options), batches, join_kwargs)
    params = (_flat(mine.parameters()) - _flat(theirs.parameters())).abs().max().item()
    buffers = (_flat(mine.buffers()) - _flat(theirs.buffers())).abs().sum().item()
    ours = _state(mine)
    everyone = [torch.empty_like(ours) for _ in range(world_size)]
    dist.all_gather(everyone, ours)
    return params, buffers, max((e - ours).abs().max().item() for e in everyone)
# --8<-- [end:parity]


CASES = {  # model, DDP options, batches per rank, accumulation, join()'s arguments
    "mlp_initial_world_size": ("mlp", {}, [3, 5, 4], 1, {}),
    "mlp_active_ranks": ("mlp", {}, [3, 5, 4], 1, {"divide_by_initial_world_size": False}),
    "batchnorm_buffers": ("batchnorm", {}, [2, 5, 3], 1, {}),
    "batchnorm_buffers_active_ranks": ("batchnorm", {}, [4, 2, 3], 1, {"divide_by_initial_world_size": False}),
    # buffers differ from torch here, by design: torch skips the buffer broadcast in the forward after a
    # no_sync forward, miniddp broadcasts before every grad-enabled forward (DESIGN.md); parameters agree
    "no_sync_inside_join": ("batchnorm", {"bucket_cap_mb": 0.001}, [2, 4, 3], 2, {}),
    "rank_0_joins_before_the_rebuild": ("reverse_order", {"bucket_cap_mb": 0.001}, [1, 4, 2], 1, {}),
    "a_rank_with_no_batch_at_all": ("mlp", {"bucket_cap_mb": 0.001}, [3, 0, 2], 1, {}),
    "find_unused_parameters": ("branchy", {"find_unused_parameters": True}, [2, 3, 4], 1, {}),
    "even_inputs": ("mlp", {}, [3, 3, 3], 1, {}),
    "disabled_even_inputs": ("mlp", {}, [3, 3, 3], 1, {"enable": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_join_matches_torch_ddp_join_on_uneven_inputs(case):
    model_name, options, steps, accumulation, join_kwargs = CASES[case]
    results = run_on_ranks(_join_parity, 3, args=(model_name, options, steps, accumulation, join_kwargs),
                           timeout=90)
    for rank, (params, buffers, spread) in enumerate(results):
        assert params < 1e-5, f"{case}, rank {rank}: parameters differ from torch's join by {params:.2e}"
        if case != "no_sync_inside_join":
            assert buffers < 1e-5, f"{case}, rank {rank}: buffers differ from torch's join by {buffers:.2e}"
        assert spread == 0.0, f"{case}, rank {rank}: ranks end with different models ({spread:.2e} apart)"


def _divisor_matters(rank, world_size):
    results = []
    for flag in (True, False):
        torch.manual_seed(0)
        model = MODELS["mlp"]()
        _train(miniddp.DistributedDataParallel(model), _batches(rank, [1, 3][rank], 1),
               {"divide_by_initial_world_size": flag})
        results.append(_state(model))
    return (results[0] - results[1]).abs().max().item()


def test_negative_the_divisor_flag_changes_the_result():
    # so the parity above checks the flag: the average over active ranks is a different update
    for rank, diff in enumerate(run_on_ranks(_divisor_matters, 2, timeout=60)):
        assert diff > 1e-4, (f"rank {rank}: divide_by_initial_world_size=True and False trained the same model "
                             f"({diff:.2e} apart): after rank 0 joins, False divides by the 1 active rank, not 2")


def _throw(rank, world_size, use_torch):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = TorchDDP(model) if use_torch else miniddp.DistributedDataParallel(model)
    seen = 0
    try:
        with ddp.join(throw_on_early_termination=True):
            for x, y, _ in _batches(rank, [2, 5, 5][rank], 1):
                F.mse_loss(ddp(x), y).backward()
                seen += 1
    except RuntimeError as err:
        return seen, type(err).__name__, str(err)
    return seen, None, None


@pytest.mark.parametrize("use_torch", [False, True], ids=["miniddp", "torch"])
def test_throw_on_early_termination_raises_on_every_rank_at_the_same_iteration(use_torch):
    results = run_on_ranks(_throw, 3, args=(use_torch,), timeout=60)
    for rank, (seen, name, message) in enumerate(results):  # the others stop where rank 0 ran out, after 2
        assert seen == 2, f"rank {rank} ran {seen} backward(s) before raising, not 2 (rank 0 has 2 batches)"
        assert name is not None, f"rank {rank} raised nothing"
        if not use_torch:
            assert name == "EarlyTerminationError", f"rank {rank} raised {name}: {message}"
            named = "[0]" if rank else "rank 0"  # the active ranks list who ran out; the joined rank names itself
            assert named in message, f"rank {rank}'s error does not name rank 0 ({named!r}): {message}"
    assert issubclass(EarlyTerminationError, RuntimeError)


def _no_grad_inside_join(rank, world_size):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MODELS["batchnorm"]())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for x, y, _ in _batches(rank, [2, 3][rank], 1):
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for _ in range(rank + 1):  # a different number of evaluation forwards per rank
                    ddp(x)
    return _state(ddp.module)


def test_no_grad_forwards_inside_join_are_not_rounds():
    a, b = run_on_ranks(_no_grad_inside_join, 2, timeout=60)
    assert torch.equal(a, b)


class _Steps(Joinable):
    """A second joinable, as an optimizer is in torch's ``Join([model, optimizer])``: after each step the active
    ranks all-reduce a count (a collective the joined ranks must shadow); its hook answers with zeros."""

    def __init__(self):
        self.total, self.calls = torch.zeros(1), []

    def step(self):
        ones = torch.ones(1)
        dist.all_reduce(ones)
        self.total += ones

    def join_hook(self, **kwargs):
        steps = self

        class Hook(JoinHook):
            def main_hook(self, plan):
                steps.calls.append("main")
                steps.step_with(torch.zeros(1))

            def post_hook(self, source):
                steps.calls.append(("post", source))

        return Hook()

    def step_with(self, value):
        dist.all_reduce(value)
        self.total += value

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def _two_joinables(rank, world_size):
    torch.manual_seed(rank)  # different weights: the wrap's broadcast and post_hook matter
    ddp = miniddp.DistributedDataParallel(torch.nn.Linear(8, 4))
    steps, opt = _Steps(), torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp, steps]):
        for x, y, _ in _batches(rank, 3 if rank == 0 else 5, 1):
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps.step()
    return steps.total.item(), steps.calls, _flat(ddp.module.parameters())


def test_join_takes_a_list_and_shadows_every_joinable_in_order():
    (total0, calls0, params0), (total1, calls1, params1) = run_on_ranks(_two_joinables, 2, timeout=60)
    assert total0 == total1 == 3 * 2 + 2 * 1  # both ranks counted 3 steps, then rank 1 alone 2 more
    assert calls0 == ["main", "main", ("post", 1)] and calls1 == [("post", 1)]
    assert torch.equal(params0, params1)


def _refusals(rank, world_size):
    ddp = miniddp.DistributedDataParallel(torch.nn.Linear(2, 2))
    other = miniddp.DistributedDataParallel(torch.nn.Linear(2, 2), process_group=dist.new_group([0]))
    got = []
    for joinables in (ddp, [], [ddp, ddp], [ddp, other]):
        try:
            Join(joinables)
        except (TypeError, ValueError) as err:
            got.append(type(err).__name__)
    return got


def test_join_refuses_what_torchs_join_refuses_in_one_line():
    [got] = run_on_ranks(_refusals, 1, timeout=60)
    assert got == ["TypeError", "ValueError", "ValueError", "ValueError"]
