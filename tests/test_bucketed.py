"""BucketedDataParallel, the bucketed DDP by hand: its oracles and its negative controls.

Oracles: torch's own DistributedDataParallel with the same bucket cap, side by side in one process
group, and one process on the whole global batch; the buckets' exact contents; the order of the
all-reduces as the dispatcher sees them. Each check is a function that lists what is wrong, so the
negative controls (versions that forget to divide, launch in completion order, sync inside
``no_sync``, or broadcast nothing at wrap) are caught by the very checks the reference passes.
"""

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from miniddp.by_hand.bucketed import BucketedDataParallel
from miniddp.launching.spawn import run_on_ranks

from issued import Issued
from models import MODELS

TIMEOUT = 90
MiB = 1024 * 1024


class Lopsided(nn.Module):
    """Parameters of very different sizes: a 32768-number embedding, a 0-d scale, a small head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        tokens = (x.abs() * 1000).long().clamp(max=4095)[:, :3]
        return self.head(torch.tanh(self.embed(tokens).mean(1) * self.scale + x))


class Parallel(nn.Module):
    """Two same-shaped branches computed in a chosen order: autograd finishes the later one first, so ranks that
    compute them in different orders complete their buckets in different orders."""

    def __init__(self, a_first=True):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)
        self.a_first = a_first

    def forward(self, x):
        if self.a_first:
            ya, yb = self.a(x), self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return 2 * ya + yb


def _model(name, rank):
    if name == "lopsided":
        return Lopsided()
    if name == "parallel":
        return Parallel(a_first=rank % 2 == 0)  # rank 0 a then b, rank 1 b then a
    return MODELS[name]()


# --- negative controls: each breaks one rule; the same checks must catch it --------------------------------

class _NoDivide(BucketedDataParallel):
    """Sums the gradients and never divides: N times the mean."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.world_size = 1


class _CompletionOrder(BucketedDataParallel):
    """picotron's rule: a bucket launches the moment its last gradient is in, whatever the buckets before it."""

    def _grad_ready(self, p):
        if not self._sync:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        b, k = self._slot[p]
        bucket = self.buckets[b]
        torch.div(p.grad, self.world_size, out=bucket.views[k])
        bucket.ready.add(k)
        if bucket.complete:
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            self._next += 1


class _SyncsInsideNoSync(BucketedDataParallel):
    """A no_sync that does not stop the sync."""

    def forward(self, *args, **kwargs):
        self.require_backward_grad_sync = True
        return super().forward(*args, **kwargs)


class _NoBroadcast(BucketedDataParallel):
    """Each rank keeps its own initial parameters and buffers."""

    def _broadcast_from_rank_0(self):
        pass


NEGATIVE = {"no_divide": _NoDivide, "completion_order": _CompletionOrder,
            "syncs_inside_no_sync": _SyncsInsideNoSync, "no_broadcast": _NoBroadcast}


def _wrapper(variant):
    # the module-level name, read at call time: `miniddp exercise check` puts a learner's class there
    return BucketedDataParallel if variant is None else NEGATIVE[variant]


def _batch(rank, step, micro, rows=6):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)  # each rank its own shard
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def _spread(model):
    """How far apart the ranks' parameters are (0.0: identical bits)."""
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return max((e - everyone[0]).abs().max().item() for e in everyone)


# --- against torch's DDP, side by side -------------------------------------------------------------------

# --8<-- [start:torch]
def _against_torch(rank, world_size, model_name, cap, accumulation, variant=None):
    torch.manual_seed(1000 + rank)  # different on every rank: only the wrap's broadcast makes them equal
    mine = _model(model_name, rank)
    theirs = copy.deepcopy(mine)
    ours = _wrapper(variant)(mine, bucket_cap_mb=cap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = TorchDDP(theirs, bucket_cap_mb=cap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref)]
    worst_grad = worst_param = 0.0
    for step in range(3):
        for micro in range(accumulation):
            x, y = _batch(rank, step, micro)
            for model in (ours, ref):  # every micro-batch but the last inside no_sync, on both
                with nullcontext() if micro == accumulation - 1 else model.no_sync():
                    F.mse_loss(model(x), y).backward()
            worst_grad = max([worst_grad] + [_max_diff(p.grad, q.grad) for p, q in
                                             zip(mine.parameters(), theirs.parameters()) if p.requires_grad])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst_param = max([worst_param] + [_max_diff(p, q) for p, q in zip(mine.parameters(), theirs.parameters())])
    return worst_grad, worst_param, _spread(mine), len(ours.bucket_assignment)
# --8<-- [end:torch]


def _torch_failures(results, case):
    failures = []
    for rank, (grad_diff, param_diff, spread, _) in enumerate(results):
        if grad_diff > 1e-6:
            failures.append(f"{case}, rank {rank}: gradients differ from torch DDP's by {grad_diff:.2e}")
        if param_diff > 1e-6:
            failures.append(f"{case}, rank {rank}: parameters differ from torch DDP's by {param_diff:.2e}")
        if spread != 0.0:
            failures.append(f"{case}, rank {rank}: the ranks hold different parameters ({spread:.2e} apart)")
    return failures


TORCH_CASES = {  # model, bucket_cap_mb, micro-batches per step
    "mlp": ("mlp", 25, 1),
    "lopsided_sizes": ("lopsided", 0.0001, 1),
    "tied_weights": ("tied", 25, 1),
    "frozen": ("frozen", 0.0005, 1),
    "mixed_dtypes": ("mixed_dtypes", 0.0005, 1),
    "many_tiny_buckets": ("mlp", 1e-6, 1),
    "accumulation": ("mlp", 0.001, 3),
    "branches_in_rank_dependent_order": ("parallel", 1e-6, 1),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_ddp(case):
    model_name, cap, accumulation = TORCH_CASES[case]
    results = run_on_ranks(_against_torch, 2, args=(model_name, cap, accumulation), timeout=TIMEOUT)
    assert _torch_failures(results, case) == []
    if case == "many_tiny_buckets":  # each parameter its own bucket: six all-reduces per backward
        assert {r[-1] for r in results} == {len(list(MODELS["mlp"]().parameters()))}


# --- against one process on the whole global batch ----------------------------------------------------------

# --8<-- [start:one_process]
def _against_one_process(rank, world_size, model_name, cap, accumulation, variant=None):
    torch.manual_seed(1000 + rank)
    model = _model(model_name, rank)
    ours = _wrapper(variant)(model, bucket_cap_mb=cap)
    torch.manual_seed(1000)  # rank 0's initial model, built again: what one process would start from
    single = _model(model_name, 0)
    opt, opt_single = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (ours, single))
    worst_grad = worst_param = 0.0
    for step in range(3):
        for micro in range(accumulation):
            x, y = _batch(rank, step, micro)
            with nullcontext() if micro == accumulation - 1 else ours.no_sync():
                (F.mse_loss(ours(x), y) / accumulation).backward()  # my shard of this micro-batch
            everyone = [_batch(r, step, micro) for r in range(world_size)]
            xs, ys = torch.cat([b[0] for b in everyone]), torch.cat([b[1] for b in everyone])
            (F.mse_loss(single(xs), ys) / accumulation).backward()  # everyone's shards at once
        worst_grad = max([worst_grad] + [_max_diff(p.grad, q.grad) for p, q in
                                         zip(model.parameters(), single.parameters()) if p.requires_grad])
        for o in (opt, opt_single):
            o.step()
            o.zero_grad()
        worst_param = max([worst_param] + [_max_diff(p, q) for p, q in zip(model.parameters(), single.parameters())])
    return worst_grad, worst_param, _spread(model)
# --8<-- [end:one_process]


def _one_process_failures(results, case):
    failures = []
    for rank, (grad_diff, param_diff, spread) in enumerate(results):
        if grad_diff > 1e-5:
            failures.append(f"{case}, rank {rank}: the averaged gradients differ from one process's on the "
                            f"global batch by {grad_diff:.2e}")
        if param_diff > 1e-5:
            failures.append(f"{case}, rank {rank}: after 3 steps the parameters differ from one process's by "
                            f"{param_diff:.2e}")
        if spread != 0.0:
            failures.append(f"{case}, rank {rank}: the ranks hold different parameters ({spread:.2e} apart)")
    return failures


ONE_PROCESS_CASES = {  # model, bucket_cap_mb, micro-batches per step, world size
    "one_rank": ("mlp", 0.001, 1, 1),
    "mlp_3_ranks": ("mlp", 0.001, 1, 3),
    "lopsided_accumulation": ("lopsided", 0.01, 3, 2),
    "tied_many_tiny_buckets": ("tied", 1e-6, 2, 2),
    "branches_in_rank_dependent_order": ("parallel", 1e-6, 1, 2),
}


@pytest.mark.parametrize("case", list(ONE_PROCESS_CASES))
def test_equals_one_process_on_the_global_batch(case):
    model_name, cap, accumulation, world_size = ONE_PROCESS_CASES[case]
    results = run_on_ranks(_against_one_process, world_size, args=(model_name, cap, accumulation), timeout=TIMEOUT)
    assert _one_process_failures(results, case) == []


# --- the buckets: what each holds, and the order they go in ---------------------------------------------------

def _assignments(rank, world_size):
    out = {}
    for key, name, cap in [("mlp_300_bytes", "mlp", 300 / MiB), ("mlp_tiny", "mlp", 1e-6),
                           ("mixed_dtypes", "mixed_dtypes", 25), ("frozen", "frozen", 25), ("tied", "tied", 25),
                           ("lopsided", "lopsided", 0.0001)]:
        out[key] = BucketedDataParallel(_model(name, rank), bucket_cap_mb=cap).bucket_assignment
    try:
        BucketedDataParallel(MODELS["mlp"](), bucket_cap_mb=0)
    except ValueError:
        out["cap_0"] = "ValueError"
    return out


def test_buckets_fill_from_the_last_parameter_one_dtype_each():
    [got] = run_on_ranks(_assignments, 1, timeout=TIMEOUT)
    # MLP's gradients in bytes: fc1.weight 512, fc1.bias 64, fc2.weight 1024, fc2.bias 64, fc3.weight 256,
    # fc3.bias 16. From the last: 16 + 256 + 64 = 336 >= 300 closes a bucket, 1024 alone does, 64 + 512 does.
    assert got["mlp_300_bytes"] == [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight"], ["fc1.bias", "fc1.weight"]]
    names = [n for n, _ in MODELS["mlp"]().named_parameters()]
    assert got["mlp_tiny"] == [[n] for n in reversed(names)]  # a tiny cap: each parameter its own bucket
    # float64 fc1 and fc3 in one bucket, float32 fc2 in another; fc3.bias is the latest parameter: its bucket first
    assert got["mixed_dtypes"] == [["fc3.bias", "fc3.weight", "fc1.bias", "fc1.weight"], ["fc2.bias", "fc2.weight"]]
    assert got["frozen"] == [["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight"]]  # frozen fc1: no slot
    assert got["tied"] == [["mix.bias", "mix.weight", "embed.weight"]]  # the shared weight once
    # a cap of 104 bytes: head.bias 16 + head.weight 128 close the first bucket, the 128 KiB embedding fills one
    # alone; the 0-d scale, a parameter of the module itself, is registered before its children's: the last bucket
    assert got["lopsided"] == [["head.bias", "head.weight"], ["embed.weight"], ["scale"]]
    assert got.get("cap_0") == "ValueError"


# --8<-- [start:order]
def _launch_order(rank, world_size, model_name, cap, variant=None):
    torch.manual_seed(0)
    model = _model(model_name, rank)
    arrived = []  # the order gradients arrive in, seen by hooks of the test's own
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: arrived.append(name))
    ddp = _wrapper(variant)(model, bucket_cap_mb=cap)
    x, y = _batch(rank, 0, 0)
    with Issued() as seen:  # the collectives at the dispatcher, whoever issues them
        F.mse_loss(ddp(x), y).backward()
    return ddp.bucket_assignment, arrived, [n for op, n in seen.ops if op == "allreduce_"]
# --8<-- [end:order]


def _completion_order(buckets, arrived):
    last = {b: max(arrived.index(n) for n in names) for b, names in enumerate(buckets)}
    return sorted(last, key=last.get)


def _order_failures(results, sizes):
    failures = []
    for rank, (buckets, arrived, all_reduces) in enumerate(results):
        numels = [sum(sizes[n] for n in names) for names in buckets]
        assert len(set(numels)) == len(numels), numels  # the test's premise: a size names its bucket
        launched = [numels.index(n) if n in numels else n for n in all_reduces]
        if launched != list(range(len(buckets))):
            failures.append(f"rank {rank}: buckets launched in the order {launched}, not 0..{len(buckets) - 1}; "
                            f"they completed in the order {_completion_order(buckets, arrived)}; buckets {buckets}")
    return failures


def test_buckets_launch_in_bucket_order_on_every_rank():
    # ReverseOrder registers last, middle, first and runs first, middle, last: bucket 0 (the last registered,
    # `first`) completes last, yet must be launched first, and the buckets after it wait for it
    results = run_on_ranks(_launch_order, 2, args=("reverse_order", 0.0002), timeout=TIMEOUT)
    sizes = {n: p.numel() for n, p in MODELS["reverse_order"]().named_parameters()}
    buckets, arrived, _ = results[0]
    assert _completion_order(buckets, arrived) == [2, 1, 0]  # the premise: completion order is not bucket order
    assert _order_failures(results, sizes) == []


# --8<-- [start:pairing]
def _pairing(rank, world_size, variant=None):
    torch.manual_seed(0)
    model = Parallel(a_first=rank == 0)
    arrived = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: arrived.append(name))
    ddp = _wrapper(variant)(model, bucket_cap_mb=1e-6)  # four buckets: b.bias, b.weight, a.bias, a.weight
    alone = copy.deepcopy(model)  # no DDP: this rank's own gradient
    x, y = _batch(rank, 0, 0)
    F.mse_loss(ddp(x), y).backward()
    F.mse_loss(alone(x), y).backward()
    return arrived, {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in alone.named_parameters()}
# --8<-- [end:pairing]


def _pairing_failures(results):
    expected = {n: torch.stack([own[n] for _, _, own in results]).mean(0) for n in results[0][2]}
    failures = []
    for rank, (_, grads, _) in enumerate(results):
        for name, grad in grads.items():
            if not torch.allclose(grad, expected[name], rtol=1e-6, atol=1e-7):
                failures.append(f"rank {rank}: {name}.grad is not the mean of the ranks' {name} gradients "
                                f"({_max_diff(grad, expected[name]):.2e} off)")
    return failures


def test_ranks_that_complete_buckets_in_different_orders_still_pair_them():
    results = run_on_ranks(_pairing, 2, timeout=TIMEOUT)
    (arrived0, *_), (arrived1, *_) = results
    assert arrived0 == ["b.bias", "b.weight", "a.bias", "a.weight"]  # the premise: the ranks' orders differ
    assert arrived1 == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert _pairing_failures(results) == []


# --- no_sync and the wrap -------------------------------------------------------------------------------------

# --8<-- [start:no_sync]
def _no_sync(rank, world_size, variant=None):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ddp = _wrapper(variant)(model, bucket_cap_mb=0.001)
    alone = copy.deepcopy(model)  # no DDP: the local sum of gradients
    (x1, y1), (x2, y2) = _batch(rank, 0, 0), _batch(rank, 0, 1)
    with ddp.no_sync():
        with Issued() as inside:
            F.mse_loss(ddp(x1), y1).backward()
    F.mse_loss(alone(x1), y1).backward()
    local = max(_max_diff(p.grad, q.grad) for p, q in zip(model.parameters(), alone.parameters()))
    with Issued() as synced:
        F.mse_loss(ddp(x2), y2).backward()  # the sync: the mean over ranks of the accumulated sums
    F.mse_loss(alone(x2), y2).backward()
    sums = torch.cat([p.grad.flatten() for p in alone.parameters()])
    mean = sums.clone()
    dist.all_reduce(mean)
    mean /= world_size
    averaged = _max_diff(torch.cat([p.grad.flatten() for p in model.parameters()]), mean)
    ddp.zero_grad()
    with ddp.no_sync():  # torch's rule: what counts is where the forward ran
        loss = F.mse_loss(ddp(x1), y1)
    with Issued() as forward_inside:
        loss.backward()
    count = [sum(op == "allreduce_" for op, _ in s.ops) for s in (inside, synced, forward_inside)]
    return count, local, averaged, _max_diff(sums, mean), len(ddp.bucket_assignment)
# --8<-- [end:no_sync]


def _no_sync_failures(results):
    failures = []
    for rank, ((inside, synced, forward_inside), local, averaged, spread, buckets) in enumerate(results):
        assert spread > 1e-3  # the premise: the ranks' local sums differ, so the mean is not any rank's own
        if inside or forward_inside:
            failures.append(f"rank {rank}: {inside} all-reduce(s) inside no_sync, {forward_inside} for a forward "
                            "run inside it: none expected")
        if local != 0.0:
            failures.append(f"rank {rank}: inside no_sync .grad is {local:.2e} away from the rank's own gradient")
        if synced != buckets:
            failures.append(f"rank {rank}: the synced backward issued {synced} all-reduces for {buckets} buckets")
        if averaged > 1e-6:
            failures.append(f"rank {rank}: after the sync .grad is {averaged:.2e} away from the mean over ranks of "
                            "the accumulated sums")
    return failures


def test_no_sync_keeps_gradients_local_then_averages_the_sums():
    assert _no_sync_failures(run_on_ranks(_no_sync, 2, timeout=TIMEOUT)) == []


def _wrap(rank, world_size, variant=None):
    torch.manual_seed(1000 + rank)
    model = MODELS["batchnorm"]()
    model.bn.running_mean.fill_(float(rank))  # a buffer that differs too
    before = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    _wrapper(variant)(model)
    return before, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _wrap_failures(results):
    rank0_before = results[0][0]
    return [f"rank {rank}: tensor {i} after the wrap is not rank 0's" for rank, (_, after) in enumerate(results)
            for i, (a, b) in enumerate(zip(after, rank0_before)) if not torch.equal(a, b)]


def test_wrap_broadcasts_parameters_and_buffers_from_rank_0():
    results = run_on_ranks(_wrap, 3, timeout=TIMEOUT)
    assert not torch.equal(results[0][0][0], results[1][0][0])  # the premise: the ranks started apart
    assert _wrap_failures(results) == []


def _unused(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["branchy"]()
    ddp = BucketedDataParallel(model, bucket_cap_mb=1e-6)
    model.use_branch = False
    x, y = _batch(rank, 0, 0)
    try:
        F.mse_loss(ddp(x), y).backward()
        error = None
    except RuntimeError as err:
        error = str(err)
    ddp.zero_grad()
    model.use_branch = True  # the next backward, with every parameter used, works
    F.mse_loss(ddp(x), y).backward()
    return error, model.branch.weight.grad is not None


def test_a_parameter_without_a_gradient_is_named_at_the_end_of_backward():
    for rank, (error, recovered) in enumerate(run_on_ranks(_unused, 2, timeout=TIMEOUT)):
        assert error is not None, f"rank {rank}: a backward that never reached branch.* raised nothing"
        assert "'branch.weight'" in error and "'branch.bias'" in error and "trunk" not in error, error
        assert recovered, f"rank {rank}: the backward after the error left branch.weight without a gradient"


# --- the negative controls, caught by the checks above -------------------------------------------------------

def test_negative_controls_fail_the_same_checks():
    sizes = {n: p.numel() for n, p in MODELS["reverse_order"]().named_parameters()}
    caught = {
        "no_divide": _torch_failures(run_on_ranks(_against_torch, 2, args=("mlp", 0.001, 1, "no_divide"),
                                                  timeout=TIMEOUT), "mlp"),
        "completion_order": _order_failures(run_on_ranks(_launch_order, 2, args=("reverse_order", 0.0002,
                                                                                 "completion_order"),
                                                         timeout=TIMEOUT), sizes)
        + _pairing_failures(run_on_ranks(_pairing, 2, args=("completion_order",), timeout=TIMEOUT)),
        "syncs_inside_no_sync": _no_sync_failures(run_on_ranks(_no_sync, 2, args=("syncs_inside_no_sync",),
                                                               timeout=TIMEOUT)),
        "no_broadcast": _wrap_failures(run_on_ranks(_wrap, 3, args=("no_broadcast",), timeout=TIMEOUT))
        + _one_process_failures(run_on_ranks(_against_one_process, 2, args=("mlp", 0.001, 1, "no_broadcast"),
                                             timeout=TIMEOUT), "mlp"),
    }
    assert {name: bool(failures) for name, failures in caught.items()} == {name: True for name in NEGATIVE}
