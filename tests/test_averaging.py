"""All-reduce averaging: the naive per-parameter mean, where to divide, and a ring from scratch.

Oracles: the mean of the ranks' gradients computed in the parent, and
``dist.all_reduce`` itself, which ``ring_all_reduce`` must equal exactly on
integer-valued data of every shape and dtype, on any world size and on subgroups.
"""

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from miniddp.by_hand.averaging import (
    all_reduce_mean,
    average_gradients,
    chunk_bounds,
    naive_all_reduce,
    ring_all_reduce,
    ring_schedule,
)
from miniddp.testing import backend_params, run_on_ranks

TIMEOUT = 60


def device_for(backend, rank):
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


# --- average_gradients ---------------------------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model.frozen = nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)  # grad stays None
    return model


def rank_grads(rank, model):
    """A different, reproducible gradient on each rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters() if p.requires_grad]


def _average(rank, world_size, backend, predivide):
    device = device_for(backend, rank)
    model = make_model().to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p, grad in zip(trainable, rank_grads(rank, model)):
        p.grad = grad.to(device)
    calls = []  # count the collectives independently of the return value
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        issued = average_gradients(model, predivide=predivide)
    finally:
        dist.all_reduce = real_all_reduce
    assert model.frozen.grad is None
    return issued, calls, [p.grad.cpu().tolist() for p in trainable]  # plain data crosses the pipe


# --8<-- [start:average]
@pytest.mark.parametrize("backend", backend_params(3))
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("predivide", [True, False])
def test_average_gradients_is_the_mean_over_ranks(backend, world_size, predivide):
    if backend == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip("needs a GPU per rank")
    results = run_on_ranks(_average, world_size, args=(backend, predivide), backend=backend, timeout=TIMEOUT)
    model = make_model()
    per_rank = [rank_grads(r, model) for r in range(world_size)]
    expected = [torch.stack(gs).mean(0) for gs in zip(*per_rank)]
    for issued, calls, grads in results:
        assert issued == len(calls) == 4  # two weights, two biases; the frozen one is skipped
        assert calls == [p.numel() for p in model.parameters() if p.requires_grad]
        for got, want in zip(grads, expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-12, atol=1e-12)
    for _, _, grads in results[1:]:  # every rank holds the very same bits
        assert grads == results[0][2]
# --8<-- [end:average]


def _average_list(rank, world_size):
    w = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(3))  # no grad: skipped
    w.grad = torch.full((3,), float(rank + 1))
    issued = average_gradients([w, w, b])  # a tied parameter listed twice is averaged once
    issued_gen = average_gradients(p for p in [b])  # a generator works; nothing to do
    issued_one = average_gradients(w)  # a single tensor
    return issued, issued_gen, issued_one, w.grad.tolist()


def test_average_gradients_accepts_params_and_skips_none_and_duplicates():
    results = run_on_ranks(_average_list, 2, timeout=TIMEOUT)
    for issued, issued_gen, issued_one, grad in results:
        assert (issued, issued_gen, issued_one) == (1, 0, 1)
        assert grad == [1.5] * 3  # mean(1, 2) = 1.5, and the mean of equal values is itself


def _average_on_subgroup(rank, world_size):
    group = dist.new_group([0, 2])  # every rank creates it; rank 1 is not a member
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.full((2,), float(rank**2))  # 0, 1, 4
    issued = average_gradients([w], group=group)
    return issued, w.grad.tolist()


def test_average_gradients_on_a_subgroup_leaves_non_members_alone():
    results = run_on_ranks(_average_on_subgroup, 3, timeout=TIMEOUT)
    assert results == [(1, [2.0, 2.0]), (0, [1.0, 1.0]), (1, [2.0, 2.0])]  # mean(0, 4) = 2; rank 1 kept its 1


# --- where to divide: before or after the SUM ----------------------------------------------------

def _fp16_division(rank, world_size, backend):
    device = device_for(backend, rank)
    big = torch.full((4,), 40000.0, dtype=torch.float16, device=device)  # fp16 max is 65504
    tiny = torch.full((4,), 1e-7, dtype=torch.float16, device=device)  # a subnormal in fp16
    results = {
        "big_pre": all_reduce_mean(big.clone(), predivide=True),
        "big_post": all_reduce_mean(big.clone(), predivide=False),
        "tiny_pre": all_reduce_mean(tiny.clone(), predivide=True),
        "tiny_post": all_reduce_mean(tiny.clone(), predivide=False),
        "tiny": tiny,
    }
    return {name: t.tolist() for name, t in results.items()}  # fp16 -> float is exact


# --8<-- [start:fp16]
@pytest.mark.parametrize("backend", backend_params(4))
def test_predivision_avoids_fp16_overflow_and_postdivision_avoids_underflow(backend):
    for r in run_on_ranks(_fp16_division, 4, args=(backend,), backend=backend, timeout=TIMEOUT):
        # 4 x 40000 = 160000 > 65504: summing first overflows, dividing first does not
        assert r["big_post"] == [float("inf")] * 4
        assert r["big_pre"] == [40000.0] * 4
        # the other side of the trade: 1e-7 / 4 is below fp16's smallest subnormal (6e-8)
        assert r["tiny_pre"] == [0.0] * 4
        assert r["tiny_post"] == r["tiny"] != [0.0] * 4
# --8<-- [end:fp16]


def _avg_op(rank, world_size, backend):
    device = device_for(backend, rank)
    out = {}
    for name, tensor, op in [
        ("avg_fp16", torch.full((2,), 40000.0, dtype=torch.float16, device=device), dist.ReduceOp.AVG),
        ("avg_float", torch.full((2,), float(2 * rank + 1), device=device), dist.ReduceOp.AVG),
        ("avg_int", torch.full((2,), 2 * rank + 1, dtype=torch.int64, device=device), dist.ReduceOp.AVG),
        ("premul_sum", torch.ones(2, device=device), dist._make_nccl_premul_sum(0.5)),
    ]:
        try:
            dist.all_reduce(tensor, op=op)
            out[name] = tensor.tolist()
        except (RuntimeError, ValueError) as exc:
            out[name] = str(exc)
    return out


GLOO_HAS_AVG = torch.torch_version.TorchVersion(torch.__version__) >= "2.7"  # pytorch/pytorch#149781


# --8<-- [start:avg]
@pytest.mark.parametrize("backend", backend_params(2))
def test_reduce_op_avg_is_not_portable(backend):
    for r in run_on_ranks(_avg_op, 2, args=(backend,), backend=backend, timeout=TIMEOUT):
        if backend == "nccl":  # ncclAvg pre-multiplies by 1/n: no overflow
            assert r["avg_fp16"] == [40000.0] * 2
            continue
        # gloo: no pre-multiplied sum, and no integer average
        assert "PREMUL_SUM" in r["premul_sum"]
        assert isinstance(r["avg_int"], str)  # an error message, not a result
        if not GLOO_HAS_AVG:  # torch < 2.7: "Cannot use ReduceOp.AVG with Gloo"
            assert "AVG" in r["avg_float"]
        else:  # torch >= 2.7: SUM, then divide -- a post-division, so fp16 overflows
            assert r["avg_float"] == [2.0, 2.0]
            assert r["avg_fp16"] == [float("inf")] * 2
# --8<-- [end:avg]


# --- ring all-reduce -----------------------------------------------------------------------------

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8"]
SHAPES = [(), (0,), (1,), (2,), (3,), (4,), (5,), (7,), (1000,), (3, 5), (2, 3, 4), (17, 1), (257,)]


def ring_cases(seed=0, random_cases=30):
    """Every dtype x a few edge shapes, plus random shapes; ``T`` marks a transposed (non-contiguous) view."""
    rng = random.Random(seed)
    cases = [(shape, dtype, False) for shape in SHAPES for dtype in DTYPES[:2]]
    cases += [((5,), dtype, False) for dtype in DTYPES[2:]] + [((6, 3), dtype, True) for dtype in DTYPES]
    for _ in range(random_cases):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        cases.append((shape, rng.choice(DTYPES), rng.random() < 0.3 and len(shape) >= 2))
    return cases


def integer_valued(shape, dtype, rank, index, device):
    g = torch.Generator().manual_seed(7919 * index + rank)
    low = 0 if dtype == "uint8" else -20  # |sum| <= 5 x 20: exact in every dtype here
    return torch.randint(low, 21, shape, generator=g).to(getattr(torch, dtype)).to(device)


def _ring_vs_collectives(rank, world_size, backend, cases):
    device = device_for(backend, rank)
    non_contiguous = 0
    for index, (shape, dtype, transposed) in enumerate(cases):
        base = integer_valued(shape, dtype, rank, index, device)
        if transposed:
            base = base.transpose(0, 1)  # a non-contiguous view: reduced in place all the same
        ring, reference, naive = base.clone(), base.clone(), base.clone()  # clone keeps the strides
        non_contiguous += not ring.is_contiguous()
        out = ring_all_reduce(ring)
        dist.all_reduce(reference)
        naive_all_reduce(naive)
        assert out is ring, "ring_all_reduce must work in place and return its argument"
        assert torch.equal(ring, reference), f"ring != dist.all_reduce for {shape} {dtype}"
        assert torch.equal(naive, reference), f"naive != dist.all_reduce for {shape} {dtype}"
    return len(cases), non_contiguous


# --8<-- [start:ring]
@pytest.mark.parametrize("backend", backend_params(5))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ring_all_reduce_equals_dist_all_reduce(backend, world_size):
    cases = ring_cases(seed=world_size)
    done = run_on_ranks(_ring_vs_collectives, world_size, args=(backend, cases), backend=backend, timeout=TIMEOUT)
    assert {d[0] for d in done} == {len(cases)}
    assert min(d[1] for d in done) >= len(DTYPES)  # the transposed views were really non-contiguous
# --8<-- [end:ring]


def _ring_on_subgroups(rank, world_size, backend):
    device = device_for(backend, rank)
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank creates every group
    tail = dist.new_group([1, 2, 3])
    mine = evens if rank % 2 == 0 else odds
    x = torch.arange(10.0, device=device) * (rank + 1)
    ring, ref = x.clone(), x.clone()
    ring_all_reduce(ring, group=mine)
    dist.all_reduce(ref, group=mine)
    ring_tail, ref_tail = x.clone(), x.clone()
    ring_all_reduce(ring_tail, group=tail)  # rank 0 is not a member: left untouched
    if rank != 0:
        dist.all_reduce(ref_tail, group=tail)
    return torch.equal(ring, ref), torch.equal(ring_tail, ref_tail), torch.equal(ring_tail, x)


@pytest.mark.parametrize("backend", backend_params(4))
def test_ring_all_reduce_on_subgroups_uses_group_ranks(backend):
    results = run_on_ranks(_ring_on_subgroups, 4, args=(backend,), backend=backend, timeout=TIMEOUT)
    assert [r[:2] for r in results] == [(True, True)] * 4
    assert results[0][2] and not any(r[2] for r in results[1:])


def _on_a_parameter(rank, world_size):
    p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # requires_grad: in-place ops need no_grad
    ring_all_reduce(p)
    naive = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    naive_all_reduce(naive)
    return p.tolist(), naive.tolist(), p.requires_grad


def test_ring_all_reduce_works_on_parameters_like_dist_all_reduce():
    for ring, naive, requires_grad in run_on_ranks(_on_a_parameter, 2, timeout=TIMEOUT):
        assert ring == naive == [3.0] * 3 and requires_grad


def _ring_traffic(rank, world_size, numel):
    sent, exchanges = [], 0
    real_batch, real_all_reduce = dist.batch_isend_irecv, dist.all_reduce

    def recording_batch(ops):
        nonlocal exchanges
        exchanges += 1
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    def forbidden(*args, **kwargs):
        raise AssertionError("ring_all_reduce must use point-to-point messages only")

    dist.batch_isend_irecv, dist.all_reduce = recording_batch, forbidden
    try:
        ring_all_reduce(torch.ones(numel))
    finally:
        dist.batch_isend_irecv, dist.all_reduce = real_batch, real_all_reduce
    return exchanges, sum(sent)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_sends_2_n_minus_1_over_n_of_the_tensor(world_size):
    numel = 1200  # divisible by 2, 3 and 4
    for exchanges, sent in run_on_ranks(_ring_traffic, world_size, args=(numel,), timeout=TIMEOUT):
        assert exchanges == 2 * (world_size - 1)
        assert sent == 2 * (world_size - 1) * numel // world_size


# --- the schedule and the chunks, without any process group --------------------------------------

@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 10_000), world_size=st.integers(1, 64))
def test_chunk_bounds_tile_the_tensor_with_sizes_differing_by_at_most_one(numel, world_size):
    bounds = chunk_bounds(numel, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("world_size", range(1, 10))
def test_ring_schedule_sums_every_chunk_everywhere(world_size):
    """Simulate the ring with sets of contributors instead of numbers."""
    n = world_size
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk] = ranks summed into it
    schedules = [ring_schedule(r, n) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    for step in range(2 * (n - 1)):
        messages = [(schedules[r][step], set(held[r][schedules[r][step][1]])) for r in range(n)]
        for r in range(n):
            (phase, sent, _), payload = messages[(r - 1) % n]  # from the left neighbour
            recv = schedules[r][step][2]
            assert sent == recv  # sender and receiver agree on the chunk (and on its size)
            held[r][recv] = held[r][recv] | payload if phase == "reduce-scatter" else payload
        if step == n - 2:  # end of reduce-scatter: rank r owns chunk r + 1, fully summed
            assert all(held[r][(r + 1) % n] == set(range(n)) for r in range(n))
    assert all(chunk == set(range(n)) for rank in held for chunk in rank)
