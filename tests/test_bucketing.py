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
from miniddp.testing import run_on_ranks

from models import MODELS


def _oracle(tensors, limits):
    return dist._compute_bucket_assignment_by_size(tensors, limits)[0]


def _t(numel, dtype=torch.float32):
    return torch.empty(numel, dtype=dtype)


# PyTorch's own cases (test/distributed/test_c10d_common.py, ComputeBucketAssignmentTest)
TORCH_CASES = [
    ([_t(50)] * 4, [400], [[0, 1], [2, 3]]),  # single limit, single dtype
    ([_t(10)] * 4, [40, 80], [[0], [1, 2], [3]]),  # limits in sequence, the last repeating
    ([_t(50), _t(25, torch.float64)] * 3, [400], [[0, 2], [1, 3], [4], [5]]),  # one open bucket per dtype
    ([_t(50), _t(25, torch.float64)] * 3, [200, 400], [[0], [1], [2, 4], [3, 5]]),  # limits per dtype
    ([_t(100), _t(200), _t(100), _t(50)], [400], [[0], [1], [2], [3]]),  # a tensor over the limit
]


@pytest.mark.parametrize("tensors, limits, expected", TORCH_CASES)
def test_pytorch_cases(tensors, limits, expected):
    assert miniddp.compute_bucket_assignment(tensors, limits) == expected
    assert _oracle(tensors, limits) == expected


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(DTYPES)), min_size=1, max_size=25),
    limits=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
)
def test_equals_torch_on_generated_cases(specs, limits):
    tensors = [_t(n, d) for n, d in specs]
    assert miniddp.compute_bucket_assignment(tensors, limits) == _oracle(tensors, limits)


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
    assert before == expected == [["fc3.bias"], ["fc2.bias", "fc3.weight"], ["fc1.bias", "fc2.weight"], ["fc1.weight"]]
    assert ready[0] == "fc3.bias"  # the last layer's gradients arrive first


def test_buckets_launch_in_order_on_every_rank():
    results = run_on_ranks(_assignment_and_trace, 3, args=("mlp", 0.0002, 2), timeout=60)
    for _, after, _, launched, _ in results:
        assert launched == sorted(launched) == list(range(len(after)))
    assert len({str(r[1]) for r in results}) == 1  # every rank agrees on the buckets


def test_rebuild_follows_the_order_gradients_arrived():
    # ReverseOrder registers last, middle, first but runs first, middle, last: registration
    # order puts "first" in the first-reduced bucket, yet its gradient arrives last
    [(before, after, ready, launched, _)] = run_on_ranks(_assignment_and_trace, 2, args=("reverse_order", 0.0002, 2),
                                                         timeout=60)[:1]
    assert before[0][0].startswith("first")
    assert after[0][0].startswith("last") and after[-1][-1].startswith("first")
    flat_after = [n for bucket in after for n in bucket]
    assert flat_after == ready  # second iteration: buckets fill exactly in arrival order


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
    assert results[0][1] == results[1][1]  # one agreed assignment: rank 0's arrival order
    assert results[0][1][0][0].startswith("b.")  # rank 0 runs a first, so b's gradients arrive first
    for grads, _ in results:
        theirs, ours = grads[:3], grads[3:]
        for step, (t, o) in enumerate(zip(theirs, ours)):
            assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(t, o)), f"step {step} differs from torch DDP"


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
