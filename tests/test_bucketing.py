"""Bucket assignment (against torch's own function), bucket order, views, overlap, rebuild."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import miniddp
from miniddp.diagnostics.trace import Tracer
from miniddp.engine.bucketing import Bucket, MiB, bucket_size_limits
from miniddp.launching.spawn import run_on_ranks

from issued import Issued  # the collectives a rank issues, seen at the dispatcher
from models import MODELS


def _oracle(tensors, limits):
    return dist._compute_bucket_assignment_by_size(tensors, limits)[0]


def _t(numel, dtype=torch.float32):
    return torch.empty(numel, dtype=dtype)


# PyTorch's own cases (test/distributed/test_c10d_common.py, ComputeBucketAssignmentTest)
TORCH_CASES = {
    "single_limit": ([_t(50)] * 4, [400], [[0, 1], [2, 3]]),
    "limits_in_sequence_the_last_repeating": ([_t(10)] * 4, [40, 80], [[0], [1, 2], [3]]),
    "one_open_bucket_per_dtype": ([_t(50), _t(25, torch.float64)] * 3, [400], [[0, 2], [1, 3], [4], [5]]),
    "limits_per_dtype": ([_t(50), _t(25, torch.float64)] * 3, [200, 400], [[0], [1], [2, 4], [3, 5]]),
    "a_tensor_over_the_limit": ([_t(100), _t(200), _t(100), _t(50)], [400], [[0], [1], [2], [3]]),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_pytorch_cases(case):
    tensors, limits, expected = TORCH_CASES[case]
    got = miniddp.compute_bucket_assignment(tensors, limits)
    described = [f"{t.numel() * t.element_size()} B {str(t.dtype)[6:]}" for t in tensors]
    assert got == expected, f"{case}: tensors {described}, limits {limits}: got {got}, torch's is {expected}"
    assert _oracle(tensors, limits) == expected


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(DTYPES)), min_size=1, max_size=25),
    limits=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
)
def test_equals_torch_on_generated_cases(specs, limits):
    tensors = [_t(n, d) for n, d in specs]
    got, expected = miniddp.compute_bucket_assignment(tensors, limits), _oracle(tensors, limits)
    described = [f"{t.numel() * t.element_size()} B {str(t.dtype)[6:]}" for t in tensors]
    assert got == expected, f"tensors {described}, limits {limits}: got {got}, torch's is {expected}"


def test_defaults_are_torchs():
    assert bucket_size_limits(None) == [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB]
    assert bucket_size_limits(4) == [4 * MiB]  # an explicit cap applies to every bucket


@pytest.mark.parametrize("bad", [0, -1, "25", True, float("nan")])
def test_bad_caps_are_named(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_size_limits(bad)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="bucket_size_limits"):
        miniddp.compute_bucket_assignment([_t(4)], [])


def test_bucket_layout_and_views():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    b = Bucket(0, params, ["a", "b"], [0, 1])
    assert b.buffer.numel() == 6 + 4  # gradients only: which ranks had one travels apart (unused.UsedCounts)
    b.put(0, torch.full((2, 3), 4.0), divisor=2)  # copied and divided by the world size in one pass
    b.put(1, None, divisor=2)  # no gradient here: zeros
    assert torch.equal(b.views[0], torch.full((2, 3), 2.0)) and torch.equal(b.views[1], torch.zeros(4))
    hooked = b.for_hook(is_last=True)  # what a comm hook sees: torch's GradBucket methods
    assert hooked.buffer() is b.buffer and hooked.index() == 0 and hooked.is_last()
    assert [g.shape for g in hooked.gradients()] == [(2, 3), (4,)] and hooked.parameters() == params


def _bucket_view_grad(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1, bias=False)
    ddp = miniddp.DistributedDataParallel(model, gradient_as_bucket_view=True)
    model.weight.grad = torch.full((1, 5), 6.0 * (rank + 1))  # accumulated before: the backward adds to it
    ddp(torch.zeros(2, 5)).sum().backward()  # d/dw of sum(w x) with x = 0: zeros
    bucket = ddp.reducer.buckets[0]
    return model.weight.grad.data_ptr() == bucket.views[0].data_ptr(), model.weight.grad


def test_bucket_view_makes_grad_alias_the_buffer():
    for aliases, grad in run_on_ranks(_bucket_view_grad, 2, timeout=30):
        assert aliases and torch.equal(grad, torch.full((1, 5), 9.0))  # (6 + 12) / 2, living in the bucket


def _assignment_and_trace(rank, world_size, model_name, cap, steps):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    tracer = Tracer(rank)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=cap, tracer=tracer)
    before = ddp.bucket_assignment
    for step in range(steps):
        tracer.clear()
        torch.manual_seed(rank + 10 * step)
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    ready = [e["param"] for e in tracer.events if e["name"] == "grad ready"]
    launched = [e["bucket"] for e in tracer.events if e["name"] == "bucket launched"]
    return before, ddp.bucket_assignment, ready, launched, tracer.events


def test_buckets_reduce_in_reverse_registration_order():
    [(before, _, ready, launched, _)] = run_on_ranks(_assignment_and_trace, 1, args=("mlp", 0.0001, 1), timeout=30)
    params = dict(MODELS["mlp"]().named_parameters())
    names = list(params)
    # torch DDP's rule (with find_unused_parameters=True; without, torch 2.x starts with one
    # bucket): fill in registration order with the cap, then reverse the list of buckets
    expected = [[names[i] for i in b] for b in reversed(_oracle(list(params.values()), [int(0.0001 * MiB)]))]
    assert expected == [["fc3.bias"], ["fc2.bias", "fc3.weight"], ["fc1.bias", "fc2.weight"], ["fc1.weight"]]
    assert before == expected, (f"MLP's buckets at wrap (cap 0.0001 MiB) are {before}: torch's assignment in "
                                f"registration order, reversed, is {expected}")
    assert ready[0] == "fc3.bias"  # the last layer's gradients arrive first


def _launches(rank, world_size, model_name, cap, steps):
    """Per step: the buckets it ran with, the order gradients arrived (the test's own hooks, after the reducer's
    on each parameter) and the sizes of the all-reduces issued, in order (at the dispatcher, whoever issues
    them); and the buckets at the end. A step that raises ends the run, its error returned."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=cap)
    arrived = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: arrived.append(name))
    out = []
    for step in range(steps):
        arrived.clear()
        torch.manual_seed(rank + 10 * step)
        loss, error = F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)), None
        buckets = ddp.bucket_assignment  # after the forward: a rebuild happens at the second one
        with Issued() as seen:
            try:
                loss.backward()
            except Exception as err:  # noqa: BLE001 - the launch order is still reported
                error = f"{type(err).__name__}: {err}"
        out.append((buckets, list(arrived), [n for op, n in seen.ops if op == "allreduce_"], error))
        if error:
            break
    return out, ddp.bucket_assignment


def _completion_order(buckets, arrived) -> list[int]:
    """The buckets in the order their last gradient arrived."""
    last = {b: max(arrived.index(n) for n in names) for b, names in enumerate(buckets)}
    return sorted(last, key=last.get)


def test_buckets_launch_in_order_on_every_rank():
    # ReverseOrder's first backward completes the buckets last to first (its gradients arrive in the
    # reverse of the first buckets' order): a reducer must still launch bucket 0, then 1, ..., as torch does
    results = run_on_ranks(_launches, 3, args=("reverse_order", 0.0002, 2), timeout=60)
    sizes = {n: p.numel() for n, p in MODELS["reverse_order"]().named_parameters()}
    first_buckets, arrived = results[0][0][0][:2]
    assert _completion_order(first_buckets, arrived) != list(range(len(first_buckets)))  # the test can fail
    for rank, (steps, _) in enumerate(results):
        for step, (buckets, arrived, all_reduces, error) in enumerate(steps):
            numels = [sum(sizes[n] for n in names) for names in buckets]
            assert len(set(numels)) == len(numels), numels  # the test's own premise: a size names its bucket
            launched = [numels.index(n) for n in all_reduces if n in numels]
            assert launched == list(range(len(buckets))), (
                f"rank {rank}, step {step}: buckets launched in the order {launched} (all-reduces of {all_reduces} "
                f"elements), not 0..{len(buckets) - 1}; they completed in the order "
                f"{_completion_order(buckets, arrived)}. Buckets: {buckets}")
            assert error is None, f"rank {rank}, step {step}: {error}"
    assert len({str(r[1]) for r in results}) == 1  # every rank agrees on the buckets


def test_rebuild_follows_the_order_gradients_arrived():
    # ReverseOrder registers last, middle, first but runs first, middle, last: registration
    # order puts "first" in the first-reduced bucket, yet its gradient arrives last
    [(steps, after)] = run_on_ranks(_launches, 2, args=("reverse_order", 0.0002, 2), timeout=60)[:1]
    errors = [f"step {step}: {error}" for step, (*_, error) in enumerate(steps) if error]
    assert not errors, errors[0]
    (before, first_arrived, _, _), (_, arrived, _, _) = steps
    assert before[0][0].startswith("first")
    flat_after = [n for bucket in after for n in bucket]
    assert flat_after == first_arrived, (f"the buckets after the first step, {after}, are not filled in the order "
                                         f"the first backward's gradients arrived: {first_arrived}")
    assert flat_after == arrived  # the second backward's gradients arrive in that order too: each bucket fills in turn


class _TwoBranches(torch.nn.Module):
    """Two same-shaped branches run in a rank-dependent order: their gradients arrive in that order's
    reverse, so each rank's first backward sees a different arrival order."""

    def __init__(self, flip: bool):
        super().__init__()
        self.a, self.b, self.flip = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), flip

    def forward(self, x):
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        y = first(x)
        return y * 2 + second(x)  # not symmetric: a mixed-up bucket changes the gradients


def _rebuilt_across_rank_dependent_orders(rank, world_size):
    grads, assignments = [], []
    for wrapper in (torch.nn.parallel.DistributedDataParallel, miniddp.DistributedDataParallel):
        torch.manual_seed(0)
        model = _TwoBranches(flip=rank % 2 == 1)
        ddp = wrapper(model, bucket_cap_mb=0.0001)  # each tensor its own bucket
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):  # the first backward records the order; the rebuilt buckets serve the rest
            torch.manual_seed(100 * step + rank)
            opt.zero_grad()
            ddp(torch.randn(3, 6)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        assignments.append(getattr(ddp, "bucket_assignment", None))
    return grads, assignments[1]


def test_rebuilt_buckets_are_rank_0s_order_when_ranks_see_different_orders():
    results = run_on_ranks(_rebuilt_across_rank_dependent_orders, 2, timeout=60)
    assert results[0][1] == results[1][1], (f"rank 0 rebuilt the buckets {results[0][1]}, rank 1 {results[1][1]}: "
                                            "every rank must build the same ones, from rank 0's arrival order")
    assert results[0][1][0][0].startswith("b."), (f"the rebuilt buckets are {results[0][1]}: rank 0 runs a first, "
                                                  "so b's gradients arrive first there and its order wins")
    names = [n for n, _ in _TwoBranches(flip=False).named_parameters()]
    for rank, (grads, _) in enumerate(results):
        theirs, ours = grads[:3], grads[3:]
        for step, (t, o) in enumerate(zip(theirs, ours)):
            for name, x, y in zip(names, t, o):
                assert torch.allclose(x, y, atol=1e-6), (f"rank {rank}, step {step}: {name}.grad differs from torch "
                                                         f"DDP's by {(x - y).abs().max().item():.2e}")


def _launched_before_the_last_gradient(events) -> list[int]:
    """The buckets whose all-reduce was launched while backward still had gradients to compute."""
    last_grad = max(e["t"] for e in events if e["name"] == "grad ready")
    return [e["bucket"] for e in events if e["name"] == "bucket launched" and e["t"] < last_grad]


def _trace_with_launches_deferred_to_the_end(rank, world_size):
    """Negative control: the reducer launches nothing until backward is over (no overlap at all)."""
    from miniddp.engine.reducer import Reducer

    launch = Reducer._launch
    Reducer._launch = lambda self, state, wait=False: launch(self, state, wait) if wait else None
    return _assignment_and_trace(rank, world_size, "mlp", 0.0001, 2)


def test_buckets_launch_while_backward_still_computes():
    [(_, after, _, _, events)] = run_on_ranks(_assignment_and_trace, 2, args=("mlp", 0.0001, 2), timeout=60)[:1]
    early = _launched_before_the_last_gradient(events)
    assert len(after) > 1 and early and early == list(range(len(early)))  # the first buckets, in order
    [(_, _, _, launched, late)] = run_on_ranks(_trace_with_launches_deferred_to_the_end, 2, timeout=60)[:1]
    assert launched == list(range(len(after))) and _launched_before_the_last_gradient(late) == []
