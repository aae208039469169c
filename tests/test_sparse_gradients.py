"""Sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``) against torch's DDP, side by side.

One 2-rank session trains a small recommender (a sparse ``Embedding``, a sparse ``EmbeddingBag`` and an MLP) under
miniddp's DDP and torch's, each rank on rows of its own, some shared, some only one rank touches: no hook, two comm
hooks, ``gradient_as_bucket_view``, ``static_graph``, ``join()`` with uneven inputs, with SGD, Adagrad and SparseAdam.
After every backward ``.grad`` is sparse and, densified, torch's; after training the weights are torch's.
``find_unused_parameters`` with an embedding unused on one rank (torch raises there) is checked against one process
on both ranks' batches. The negative control sums the sparse gradient without dividing by N, and must fail.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.engine.sparse_gradients import SparseBucket, each_sparse_alone
from miniddp.launching.spawn import run_on_ranks

STEPS = 3
TOL = 1e-6


class Recommender(nn.Module):
    """Users by id (Embedding), each user's items as a bag (EmbeddingBag), an MLP on top."""

    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(24, 4, sparse=True)
        self.items = nn.EmbeddingBag(30, 4, mode="mean", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, users, items, use_users: bool = True):
        u = self.users(users) if use_users else torch.zeros(users.shape[0], 4)
        return self.mlp(torch.cat([u, self.items(items)], 1)).squeeze(1)


def _batch(step: int, rank: int):
    """Users 0 and 1 on every rank, then rows only this rank touches; items drawn from all 30 (some shared)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    users = torch.cat([torch.tensor([0, 1]), torch.randint(2 + 10 * rank, 12 + 10 * rank, (3,), generator=g)])
    return users, torch.randint(0, 30, (5, 3), generator=g), torch.randn(5, generator=g)


def _loss(model, batch, use_users=True):
    users, items, y = batch
    return (model(users, items, use_users) - y).square().mean()


def _optimizers(model, kind):
    sparse = [model.users.weight, model.items.weight]
    dense = list(model.mlp.parameters())
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1)]
    return [torch.optim.SparseAdam(sparse, lr=0.05), torch.optim.SGD(dense, lr=0.1)]


def _sum_then_divide(state, bucket):
    """torch's test_c10d_gloo sparse hook: all-reduce the bucket (sparse or dense), divide by N in the future."""
    world = dist.get_world_size()
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0] / world)


def _recording(hook, seen):
    def record(state, bucket):
        buffer = bucket.buffer()
        seen.append((str(buffer.layout), len(bucket.gradients()), len(bucket.parameters())))
        return hook(state, bucket)
    return record


HOOKS = {"allreduce": (miniddp.comm_hooks.allreduce_hook, torch_hooks.allreduce_hook),
         "sum_then_divide": (_sum_then_divide, _sum_then_divide)}


# --8<-- [start:side_by_side]
def _side_by_side(rank, world, *, hook=None, optimizer="sgd", steps=STEPS, accumulate=False, **flags):
    """miniddp's DDP and torch's on the same model and batches; (worst .grad difference, worst weight difference,
    every .grad of a sparse parameter came back sparse, the hook buckets each saw)."""
    torch.manual_seed(0)
    mine = Recommender()
    theirs = copy.deepcopy(mine)
    ours = miniddp.DistributedDataParallel(mine, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = TorchDDP(theirs, **flags)
    seen = {"ours": [], "torch": []}
    if hook is not None:
        ours.register_comm_hook(None, _recording(HOOKS[hook][0], seen["ours"]))
        ref.register_comm_hook(None, _recording(HOOKS[hook][1], seen["torch"]))
    opts = {"ours": _optimizers(mine, optimizer), "torch": _optimizers(theirs, optimizer)}
    worst_grad, sparse_layout = 0.0, True
    for step in range(steps):
        for ddp in (ours, ref):
            if accumulate:  # a micro-batch kept local, then one synced: the mean of the sums
                with ddp.no_sync():
                    _loss(ddp, _batch(step + 50, rank)).backward()
            _loss(ddp, _batch(step, rank)).backward()
        for a, b in zip(mine.parameters(), theirs.parameters()):
            worst_grad = max(worst_grad, (a.grad.to_dense() - b.grad.to_dense()).abs().max().item())
        sparse_layout &= mine.users.weight.grad.is_sparse and mine.items.weight.grad.is_sparse
        for opt in opts["ours"] + opts["torch"]:
            opt.step()
            opt.zero_grad()
    worst_weight = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), theirs.parameters()))
    return worst_grad, worst_weight, sparse_layout, seen
# --8<-- [end:side_by_side]


def _join(rank, world):
    """Uneven inputs: rank 1 runs out a step early; both DDPs under their own join()."""
    torch.manual_seed(0)
    mine = Recommender()
    theirs = copy.deepcopy(mine)
    ours, ref = miniddp.DistributedDataParallel(mine), TorchDDP(theirs)
    for ddp, model in ((ours, mine), (ref, theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ddp.join():
            for step in range(STEPS - rank):
                _loss(ddp, _batch(step, rank)).backward()
                opt.step()
                opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(mine.parameters(), theirs.parameters()))


def _find_unused(rank, world):
    """``users`` unused on rank 1 (step 0, 1) and on every rank (step 2): torch raises; the oracle is one process
    summing both ranks' losses / N. Returns (worst .grad difference, worst weight difference, .grad of users at
    the end is None as the oracle's)."""
    use = [lambda r: r == 0, lambda r: r == 0, lambda r: False]
    torch.manual_seed(0)
    mine = Recommender()
    one = copy.deepcopy(mine)
    ours = miniddp.DistributedDataParallel(mine, find_unused_parameters=True)
    opt, opt_one = torch.optim.SGD(mine.parameters(), lr=0.1), torch.optim.SGD(one.parameters(), lr=0.1)
    worst_grad = 0.0
    for step in range(STEPS):
        opt.zero_grad()
        opt_one.zero_grad()
        _loss(ours, _batch(step, rank), use[step](rank)).backward()
        (sum(_loss(one, _batch(step, r), use[step](r)) for r in range(world)) / world).backward()
        for a, b in zip(mine.parameters(), one.parameters()):
            if a.grad is not None or b.grad is not None:
                worst_grad = max(worst_grad, (a.grad.to_dense() - b.grad.to_dense()).abs().max().item())
        none_alike = (mine.users.weight.grad is None) == (one.users.weight.grad is None)
        opt.step()
        opt_one.step()
    worst_weight = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), one.parameters()))
    return worst_grad, worst_weight, none_alike and mine.users.weight.grad is None


def _buckets(rank, world):
    """The buckets at wrap and after the rebuild: each sparse parameter alone, the same on every rank."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(Recommender())
    wrap = ddp.bucket_assignment
    for step in range(2):
        _loss(ddp, _batch(step, rank)).backward()
    return wrap, ddp.bucket_assignment, ddp.reducer.rebuilt


def _bytes(rank, world):
    """Bytes handed to all-reduces in one backward, and what they should be: the MLP's dense gradients, and of each
    sparse gradient its row indices (int64) and rows (one per lookup: an embedding's backward does not coalesce)."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(Recommender())
    with miniddp.comm_hooks.count_bytes() as sent:
        _loss(ddp, _batch(0, rank)).backward()
    users, items, _ = _batch(0, rank)
    lookups = users.numel() + items.numel()
    dense = sum(p.numel() * 4 for p in ddp.module.mlp.parameters())
    return sent.by_op["all_reduce"], dense + lookups * (8 + 4 * 4)


def _zero_refused(rank, world):
    ddp = miniddp.DistributedDataParallel(Recommender())
    try:
        miniddp.ZeroOptimizer(ddp, torch.optim.SGD, lr=0.1)
    except ValueError as err:
        return str(err)
    return None


class Unflagged(nn.Module):
    """A sparse gradient from a parameter no Embedding(sparse=True) owns: torch gives it a dense bucket too."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.table, sparse=True).sum()


def _unflagged(rank, world):
    ddp = miniddp.DistributedDataParallel(Unflagged())
    try:
        ddp(torch.tensor([1, 2])).backward()
    except RuntimeError as err:
        return str(err)
    return None


def _not_divided(rank, world):
    """The negative control: the sparse gradient summed over ranks but not divided by N."""
    put = SparseBucket.put
    SparseBucket.put = lambda self, k, grad, divisor=1: put(self, k, grad, 1)
    try:
        return _side_by_side(rank, world)
    finally:
        SparseBucket.put = put


def _session(rank, world):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    return {
        "plain": _side_by_side(rank, world),
        "hook allreduce": _side_by_side(rank, world, hook="allreduce"),
        "hook sum_then_divide": _side_by_side(rank, world, hook="sum_then_divide"),
        "gradient_as_bucket_view": _side_by_side(rank, world, gradient_as_bucket_view=True),
        "no_sync": _side_by_side(rank, world, accumulate=True),
        "static_graph": _side_by_side(rank, world, static_graph=True),
        "adagrad": _side_by_side(rank, world, optimizer="adagrad"),
        "sparse_adam": _side_by_side(rank, world, optimizer="sparse_adam"),
        "join": _join(rank, world),
        "find_unused": _find_unused(rank, world),
        "buckets": _buckets(rank, world),
        "bytes": _bytes(rank, world),
        "zero": _zero_refused(rank, world),
        "not divided": _not_divided(rank, world),
        "unflagged": _unflagged(rank, world),  # last: its backward stops half-way
    }


@pytest.fixture(scope="module")
def session(once):
    return once("sparse_gradients", lambda: run_on_ranks(_session, 2, timeout=240))


@pytest.mark.parametrize("case", ["plain", "hook allreduce", "hook sum_then_divide", "gradient_as_bucket_view",
                                  "no_sync", "static_graph", "adagrad", "sparse_adam"])
def test_sparse_embeddings_train_as_torchs_ddp(session, case):
    for result in session:
        worst_grad, worst_weight, sparse_layout, _ = result[case]
        assert worst_grad < TOL and worst_weight < TOL and sparse_layout, result[case]


def test_a_comm_hook_gets_the_sparse_gradient_as_torchs_does(session):
    for case in ("hook allreduce", "hook sum_then_divide"):
        seen = session[0][case][3]
        assert seen["ours"] and sorted(set(seen["ours"])) == sorted(set(seen["torch"])), seen
        assert ("torch.sparse_coo", 0, 1) in seen["ours"]  # buffer() sparse, no per-parameter views, one parameter


def test_uneven_inputs_under_join_train_as_torchs_ddp(session):
    assert all(result["join"] < TOL for result in session)


def test_an_embedding_unused_on_one_rank_gets_the_mean_of_the_others(session):
    for result in session:
        worst_grad, worst_weight, unused_everywhere_keeps_none = result["find_unused"]
        assert worst_grad < TOL and worst_weight < TOL and unused_everywhere_keeps_none, result["find_unused"]


def test_each_sparse_parameter_is_a_bucket_of_its_own_at_wrap_and_after_the_rebuild(session):
    wrap, rebuilt, did_rebuild = session[0]["buckets"]
    assert did_rebuild and session[1]["buckets"] == session[0]["buckets"]
    for buckets in (wrap, rebuilt):
        assert ["users.weight"] in buckets and ["items.weight"] in buckets
        assert sorted(n for b in buckets for n in b) == sorted(n for n, _ in Recommender().named_parameters())


def test_bytes_sent_are_the_rows_and_their_indices_not_the_whole_table(session):
    for result in session:
        sent, rows = result["bytes"]
        assert sent == rows


def test_zero_refuses_a_sparse_parameter_by_name(session):
    assert all(result["zero"] is not None and "users.weight" in result["zero"] for result in session)


def test_a_sparse_gradient_outside_a_sparse_embedding_is_named(session):
    assert all(result["unflagged"] is not None and "table" in result["unflagged"] for result in session)


def test_negative_the_sum_not_divided_by_n_differs_from_torch(session):
    for result in session:
        worst_grad, worst_weight, _, _ = result["not divided"]
        assert worst_grad > 1e-3 and worst_weight > 1e-3


@pytest.mark.parametrize("limits", [[100], [40, 100], [1 << 20]])
def test_the_assignment_equals_torchs_with_expect_sparse_gradient(limits):
    tensors = [torch.zeros(10), torch.zeros(100, 4), torch.zeros(10), torch.zeros(5, dtype=torch.float64),
               torch.zeros(30, 4), torch.zeros(10), torch.zeros(7, dtype=torch.float64)]
    for sparse in ([False, True, False, False, True, False, False], [True] * 7, [False] * 7,
                   [True, False, False, True, False, False, True]):
        want = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)[0]
        assert miniddp.compute_bucket_assignment(tensors, limits, sparse) == want
        assert each_sparse_alone(miniddp.compute_bucket_assignment, tensors, limits, sparse) == want
