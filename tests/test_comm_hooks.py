"""Communication hooks: torch's contract, torch's own hooks on miniddp, ours against torch's and the paper.

Every rank builds its model from a different seed (so the wrap's broadcast is tested), copies it, and
trains one copy in miniddp's DDP and one in torch's, each with a hook, on the same per-rank batches:
the parameters must agree after every step. PowerSGD also meets a single-process implementation of
the algorithm on the summed gradients, and completes on gloo with many buckets, where torch's hangs.
"""

import copy
import functools
import hashlib
import math
import threading
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp import comm_hooks
from miniddp.comm_hooks import GradBucket, call_order, count_bytes
from miniddp.comm_hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook, powersgd_reference
from miniddp.launching.spawn import run_on_ranks
from miniddp.teaching.exercise.swap import current

from models import MODELS


class Net(nn.Module):
    """At rank 2, fc1 (32x8) and fc2 (32x32) are worth compressing; fc3 (4x32) and the biases are not."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


@contextmanager
def bytes_to_the_group():
    """``counted["all_reduce"]``: the bytes of every all-reduce this process hands to a process group while the
    block runs, whoever issues it (``dist.all_reduce``, miniddp's ``count_bytes``-ing ``all_reduce``, a future's
    callback on gloo's thread): what a hook sends, whichever primitive it calls (the spec counts this)."""
    counted, lock, real = {"all_reduce": 0}, threading.Lock(), dist.ProcessGroup.allreduce

    def allreduce(group, tensors, *args, **kwargs):
        with lock:
            for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
                counted["all_reduce"] += t.numel() * t.element_size()
        return real(group, tensors, *args, **kwargs)

    dist.ProcessGroup.allreduce = allreduce
    try:
        yield counted
    finally:
        dist.ProcessGroup.allreduce = real


def _powersgd_state(cls, group):
    return cls(group, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=7)


def _pairs(group):
    """name -> (hook on miniddp, its state, hook on torch's DDP, its state, model, DDP options)."""
    ours_psgd, torch_psgd = (lambda: _powersgd_state(PowerSGDState, group),
                             lambda: _powersgd_state(torch_powersgd.PowerSGDState, group))
    wrapper = torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook)  # returns float16: cast back
    return {
        "default": (None, None, None, None, Net, {}),
        "allreduce": (comm_hooks.allreduce_hook, group, torch_hooks.allreduce_hook, group, Net, {}),
        "torch's allreduce": (torch_hooks.allreduce_hook, group, torch_hooks.allreduce_hook, group, Net, {}),
        "fp16": (comm_hooks.fp16_compress_hook, group, torch_hooks.fp16_compress_hook, group, Net, {}),
        "torch's fp16": (torch_hooks.fp16_compress_hook, group, torch_hooks.fp16_compress_hook, group, Net, {}),
        "torch's fp16 wrapper": (wrapper, group, wrapper, group, Net, {}),
        "fp16, unused on some ranks": (comm_hooks.fp16_compress_hook, group, torch_hooks.fp16_compress_hook, group,
                                       MODELS["branchy"], {"find_unused_parameters": True}),
        "powerSGD": (powerSGD_hook, ours_psgd(), torch_powersgd.powerSGD_hook, torch_psgd(), Net, {}),
        "torch's powerSGD": (torch_powersgd.powerSGD_hook, torch_psgd(), torch_powersgd.powerSGD_hook, torch_psgd(),
                             Net, {}),
        "powerSGD, bucket views": (powerSGD_hook, ours_psgd(), torch_powersgd.powerSGD_hook, torch_psgd(), Net,
                                   {"gradient_as_bucket_view": True}),
    }  # torch 2.13's batched_powerSGD_hook raises AssertionError at its first compressed step (its
    # _orthogonalize wants a batch of matrices): ours meets the single-process algorithm instead, below


def _train(ddp, model, rank, steps, sent=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snapshots = []
    for step in range(steps):
        torch.manual_seed(10_000 * step + rank)  # each rank its own batch
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        model.use_branch = rank != 0 or step % 2 == 1  # Branchy: rank 0 skips its branch on even steps
        with count_bytes() as counted, bytes_to_the_group() as wire:
            F.mse_loss(ddp(x), y).backward()
        if sent is not None:
            sent.append((counted.by_op, wire["all_reduce"]))
        opt.step()
        opt.zero_grad()
        snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    return snapshots


# --8<-- [start:side_by_side]
def _side_by_side(rank, world_size, steps):
    group = dist.group.WORLD
    report = {}
    for name, (ours, our_state, theirs, their_state, make, options) in _pairs(group).items():
        torch.manual_seed(1000 + rank)  # a different model on every rank: only the wrap makes them equal
        mine = make()
        twin = copy.deepcopy(mine)
        ddp = miniddp.DistributedDataParallel(mine, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 deprecates broadcast_buffers
            ref = TorchDDP(twin, **options)
        if ours is not None:
            ddp.register_comm_hook(our_state, ours)
            ref.register_comm_hook(their_state, theirs)
        sent = []
        a, b = _train(ddp, mine, rank, steps, sent), _train(ref, twin, rank, steps)
        worst = [(x - y).abs().max().item() for x, y in zip(a, b)]  # per step
        report[name] = (max(worst), next((s for s, d in enumerate(worst) if d >= 1e-6), None), *sent[-1])
    return report
# --8<-- [end:side_by_side]


@pytest.fixture
def side_by_side(once):
    """Both tests below read one two-rank run per implementation (``miniddp exercise check`` runs several)."""
    key = hashlib.sha1(current().encode()).hexdigest()[:12]
    return once(f"comm_hooks_side_by_side_{key}", lambda: run_on_ranks(_side_by_side, 2, args=(5,), timeout=120))


def test_a_registered_hook_trains_as_torch_ddp_with_the_same_hook(side_by_side):
    # torch's contract: the hook gets the bucket undivided and its future holds the mean; the reducer
    # writes that back as it is (its own division by N is the default path's, without a hook)
    for rank, report in enumerate(side_by_side):
        for name, (diff, step, *_) in report.items():
            assert diff < 1e-6, (f"rank {rank}, hook {name!r}: parameters differ from torch DDP's with the same hook "
                                 f"by {diff:.2e} (first at step {step})")  # measured: 0 but our PowerSGD (3e-8)


def test_hooks_give_torchs_parameters_and_count_their_bytes(side_by_side):
    test_a_registered_hook_trains_as_torch_ddp_with_the_same_hook(side_by_side)
    sent = {name: by_op for name, (_, _, by_op, _) in side_by_side[0].items()}  # miniddp's count_bytes
    wire = {name: total for name, (*_, total) in side_by_side[0].items()}  # every all-reduce handed to the group
    grads = sum(p.numel() for p in Net().parameters()) * 4
    counts = {"all_reduce (used counts)": 6 * 4}  # one int32 per parameter, whatever the hook
    assert sent["default"] == sent["allreduce"] == {"all_reduce": grads, **counts}
    assert sent["torch's fp16"] == counts  # torch's hooks call dist directly: count_bytes cannot see them...
    theirs = wire["torch's fp16"] - 6 * 4  # ...the group sees every hook's bytes
    assert wire["fp16"] - 6 * 4 == theirs == grads // 2, (
        f"the fp16 hook handed {wire['fp16'] - 6 * 4} bytes to all-reduces in a step, not half the gradients' "
        f"{grads} (torch's fp16_compress_hook: {theirs})")
    # PowerSGD at rank 2: fc1 and fc2 as P and Q, the rest uncompressed
    p_and_q = ((32 + 8) + (32 + 32)) * 2 * 4
    expected = grads - (32 * 8 + 32 * 32) * 4 + p_and_q
    assert wire["powerSGD"] == expected + 6 * 4, (
        f"powerSGD_hook handed {wire['powerSGD'] - 6 * 4} bytes to all-reduces in a compressed step, not {expected}: "
        f"fc1 and fc2 as P and Q ({p_and_q} bytes at rank 2), the other {grads - (32 * 8 + 32 * 32) * 4} as they are")


def _bf16(rank, world_size):
    out = {}
    for hook in (None, comm_hooks.bf16_compress_hook, torch_hooks.bf16_compress_hook):
        torch.manual_seed(1000 + rank)
        model = Net()
        ddp = miniddp.DistributedDataParallel(model)
        if hook is not None:
            ddp.register_comm_hook(None, hook)  # torch's refuses torch's DDP on gloo; on miniddp it runs
        out[hook and hook.__module__] = _train(ddp, model, rank, 3)[-1]
    return out


def test_bf16_works_on_gloo_as_torchs_own_hook_would():
    for rank, out in enumerate(run_on_ranks(_bf16, 2, timeout=60)):
        fp32, ours, theirs = out.values()
        assert torch.equal(ours, theirs), (f"rank {rank}: after 3 steps the bf16 hook's parameters differ from torch's "
                                           f"bf16_compress_hook's by {(ours - theirs).abs().max().item():.2e}")
        diff = (ours - fp32).abs().max().item()  # bfloat16's 8 bits of precision, and no more
        assert 0 < diff < 1e-2, f"rank {rank}: the bf16 hook's parameters are {diff:.2e} from full precision's"


# --8<-- [start:reference]
SHAPES = [(16, 12), (12,), (8, 24), (3, 2)]  # at rank 2: two matrices compressed, a vector, a matrix too small


def _gradients(rank, step):
    torch.manual_seed(100 * step + rank)
    return [torch.randn(shape) for shape in SHAPES]


def _powersgd_hook_alone(rank, world_size, steps):
    outputs = {}
    for hook, r in ((powerSGD_hook, 2), (batched_powerSGD_hook, 1)):
        state = PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2, random_seed=3)
        buffer = torch.empty(sum(int(np.prod(s)) for s in SHAPES))
        views = [t.view(s) for t, s in zip(buffer.split([int(np.prod(s)) for s in SHAPES]), SHAPES)]
        outputs[hook.__name__] = out = []
        for step in range(steps):
            for view, grad in zip(views, _gradients(rank, step)):
                view.copy_(grad)
            with bytes_to_the_group() as wire:
                result = hook(state, GradBucket(0, buffer, views, views, is_last=True)).wait()
            out.append((result.clone(), wire["all_reduce"]))
    return outputs


def test_powersgd_hooks_equal_the_algorithm_on_the_summed_gradients():
    steps, world, numel = 5, 2, sum(int(np.prod(s)) for s in SHAPES)
    results = run_on_ranks(_powersgd_hook_alone, world, args=(steps,), timeout=60)
    side = math.ceil(math.sqrt(numel))  # batched: the whole bucket as one zero-padded square
    rng, rng_batched = np.random.RandomState(3), np.random.RandomState(3)  # PowerSGDState's seeding
    errors, qs = {}, {}
    for step in range(steps):
        sums = [sum(g) for g in zip(*(_gradients(r, step) for r in range(world)))]
        expected = [s / world for s in sums]  # plain all-reduce before start_powerSGD_iter, and for vectors
        batched = torch.cat([e.flatten() for e in expected])
        if step >= 2:
            if not qs:
                torch.manual_seed(rng.randint(1_000_000_000))
                qs = {j: torch.randn(SHAPES[j][1], 2) for j in (0, 2)}
                torch.manual_seed(rng_batched.randint(1_000_000_000))
                qs["batched"] = torch.randn(side, 1)
                errors["batched"] = torch.zeros(side, side)
            for j in (0, 2):
                errors.setdefault(j, torch.zeros(SHAPES[j]))
                expected[j], errors[j], qs[j] = powersgd_reference(sums[j], errors[j], qs[j], world)
            square = torch.zeros(side * side)
            square[:numel] = torch.cat([s.flatten() for s in sums])
            approx, errors["batched"], qs["batched"] = powersgd_reference(square.view(side, side), errors["batched"],
                                                                          qs["batched"], world)
            batched = approx.flatten()[:numel]
        phase = "plain all-reduce" if step < 2 else "compressed"
        for rank, outputs in enumerate(results):
            for hook, want in (("powerSGD_hook", torch.cat([e.flatten() for e in expected])),
                               ("batched_powerSGD_hook", batched)):
                got = outputs[hook][step][0]
                assert torch.allclose(got, want, atol=1e-5), (
                    f"{hook}, rank {rank}, step {step} ({phase}): differs from the algorithm on the summed gradients "
                    f"by {(got - want).abs().max().item():.2e}, first at element {_first_difference(got, want)}")
    compressed = 12 + 6 + (16 + 8) * 2 + (12 + 24) * 2  # the vector, the small matrix, P and Q of the others
    for hook, want in (("powerSGD_hook", [numel * 4] * 2 + [compressed * 4] * 3),
                       ("batched_powerSGD_hook", [numel * 4] * 2 + [2 * side * 4] * 3)):
        got = [b for _, b in results[0][hook]]
        assert got == want, f"{hook}: bytes all-reduced per step {got}, expected {want} (P and Q from step 2)"


def _first_difference(got, want):
    far = ((got - want).abs() > 1e-5).nonzero().flatten().tolist()
    return far[0] if far else None
# --8<-- [end:reference]


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the test reads whatever was raised
        return type(err).__name__, str(err)
    return None


def _misuse(rank, world_size):
    def fresh(hook=None):
        ddp = miniddp.DistributedDataParallel(MODELS["mlp"]())
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return ddp

    def step(ddp):
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()

    def done(tensor):
        fut = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    twice, late = fresh(comm_hooks.allreduce_hook), fresh()
    step(late)
    return {
        "twice": _raises(twice.register_comm_hook, None, comm_hooks.fp16_compress_hook),
        "late": _raises(late.register_comm_hook, None, comm_hooks.allreduce_hook),
        "not callable": _raises(fresh().register_comm_hook, None, 42),
        "signature": _raises(fresh().register_comm_hook, None, lambda bucket: None),
        "no future": _raises(step, fresh(lambda state, bucket: bucket.buffer())),
        "size": _raises(step, fresh(lambda state, bucket: done(bucket.buffer()[1:]))),
        "dtype": _raises(step, fresh(lambda state, bucket: done(bucket.buffer().int()))),
        "fine": _raises(step, fresh(lambda state, bucket: done(bucket.buffer()))),  # nothing to send: world 1
    }


def _powersgd_state_copies(rank, world_size):
    import pickle

    sub = dist.new_group([0])
    state = PowerSGDState(None, start_powerSGD_iter=2)
    state.error_dict[0] = [torch.ones(3)]
    loaded, deep = pickle.loads(pickle.dumps(state)), copy.deepcopy(PowerSGDState(sub, start_powerSGD_iter=2))
    try:
        pickle.dumps(PowerSGDState(sub, start_powerSGD_iter=2))
        refused = None
    except TypeError as err:
        refused = "process_group" in str(err)
    return (loaded.process_group, torch.equal(loaded.error_dict[0][0], state.error_dict[0][0]),
            loaded.error_dict[0][0] is not state.error_dict[0][0], deep.process_group is sub, refused)


def test_a_powersgd_state_pickles_without_its_group_and_deep_copies_share_it():
    """A wrapper with PowerSGD can be saved (torch.save / pickle) like torch's: its state's default group is
    looked up again where it is loaded; a deep copy keeps the group; another group is refused in one line."""
    [(group, same_memory, copied, shared, refused)] = run_on_ranks(_powersgd_state_copies, 1, timeout=60)
    assert group is None and same_memory and copied and shared and refused


def test_misused_hooks_get_clear_errors():
    [errors] = run_on_ranks(_misuse, 1, timeout=60)
    assert errors["twice"][0] == "RuntimeError" and "only be called once" in errors["twice"][1]
    assert errors["late"][0] == "RuntimeError" and "before the first forward" in errors["late"][1]
    assert errors["not callable"][0] == "TypeError" and "callable" in errors["not callable"][1]
    assert errors["signature"][0] == "TypeError" and "(state, bucket)" in errors["signature"][1]
    assert errors["no future"][0] == "RuntimeError" and "but got Tensor" in errors["no future"][1]  # torch's type
    assert errors["size"][0] == "ValueError" and "483 elements" in errors["size"][1] and "484" in errors["size"][1]
    assert errors["dtype"][0] == "ValueError" and "torch.int32" in errors["dtype"][1]
    assert errors["fine"] is None


# --8<-- [start:many_buckets]
def _many_buckets(rank, world_size, steps):
    results = {}
    for name, module in (("ours", miniddp.comm_hooks.powersgd), ("torch's", torch_powersgd)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16 KiB per weight
        ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.01)  # one layer per bucket
        state = module.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=5)
        ddp.register_comm_hook(state, module.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with ddp.join():  # uneven inputs too: rank 0 runs out first and shadows the hook with zeros
            for step in range(steps - rank):
                torch.manual_seed(step + 10 * rank)
                ddp(torch.randn(8, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        results[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return len(ddp.bucket_assignment), results


def test_powersgd_with_many_buckets_completes_on_gloo():
    # torch's DDP + torch's hook: no answer in 25 s with these 6 buckets (the page says why). miniddp's reducer
    # hands bucket k to the hook only after bucket k-1's future: both hooks complete, on every rank, and agree
    (buckets, a), (_, b) = run_on_ranks(_many_buckets, 2, args=(6,), timeout=60)
    assert buckets >= 5
    assert torch.equal(a["ours"], b["ours"]) and torch.equal(a["torch's"], b["torch's"])
    assert (a["ours"] - a["torch's"]).abs().max() < 1e-5  # same seed, same buckets: same parameters
# --8<-- [end:many_buckets]


def _wrap_twice(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    first = miniddp.DistributedDataParallel(model)
    F.mse_loss(first(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    second = miniddp.DistributedDataParallel(model)  # e.g. after freezing a layer, as our error message advises
    for _ in range(2):
        F.mse_loss(second(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    hooks = [len(p._post_accumulate_grad_hooks) for p in model.parameters()]
    return hooks, first.reducer.backwards, second.reducer.backwards


def test_wrapping_a_module_twice_leaves_no_stale_hooks():
    [(hooks, first, second)] = run_on_ranks(_wrap_twice, 1, timeout=30)
    assert hooks == [1] * 6 and (first, second) == (1, 2)


def _pending_at_each_call(rank, world_size, registered):
    """How many earlier buckets' futures were still running each time the reducer called the hook, on
    rank 0, while rank 1 holds its backward until rank 0 has launched all it may (so no all-reduce can
    finish before: rank 1 waits for rank 0's outcome, it does not race it with a sleep)."""
    from datetime import timedelta

    torch.manual_seed(0)
    store = dist.distributed_c10d._get_default_store()
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.01)  # 7 buckets: a weight closes one
    reducer, seen = ddp.reducer, []
    may_launch = 1 if registered else len(reducer.buckets)  # before any bucket can complete

    def recording(state, bucket, issue=comm_hooks.allreduce_hook):
        seen.append(sum(not f.done() for f in reducer.backward.futures))
        future = issue(state, bucket)
        if rank == 0 and len(seen) == may_launch:
            store.set("test: rank 0 launched", "1")
        return future

    if registered == "declared":  # a user's hook that says it issues everything in the call
        may_launch = len(reducer.buckets)
        ddp.register_comm_hook(dist.group.WORLD, comm_hooks.call_order.issues_collectives_in_call(recording))
    elif registered:  # a hook the reducer cannot vouch for: one bucket at a time
        ddp.register_comm_hook(dist.group.WORLD, recording)
    else:  # the default path itself, each bucket's collective seen as it is issued
        issue = reducer.collective.issue
        reducer.collective.issue = lambda bucket, flat, is_last, group: recording(
            None, None, issue=lambda *_: issue(bucket, flat, is_last, group))
    out = ddp(torch.randn(4, 64))
    if rank == 1:
        out.register_hook(lambda g: store.wait(["test: rank 0 launched"], timedelta(seconds=60)) or g)
    out.sum().backward()
    return seen, len(reducer.buckets)


def test_default_path_overlaps_buckets_and_other_hooks_go_one_at_a_time():
    # the default all-reduce (and the compression hooks) issue their one collective inside the call, so
    # bucket k+1 may start while bucket k travels; a hook that might issue more from a callback may not
    [(seen, buckets), _] = run_on_ranks(_pending_at_each_call, 2, args=(False,), timeout=60)
    assert buckets == 7 and seen == list(range(7)), seen  # rank 1 held back: nothing finished, all launched
    [(seen, buckets), _] = run_on_ranks(_pending_at_each_call, 2, args=(True,), timeout=60)
    assert seen == [0] * 7, seen
    assert call_order.issues_everything_in_call(torch_hooks.fp16_compress_hook)
    assert not call_order.issues_everything_in_call(powerSGD_hook)
    assert not call_order.issues_everything_in_call(torch_powersgd.powerSGD_hook)


def test_a_hook_that_declares_it_issues_everything_in_the_call_overlaps_its_buckets():
    # the contract is the hook's own attribute, not a list of known functions: a user's hook may declare it
    [(seen, buckets), _] = run_on_ranks(_pending_at_each_call, 2, args=("declared",), timeout=60)
    assert buckets == 7 and seen == list(range(7)), seen
    assert call_order.issues_everything_in_call(functools.partial(torch_hooks.allreduce_hook))
    assert not call_order.issues_everything_in_call(lambda state, bucket: None)
