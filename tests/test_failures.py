"""When DDP goes wrong: each known failure ends in a clear answer, not a hang or a silent divergence.

One test (or a small family) per row of ``docs/failures.md``. Each reproduces
what users hit with torch DDP or Hugging Face and asserts what miniddp does
instead: it works (checked against an oracle), it warns, or it raises an error
that names the cause. Each fails if the diagnostic regresses.
"""

import json
import os
import time
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import miniddp
from miniddp.engine.buffers import ParameterMismatchError
from miniddp.launching.spawn import RankError, run_on_ranks
from miniddp.training.checkpoint_format import load_checkpoint, save_checkpoint

from models import MODELS


def _torch_ddp(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchDDP(model, **options)


def _synced(model, world_size) -> bool:
    """Gradients were averaged iff every rank holds the same ones."""
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    total = g.clone()
    dist.all_reduce(total)
    return torch.allclose(g * world_size, total, atol=1e-6)


def _catch(fn, *args):
    """Run ``fn``; return ``(exception type name, message)`` or ``None`` if it did not raise."""
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the test inspects whatever was raised
        return type(err).__name__, str(err)
    return None


# --8<-- [start:uneven]
def _without_join(rank, world_size):
    torch.manual_seed(0)
    try:
        ddp = miniddp.DistributedDataParallel(MODELS["mlp"]())
        for step in range([2, 4][rank]):  # uneven: rank 0 has 2 batches, rank 1 has 4
            F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        dist.barrier()  # what a script does after its loop: save, evaluate, barrier
    except miniddp.StalledRankError as err:
        return err.missing, str(err)
    except RuntimeError as err:  # the transport's own error, whatever its words
        return None, type(err).__name__


def test_without_join_uneven_inputs_fail_naming_the_rank_that_ran_out():
    (nobody, at_the_barrier), (missing, message) = run_on_ranks(_without_join, 2, pg_timeout=3, timeout=60)
    assert nobody is None and at_the_barrier  # rank 0 waited at its barrier: gloo's bare error, naming nobody
    assert missing == [0], message  # rank 1, in its third backward, names rank 0
    assert "rank 0 (pid" in message and "never reached the all-reduce of bucket 0 in backward #3" in message
# --8<-- [end:uneven]


# --8<-- [start:rank0_eval]
def _rank_0_evaluates_alone(rank, world_size, mode):
    torch.manual_seed(0)
    model = MODELS["batchnorm"]()
    ddp = miniddp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    calls = []
    for name in ("broadcast", "all_reduce", "all_gather"):  # count every collective the eval issues
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    outputs = []
    for step in range(2):
        torch.manual_seed(rank + 10 * step)
        F.mse_loss(ddp(torch.randn(8, 8)), torch.zeros(8, 4)).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:  # the classic: only the main process evaluates
            ddp.eval()
            before = len(calls)
            with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
                x = torch.randn(5, 8)
                outputs.append((ddp(x), model(x), len(calls) - before))
            ddp.train()
        dist.barrier()  # the others wait for it, then everyone trains on
    return outputs
# --8<-- [end:rank0_eval]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_rank_0_only_evaluation_never_communicates(mode):
    outputs, _ = run_on_ranks(_rank_0_evaluates_alone, 2, args=(mode,), pg_timeout=10, timeout=60)
    for through_ddp, direct, collectives in outputs:
        assert collectives == 0  # no buffer broadcast, no bucket rebuild: nothing for rank 1 to match
        assert torch.equal(through_ddp, direct)


# --8<-- [start:penalty]
def _gradient_penalty(rank, world_size, find_unused, use_ours):
    torch.manual_seed(0)
    critic = MODELS["mlp"]()
    ddp = (miniddp.DistributedDataParallel(critic, find_unused_parameters=find_unused) if use_ours
           else _torch_ddp(critic, find_unused_parameters=find_unused))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    history = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "find_unused_parameters=True but nothing unused"
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own batch
            real, fake = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
            alpha = torch.rand(6, 1, generator=g)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            wasserstein = ddp(fake).mean() - ddp(real).mean()
            grad_in, = torch.autograd.grad(ddp(mixed).sum(), mixed, create_graph=True)  # WGAN-GP's penalty
            loss = wasserstein + 10 * ((grad_in.norm(2, dim=1) - 1) ** 2).mean()
            loss.backward()  # the backward that reaches the parameters: this one must sync
            history.append(torch.cat([p.grad.flatten() for p in critic.parameters()]))
            assert _synced(critic, world_size), f"step {step}: the gradients were not averaged"
            opt.step()
            opt.zero_grad()
    return torch.stack(history)
# --8<-- [end:penalty]


@pytest.mark.parametrize("find_unused", [False, True])
def test_gradient_penalty_syncs_the_real_backward_like_torch(find_unused):
    ours = run_on_ranks(_gradient_penalty, 2, args=(find_unused, True), timeout=60)
    torchs = run_on_ranks(_gradient_penalty, 2, args=(find_unused, False), timeout=60)
    for mine, theirs in zip(ours, torchs):
        assert torch.allclose(mine, theirs, atol=1e-6), (mine - theirs).abs().max()


# --8<-- [start:no_sync_placement]
def _no_sync_placement(rank, world_size, forward_inside):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"]())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if forward_inside:
            with ddp.no_sync():
                F.mse_loss(ddp(x + rank), y).backward()
        else:
            loss = F.mse_loss(ddp(x + rank), y)  # forward outside...
            with ddp.no_sync():  # ...backward inside: this backward still syncs
                loss.backward()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
# --8<-- [end:no_sync_placement]


def test_no_sync_around_the_backward_only_warns():
    for messages in run_on_ranks(_no_sync_placement, 2, args=(False,), timeout=60):
        assert len(messages) == 1 and "no_sync()" in messages[0] and "forward inside" in messages[0]
    for messages in run_on_ranks(_no_sync_placement, 2, args=(True,), timeout=60):
        assert messages == []  # the right placement is silent


def test_forgetting_set_epoch_warns():
    sampler = miniddp.ShardSampler(range(10), num_replicas=2, rank=0)
    first = list(sampler)
    with pytest.warns(UserWarning, match="set_epoch"):
        second = list(sampler)
    assert first == second  # what the warning is about: the same order again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.set_epoch(1)
        assert list(sampler) != first  # with set_epoch: a new order, no warning


class _Buffered(nn.Module):
    def __init__(self, buffer_size=3, with_buffer=True):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if with_buffer:
            self.register_buffer("stats", torch.zeros(buffer_size))


def _different_models(rank, world_size, kind):
    if kind == "frozen_on_one_rank":
        model = MODELS["mlp"]()
        model.fc2.requires_grad_(rank != 2)
    elif kind == "buffer_size":
        model = _Buffered(buffer_size=5 if rank == 1 else 3)
    else:  # "buffer_on_one_rank"
        model = _Buffered(with_buffer=rank == 0)
    return _catch(miniddp.DistributedDataParallel, model)


@pytest.mark.parametrize("kind, named", [
    ("frozen_on_one_rank", ["fc2.weight", "requires_grad=True", "rank 2 has", "requires_grad=False"]),
    ("buffer_size", ["buffer #0", "stats shape (3,)", "rank 1 has stats shape (5,)"]),
    ("buffer_on_one_rank", ["rank 0 has 1 buffers, rank 1 has 0", "stats"]),
])
def test_models_that_differ_across_ranks_are_refused_at_wrap_on_every_rank(kind, named):
    results = run_on_ranks(_different_models, 3, args=(kind,), pg_timeout=10, timeout=60)
    for error in results:
        assert error is not None and error[0] == "ParameterMismatchError", error
        for text in named:
            assert text in error[1], (text, error[1])
    assert issubclass(ParameterMismatchError, ValueError)


def _requires_grad_after_wrap(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ddp = miniddp.DistributedDataParallel(model)
    model.fc1.requires_grad_(False)  # freezing after wrapping
    return _catch(ddp, torch.randn(2, 8))


def test_requires_grad_changed_after_wrapping_says_so():
    for name, message in run_on_ranks(_requires_grad_after_wrap, 2, timeout=60):
        assert name == "RuntimeError"
        assert "fc1.weight.requires_grad changed from True to False after wrapping" in message


@dataclass(slots=True)
class _Output:  # a dataclass output, as many model libraries return (slots: no __dict__)
    logits: torch.Tensor
    loss: torch.Tensor


class _DataclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.unused = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        return _Output(logits=logits, loss=F.mse_loss(logits, y))


def _dataclass_output(rank, world_size):
    torch.manual_seed(0)
    model = _DataclassModel()
    ddp = miniddp.DistributedDataParallel(model, find_unused_parameters=True)
    torch.manual_seed(rank)
    ddp(torch.randn(4, 8), torch.randn(4, 4)).loss.backward()
    return _synced(model, world_size), model.unused.weight.grad is None


def test_dataclass_outputs_are_walked_for_unused_parameters():
    assert run_on_ranks(_dataclass_output, 2, timeout=60) == [(True, True), (True, True)]


class _Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


def _activation_checkpointing(rank, world_size, reentrant, use_ours):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    ddp = (miniddp.DistributedDataParallel(model, find_unused_parameters=True) if use_ours
           else _torch_ddp(model, find_unused_parameters=True))
    torch.manual_seed(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        error = _catch(lambda: F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward())
    return error or _synced(model, world_size)


def test_reentrant_checkpointing_names_the_fix_and_non_reentrant_works():
    mine = run_on_ranks(_activation_checkpointing, 2, args=(True, True), timeout=60)
    theirs = run_on_ranks(_activation_checkpointing, 2, args=(True, False), timeout=60)
    assert "mark a variable ready only once" in theirs[0][1]  # torch's riddle
    assert "use_reentrant=False" in mine[0][1] and "b." in mine[0][1]  # ours: the parameter and the fix
    assert run_on_ranks(_activation_checkpointing, 2, args=(False, True), timeout=60) == [True, True]


# --8<-- [start:stalled]
def _stall_or_die(rank, world_size, how, report):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MODELS["mlp"]())
    for step in range(3):
        if rank == 1 and step == 2:
            if how == "die":
                os._exit(1)  # killed: the OOM killer, a node failure, a segfault
            _wait_for(report / "0")  # stalled until rank 0 gave up: a slow save, a stuck data loader...
        try:
            F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        except miniddp.StalledRankError as err:
            caused_by_the_transport = isinstance(err.__cause__, RuntimeError)  # gloo's error, kept as the cause
            (report / str(rank)).write_text(json.dumps([err.missing, str(err), caused_by_the_transport]))
            return
# --8<-- [end:stalled]


def _wait_for(path, timeout_s: float = 120) -> None:
    """Block until ``path`` exists: one rank waits for another's outcome instead of racing it with a sleep."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["stall", "die"])
def test_a_stalled_or_killed_rank_is_named_by_its_peer(how, tmp_path):
    try:  # rank 1 comes back only after rank 0 raised: rank 0 gave up on its own, at the 3 s timeout
        run_on_ranks(_stall_or_die, 2, args=(how, tmp_path), pg_timeout=3, timeout=120, grace=10)
    except RankError as err:  # the killed rank itself
        assert how == "die" and err.rank == 1 and "exited with code 1" in str(err)
    missing, message, from_transport = json.loads((tmp_path / "0").read_text())  # what the waiting rank 0 raised
    assert missing == [1] and "rank 1 (pid" in message and "bucket 0 in backward #3" in message, message
    assert from_transport  # gloo's own error (a timeout, or a lost connection) stays attached, below ours
    if how == "stall":  # and the late rank, when it comes back, learns that it was the slow one
        late_missing, late, _ = json.loads((tmp_path / "1").read_text())
        assert late_missing == [1] and "rank 1 (pid" in late and "it was the slow one" in late


# --8<-- [start:saving]
def _save_then_read(rank, world_size, out, careful):
    torch.manual_seed(0)
    state = {"model": MODELS["mlp"]().state_dict()}
    if careful:
        if rank == 0:  # a slow disk: each of rank 0's writes takes a while
            real_save = torch.save
            torch.save = lambda obj, f, *a, **k: (time.sleep(1.5), real_save(obj, f, *a, **k))[1]
        path = save_checkpoint(out, 1, state, rank)  # collective: returns once the checkpoint is whole
        return _catch(load_checkpoint, path, rank) or "read a complete checkpoint"
    # the race: rank 0 writes while the others move on and read it. Here rank 0's disk is at its
    # slowest: its write begins only once rank 1 has looked (a sleep would race rank 1's start-up)
    if rank == 0:
        _wait_for(os.path.join(out, "rank 1 looked"))
        torch.save(state["model"], os.path.join(out, "model.pt"))
    read = _catch(torch.load, os.path.join(out, "model.pt")) or "read a complete checkpoint"
    if rank == 1:
        open(os.path.join(out, "rank 1 looked"), "w").close()
    return read
# --8<-- [end:saving]


def test_other_ranks_never_see_a_half_written_checkpoint(tmp_path):
    naive = run_on_ranks(_save_then_read, 2, args=(str(tmp_path), False), timeout=60)
    assert naive[1] != "read a complete checkpoint"  # the race: rank 1 finds nothing, or half a file
    careful = run_on_ranks(_save_then_read, 2, args=(str(tmp_path), True), timeout=60)
    assert careful == ["read a complete checkpoint"] * 2


def _slow_save(rank, world_size, out):
    state = {"model": MODELS["mlp"]().state_dict()}
    gave_up = os.path.join(out, "rank 1 gave up")
    if rank == 0:  # rank 0 writes for longer than the 2 s timeout: until rank 1 has given up waiting
        real_save = torch.save
        torch.save = lambda obj, f, *a, **k: (_wait_for(gave_up), real_save(obj, f, *a, **k))[1]
    try:
        save_checkpoint(out, 1, state, rank)
    except miniddp.StalledRankError as err:
        if rank == 1:
            open(gave_up, "w").close()
        return err.missing, str(err)


def test_a_save_longer_than_the_timeout_names_the_saving_rank(tmp_path):
    (late_missing, late), (missing, message) = run_on_ranks(_slow_save, 2, args=(str(tmp_path),), pg_timeout=2,
                                                            timeout=120)
    assert missing == [0] and "rank 0 never reached the barrier after writing checkpoint-1" in message, message
    assert late_missing == [0] and "it was the slow one" in late


# --8<-- [start:bypassed]
def _bypassed_wrapper(rank, world_size, how):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ddp = miniddp.DistributedDataParallel(model)
    x, y = torch.randn(4, 8) + rank, torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "module called directly":
            F.mse_loss(model(x), y).backward()  # the wrapper never saw this forward
        elif how == "graph backpropagated twice":
            loss = F.mse_loss(ddp(x), y)
            loss.backward(retain_graph=True)  # synced
            loss.backward()  # not: the reducer was disarmed by the first
        else:  # the right ways: a no_sync micro-step, then a synced one
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
            F.mse_loss(ddp(x), y).backward()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)], _synced(model, world_size)
# --8<-- [end:bypassed]


@pytest.mark.parametrize("how", ["module called directly", "graph backpropagated twice", "no_sync then synced"])
def test_a_backward_the_wrapper_did_not_prepare_warns(how):
    # torch's DDP averages nothing here and says nothing: the replicas drift apart, silently
    for messages, synced in run_on_ranks(_bypassed_wrapper, 2, args=(how,), timeout=60):
        if how == "no_sync then synced":
            assert messages == [] and synced
        else:
            assert len(messages) == 1 and "NOT averaged" in messages[0] and "ddp(x)" in messages[0], messages
            assert not synced  # what the warning is about: ranks hold different gradients
