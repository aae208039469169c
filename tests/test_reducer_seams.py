"""The reducer's two seams: readiness (strict, find-unused, static graph) and a bucket's collective.

The core has no policy branch; each policy is an object chosen when DDP is built. A new collective plugs in as a
class: here a ZeRO-2-like one, a reduce-scatter per bucket keeping only this rank's shard of the mean, checked
against torch's DDP; and a collective that divides on the way out instead of in, checked against the default.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import miniddp
from miniddp.engine.bucket_collective import AllReduceMean, BucketCollective
from miniddp.engine.readiness import FindUnused, Strict
from miniddp.engine.static_graph import StaticGraph
from miniddp.launching.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + rank))


class KeepMyShard(BucketCollective):
    """ZeRO-2's shape: divided on the way in, reduce-scattered, each rank keeping only its slice of the mean
    (the bucket padded to a multiple of the world size); nothing is written into ``.grad``."""

    def __init__(self, world_size: int):
        self.divisor, self.world_size, self.shards = world_size, world_size, {}

    def issue(self, bucket, flat, is_last, group):
        padded = torch.zeros(-(-flat.numel() // self.world_size) * self.world_size, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        shard = torch.empty(padded.numel() // self.world_size, dtype=flat.dtype)
        dist.reduce_scatter_single(shard, padded, group=group)  # gloo's reduce-scatter Work has no future:
        done = torch.futures.Future()  # waited here, so this sketch does not overlap (ZeRO-2 proper must)
        done.set_result(shard)
        return done

    def result(self, bucket, value):
        return value

    def land(self, bucket, result, counts, as_view):
        self.shards[bucket.index] = result.clone()


class DivideOnTheWayOut(BucketCollective):
    """Undivided in, summed, divided when it lands: another order of the same arithmetic."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def issue(self, bucket, flat, is_last, group):
        return dist.all_reduce(flat, group=group, async_op=True).get_future()

    def land(self, bucket, result, counts, as_view):
        bucket.write_back(result / self.world_size, counts, as_view)


def _sharded_vs_torch(rank, world_size):
    torch.set_num_threads(1)
    ours = miniddp.DistributedDataParallel(_model(), bucket_cap_mb=0.0002)  # several buckets
    theirs = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.0002)
    kept = KeepMyShard(world_size)
    ours.reducer.collective = kept
    for ddp in (ours, theirs):
        ddp(_batch(rank)).square().sum().backward()
    mean = {p: p.grad for p in theirs.module.parameters()}
    by_identity = dict(zip(ours.module.parameters(), theirs.module.parameters()))
    checks = []
    for bucket in ours.reducer.buckets:
        full = torch.cat([mean[by_identity[p]].reshape(-1) for p in bucket.params])
        size = kept.shards[bucket.index].numel()
        want = torch.cat([full, full.new_zeros(size * world_size - full.numel())])[rank * size:(rank + 1) * size]
        checks.append(torch.allclose(kept.shards[bucket.index], want, atol=1e-6))
    # nothing landed in .grad: it holds this rank's own gradient (autograd's), not the mean
    untouched = not any(torch.allclose(p.grad, mean[by_identity[p]]) for p in ours.module.parameters())
    return len(ours.reducer.buckets), checks, untouched


def test_a_sharded_collective_is_a_new_class_and_keeps_each_ranks_slice_of_torchs_mean():
    for buckets, checks, untouched in run_on_ranks(_sharded_vs_torch, 2, timeout=60):
        assert buckets >= 2 and all(checks) and untouched, (buckets, checks)


def _order_of_arithmetic(rank, world_size, collective):
    torch.set_num_threads(1)
    ddp = miniddp.DistributedDataParallel(_model(), bucket_cap_mb=0.0002)
    if collective:
        ddp.reducer.collective = DivideOnTheWayOut(world_size)
    ddp(_batch(rank)).square().sum().backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def test_dividing_on_the_way_out_equals_the_default_and_the_seam_is_really_used():
    # 3 ranks: dividing by 3 rounds, so dividing before or after the sum differs in the last bits
    default = run_on_ranks(_order_of_arithmetic, 3, args=(False,), timeout=60)[0]
    out = run_on_ranks(_order_of_arithmetic, 3, args=(True,), timeout=60)[0]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(default, out))
    assert not all(torch.equal(a, b) for a, b in zip(default, out))  # rounded apart: the other path ran


def _policies(rank, world_size):
    kinds = {}
    for flags in [{}, {"find_unused_parameters": True}, {"static_graph": True}]:
        ddp = miniddp.DistributedDataParallel(_model(), **flags)
        kinds[str(flags)] = type(ddp.reducer.readiness).__name__
        assert isinstance(ddp.reducer.collective, AllReduceMean) and ddp.reducer.collective.divisor == world_size
        ddp.register_comm_hook(None, miniddp.comm_hooks.allreduce_hook)
        assert ddp.reducer.collective.registered() == (None, miniddp.comm_hooks.allreduce_hook)
    return kinds


def test_each_policy_is_an_object_chosen_at_construction():
    kinds = run_on_ranks(_policies, 2, timeout=60)[0]
    assert kinds == {"{}": Strict.__name__, "{'find_unused_parameters': True}": FindUnused.__name__,
                     "{'static_graph': True}": StaticGraph.__name__}


POLICY_NAMES = {"find_unused", "find_unused_parameters", "static", "static_graph", "hook", "shadow", "divisor"}


def _policy_tests(source: str) -> list[str]:
    """Every ``if`` (statement or expression) in the Reducer class whose test reads a policy's name."""
    tree = ast.parse(source)
    reducer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Reducer")
    found = []
    for node in ast.walk(reducer):
        if isinstance(node, (ast.If, ast.IfExp)):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            if names & POLICY_NAMES:
                found.append(ast.unparse(node.test))
    return found


def test_the_reducers_core_has_no_policy_branch():
    assert _policy_tests((ROOT / "miniddp" / "engine" / "reducer.py").read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("branch", ["if self.static is not None:\n            pass",
                                    "x = 1 if self.hook is None else 2"])
def test_negative_a_policy_branch_is_found(branch):
    source = (ROOT / "miniddp" / "engine" / "reducer.py").read_text(encoding="utf-8")
    anchor = "        self.backwards += 1\n        try:"
    assert source.count(anchor) == 1
    assert _policy_tests(source.replace(anchor, f"        {branch}\n{anchor}")) != []
