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
from miniddp.launching.spawn import run_on_ranks
from miniddp.testing import backend_params

from issued import Issued

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
    with Issued() as seen:  # the collectives, counted independently of the return value
        issued = average_gradients(model, predivide=predivide)
    assert model.frozen.grad is None
    calls = [numel for op, numel in seen.ops if op == "allreduce_"]
    return issued, calls, [p.grad.cpu().tolist() for p in trainable]  # plain data crosses the pipe


# --8<-- [start:average]
@pytest.mark.parametrize("backend", backend_params(3))
@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda n: f"world{n}")
@pytest.mark.parametrize("predivide", [True, False], ids=["predivide", "postdivide"])
def test_average_gradients_is_the_mean_over_ranks(backend, world_size, predivide):
    if backend == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip("needs a GPU per rank")
    results = run_on_ranks(_average, world_size, args=(backend, predivide), backend=backend, timeout=TIMEOUT)
    model = make_model()
    per_rank = [rank_grads(r, model) for r in range(world_size)]
    expected = [torch.stack(gs).mean(0) for gs in zip(*per_rank)]
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # two weights, two biases; not the frozen
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    case = f"{world_size} rank(s), predivide={predivide}"
    for rank, (issued, calls, grads) in enumerate(results):
        assert calls == sizes, (f"{case}, rank {rank}: all-reduces of {calls} elements were issued; the naive "
                                f"baseline issues one per gradient, in registration order: {sizes} ({names})")
        assert issued == len(calls), f"{case}, rank {rank}: returned {issued}, but issued {len(calls)} all-reduces"
        for name, got, want in zip(names, grads, expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, name=name, rank=rank: f"{case}, rank {rank}, {name}.grad is "
                                       f"not the mean over ranks: {m}")
    for rank, (_, _, grads) in enumerate(results[1:], 1):  # every rank holds the very same bits
        for name, got, first in zip(names, grads, results[0][2]):
            assert got == first, f"{case}: rank {rank}'s {name}.grad differs from rank 0's: {got} != {first}"
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
    for rank, (issued, issued_gen, issued_one, grad) in enumerate(results):
        for what, got, want in (("[w, w, b] (w listed twice, b without .grad)", issued, 1),
                                ("a generator over [b]", issued_gen, 0), ("the tensor w alone", issued_one, 1)):
            assert got == want, f"rank {rank}: average_gradients({what}) returned {got} all-reduces, not {want}"
        assert grad == [1.5] * 3, (f"rank {rank}: w.grad is {grad}, not [1.5, 1.5, 1.5]: the mean of 1 and 2, "
                                   "averaged once (then the mean of equal values is itself)")


def _average_on_subgroup(rank, world_size):
    group = dist.new_group([0, 2])  # every rank creates it; rank 1 is not a member
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.full((2,), float(rank**2))  # 0, 1, 4
    issued = average_gradients([w], group=group)
    return issued, w.grad.tolist()


def test_average_gradients_on_a_subgroup_leaves_non_members_alone():
    results = run_on_ranks(_average_on_subgroup, 3, timeout=TIMEOUT)
    expected = [(1, [2.0, 2.0]), (0, [1.0, 1.0]), (1, [2.0, 2.0])]  # mean(0, 4) = 2; rank 1 kept its 1, issued 0
    for rank, ((issued, grad), (want_issued, want_grad)) in enumerate(zip(results, expected)):
        role = "outside the group [0, 2]" if rank == 1 else "in the group [0, 2]"
        assert issued == want_issued, f"rank {rank} ({role}): returned {issued}, expected {want_issued}"
        assert grad == want_grad, f"rank {rank} ({role}): .grad is {grad}, expected {want_grad}"


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
    for rank, r in enumerate(run_on_ranks(_fp16_division, 4, args=(backend,), backend=backend, timeout=TIMEOUT)):
        # 4 x 40000 = 160000 > 65504: summing first overflows, dividing first does not
        assert r["big_post"] == [float("inf")] * 4, (f"rank {rank}: predivide=False on float16 40000s gave "
                                                     f"{r['big_post']}: the SUM (160000) comes first and overflows")
        assert r["big_pre"] == [40000.0] * 4, f"rank {rank}: predivide=True on float16 40000s gave {r['big_pre']}"
        # the other side of the trade: 1e-7 / 4 is below fp16's smallest subnormal (6e-8)
        assert r["tiny_pre"] == [0.0] * 4, f"rank {rank}: predivide=True on float16 1e-7s gave {r['tiny_pre']}"
        assert r["tiny_post"] == r["tiny"] != [0.0] * 4, (f"rank {rank}: predivide=False on float16 1e-7s gave "
                                                          f"{r['tiny_post']}, not {r['tiny']}")
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
        where = f"{world_size} ranks, rank {rank}, shape {shape} {dtype}{' transposed' if transposed else ''}"
        assert out is ring, f"{where}: ring_all_reduce must work in place and return its argument"
        if not torch.equal(ring, reference):
            wrong = (ring != reference).flatten().nonzero().flatten().tolist()
            raise AssertionError(f"{where}: ring_all_reduce != dist.all_reduce at flat element(s) {wrong[:8]} of "
                                 f"{ring.numel()}: {ring.flatten()[wrong[:3]].tolist()} instead of "
                                 f"{reference.flatten()[wrong[:3]].tolist()}")
        assert torch.equal(naive, reference), f"{where}: naive_all_reduce != dist.all_reduce"
    return len(cases), non_contiguous


# --8<-- [start:ring]
@pytest.mark.parametrize("backend", backend_params(5))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5], ids=lambda n: f"world{n}")
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
    for rank, (pairs, tail, untouched) in enumerate(results):
        group = "[0, 2]" if rank % 2 == 0 else "[1, 3]"
        assert pairs, f"rank {rank}: ring_all_reduce on the group {group} differs from dist.all_reduce on it"
        assert tail, f"rank {rank}: ring_all_reduce on the group [1, 2, 3] differs from dist.all_reduce on it"
        if rank == 0:
            assert untouched, "rank 0 is not in the group [1, 2, 3]: its tensor must come back untouched"


def _on_a_parameter(rank, world_size):
    p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # requires_grad: in-place ops need no_grad
    ring_all_reduce(p)
    naive = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    naive_all_reduce(naive)
    return p.tolist(), naive.tolist(), p.requires_grad


def test_ring_all_reduce_works_on_parameters_like_dist_all_reduce():
    for ring, naive, requires_grad in run_on_ranks(_on_a_parameter, 2, timeout=TIMEOUT):
        assert ring == naive == [3.0] * 3 and requires_grad


P2P = {"send", "recv_", "recv_any_source_"}  # the point-to-point operations, as the dispatcher names them


def _ring_traffic(rank, world_size, numel):
    with Issued() as seen:
        ring_all_reduce(torch.ones(numel))
    sends = [n for op, n in seen.ops if op == "send"]
    return sends, sorted({op for op, _ in seen.ops} - P2P)


@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda n: f"world{n}")
def test_each_rank_sends_2_n_minus_1_over_n_of_the_tensor(world_size):
    """Counted at the dispatcher: every message a rank sends (``dist.send``, ``dist.isend``, an isend ``P2POp``
    in ``batch_isend_irecv``: each is one ``c10d::send``) and every collective it issues, whatever the name."""
    numel, n = 1200, world_size  # divisible by 2, 3 and 4
    steps, chunk = 2 * (n - 1), numel // n
    for rank, (sends, collectives) in enumerate(run_on_ranks(_ring_traffic, n, args=(numel,), timeout=TIMEOUT)):
        assert not collectives, (f"{n} ranks, rank {rank}: ring_all_reduce issued the collective(s) {collectives}; "
                                 "a ring uses point-to-point sends and receives only")
        assert len(sends) == steps and sum(sends) == steps * chunk, (
            f"{n} ranks, rank {rank}: counted {len(sends)} sends of {sum(sends)} elements in all ({sends}); a ring "
            f"of {n} sends one chunk per step: {steps} sends of {chunk} elements, {steps * chunk} of the {numel}")


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


def _phase_names_message(rank, phases, n):
    return (f"ring_schedule({rank}, {n}) names its steps' phases {phases}: expected the literal strings, "
            f"{n - 1} x 'reduce-scatter' then {n - 1} x 'all-gather' (the docstring's names)")


@pytest.mark.parametrize("world_size", range(1, 10), ids=lambda n: f"world{n}")
def test_ring_schedule_sums_every_chunk_everywhere(world_size):
    """Simulate the ring with sets of contributors instead of numbers."""
    n = world_size
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk] = ranks summed into it
    schedules = [ring_schedule(r, n) for r in range(n)]
    for r, schedule in enumerate(schedules):
        assert len(schedule) == 2 * (n - 1), f"ring_schedule({r}, {n}) has {len(schedule)} steps, not 2(n-1)"
        phases = [step[0] for step in schedule]
        assert phases == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1), _phase_names_message(r, phases, n)
    for step in range(2 * (n - 1)):
        messages = [(schedules[r][step], set(held[r][schedules[r][step][1]])) for r in range(n)]
        for r in range(n):
            (phase, sent, _), payload = messages[(r - 1) % n]  # from the left neighbour
            recv = schedules[r][step][2]
            assert sent == recv, (f"step {step}: rank {r} receives chunk {recv} from its left neighbour, rank "
                                  f"{(r - 1) % n}, which sends it chunk {sent}")  # and so of another size
            held[r][recv] = held[r][recv] | payload if phase == "reduce-scatter" else payload
        if step == n - 2:  # end of reduce-scatter: each rank owns one chunk, summed over every rank
            for r in range(n):
                full = [c for c in range(n) if held[r][c] == set(range(n))]
                assert full, (f"after the {n - 1} reduce-scatter steps rank {r} holds no chunk summed over every "
                              f"rank; its chunks hold the sums of {[sorted(c) for c in held[r]]}")
    for r in range(n):
        partial = [c for c in range(n) if held[r][c] != set(range(n))]
        assert not partial, (f"after all {2 * (n - 1)} steps rank {r}'s chunks {partial} hold the sums of "
                             f"{[sorted(held[r][c]) for c in partial]} only, not of all {n} ranks")
