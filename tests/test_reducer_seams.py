"""The reducer's two seams: readiness (strict, find-unused, static graph) and a bucket's collective.

The core has no policy branch; each policy is an object chosen when DDP is built. A new collective plugs in as a
class, through ``Reducer.set_collective``: here a ZeRO-2-like one, a reduce-scatter per bucket keeping only this
rank's shard of the mean, checked against torch's DDP; and a collective that divides on the way out instead of in,
checked against the default. Each collective names itself in labels and stall messages. Two checks read the source
with ``ast``: no module of the engine's core asks a policy or a collective for its class, and nothing outside the
engine assigns a reducer's attribute (each with a snippet that breaks the rule and is found).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import miniddp
from miniddp.engine import reducer as reducer_module
from miniddp.engine import waiting
from miniddp.engine.bucket_collective import AllReduceMean, BucketCollective
from miniddp.engine.ddp_join import JoinAware
from miniddp.engine.readiness import FindUnused, Readiness, Strict
from miniddp.engine.static_graph import StaticGraph
from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group import fingerprint

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
    ours.reducer.set_collective(kept)
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
        ddp.reducer.set_collective(DivideOnTheWayOut(world_size))
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
        assert ddp.reducer.registered_hook == (None, miniddp.comm_hooks.allreduce_hook)
    return kinds


def test_each_policy_is_an_object_chosen_at_construction():
    kinds = run_on_ranks(_policies, 2, timeout=60)[0]
    assert kinds == {"{}": Strict.__name__, "{'find_unused_parameters': True}": FindUnused.__name__,
                     "{'static_graph': True}": StaticGraph.__name__}


def _labels(rank, world_size):
    """Per collective: its name, the number of buckets, the label each bucket was issued under, what was waited."""
    torch.set_num_threads(1)
    seen, wait = {}, waiting.wait
    for kind in ("default", "hook", "zero"):
        ddp = miniddp.DistributedDataParallel(_model(), bucket_cap_mb=0.0002)  # several buckets
        if kind == "hook":
            ddp.register_comm_hook(None, miniddp.comm_hooks.allreduce_hook)
        if kind == "zero":
            miniddp.ZeroOptimizer(ddp, torch.optim.SGD, stage=2, lr=0.1)
        collective, issued, waited = ddp.reducer.collective, [], []
        issue = collective.issue

        def labelled(bucket, flat, is_last, group, issue=issue, issued=issued):
            issued.append(fingerprint.call_site()[0])  # the innermost issued_as label, as a desync report shows it
            return issue(bucket, flat, is_last, group)

        def recorded(future, what, group, waited=waited):
            waited.append(what)  # what a StalledRankError would name
            return wait(future, what, group)

        collective.issue, waiting.wait = labelled, recorded
        try:
            ddp(_batch(rank)).square().sum().backward()
        finally:
            waiting.wait = wait
        seen[kind] = (collective.name, len(ddp.reducer.buckets), issued, waited)
    return seen


def test_each_collective_names_itself_in_labels_and_stall_messages():
    seen = run_on_ranks(_labels, 2, timeout=90)
    assert seen[0] == seen[1]
    # the same reducer code, three names: the label comes from the collective (ZeRO's is not an "all-reduce")
    assert {kind: got[0] for kind, got in seen[0].items()} == {
        "default": "all-reduce", "hook": "comm hook", "zero": "reduce-scatter"}
    for name, buckets, issued, waited in seen[0].values():
        assert buckets >= 2
        assert issued == [f"bucket {b} {name}" for b in range(buckets)]
        assert waited == [f"{name} of bucket {b} in backward #1" for b in range(buckets)] + [
            "used-counts all-reduce in backward #1"]


# The policies' and collectives' own modules, where a class may look at its own kind; every other module of the
# engine is its core and asks a policy or a collective only through their interfaces.
OWN_MODULES = {"readiness.py", "static_graph.py", "bucket_collective.py", "ddp_join.py"}


def _seam_classes() -> set[str]:
    """The names of every readiness policy and bucket collective class loaded (ZeRO's too), and join's protocol."""
    found, todo = set(), [Readiness, BucketCollective]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found | {JoinAware.__name__}


def _type_tests(source: str, classes: set[str]) -> list[str]:
    """Every ``isinstance``/``issubclass`` call, and every ``type(x) is / == C`` comparison, naming one of
    ``classes`` (by name, attribute or string)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "isinstance", "issubclass") and len(node.args) == 2:
            checked = node.args[1]
        elif isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type"
                for side in (node.left, *node.comparators) for n in ast.walk(side)):
            checked = node
        else:
            continue
        names = {n.id for n in ast.walk(checked) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(checked) if isinstance(n, ast.Attribute)}
        names |= {n.value for n in ast.walk(checked) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if names & classes:
            found.append(ast.unparse(node))
    return found


def test_no_module_of_the_engines_core_asks_a_policy_or_a_collective_for_its_class():
    import miniddp.zero.gradient_shards  # noqa: F401  ZeRO's collectives: subclasses the rule must know
    classes = _seam_classes()
    assert {"StaticGraph", "FindUnused", "AllReduceMean", "CommHook", "ReduceScatterMean", "PartlyHeld"} <= classes
    core = sorted(p for p in (ROOT / "miniddp" / "engine").glob("*.py") if p.name not in OWN_MODULES)
    assert "reducer.py" in {p.name for p in core} and len(core) >= 10
    found = {p.name: _type_tests(p.read_text(encoding="utf-8"), classes) for p in core}
    assert {name: tests for name, tests in found.items() if tests} == {}


@pytest.mark.parametrize("branch", ["if isinstance(self.readiness, StaticGraph):\n            pass",
                                    "x = type(state.collective) is AllReduceMean",
                                    "y = isinstance(self.collective, (CommHook, ReduceScatterMean))",
                                    "z = type(self.readiness).__name__ == 'FindUnused'"])
def test_negative_a_type_test_of_a_policy_or_a_collective_is_found(branch):
    source = inspect.getsource(reducer_module)
    anchor = "        self.backwards += 1\n        try:"
    assert source.count(anchor) == 1
    assert _type_tests(source, _seam_classes()) == []
    assert _type_tests(source.replace(anchor, f"        {branch}\n{anchor}"), _seam_classes()) != []


REDUCER_NAMES = {"reducer", "_reducer"}


def _reducer_assignments(source: str) -> list[str]:
    """Every assignment (``=``, ``+=``, annotated, ``setattr``) of an attribute of something named ``reducer`` or
    ``_reducer`` (``reducer.x``, ``ddp.reducer.x``, ``self._reducer.x``; each element of a tuple target)."""
    def named_reducer(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in REDUCER_NAMES) or (
            isinstance(node, ast.Attribute) and node.attr in REDUCER_NAMES)

    def flat(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            return [t for element in target.elts for t in flat(element)]
        return flat(target.value) if isinstance(target, ast.Starred) else [target]

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in flat(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found += [ast.unparse(node)] if node.args and named_reducer(node.args[0]) else []
            continue
        else:
            continue
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and named_reducer(t.value)]
    return found


def test_nothing_outside_the_engine_assigns_a_reducers_attribute():
    engine = ROOT / "miniddp" / "engine"
    outside = [p for p in (ROOT / "miniddp").rglob("*.py") if engine not in p.parents]
    assert len(outside) > 50 and "reduce_scatter_optimizer.py" in {p.name for p in outside}
    found = {str(p.relative_to(ROOT)): _reducer_assignments(p.read_text(encoding="utf-8")) for p in outside}
    assert {path: assigned for path, assigned in found.items() if assigned} == {}


@pytest.mark.parametrize("snippet", ["reducer.rebuilt, reducer.rebuild_due = True, False",
                                     "self.ddp.reducer.collective = collective",
                                     "ddp._reducer.backwards += 1",
                                     "reducer.collective: object = collective",
                                     "setattr(ddp.reducer, 'rebuilt', True)"])
def test_negative_an_assignment_to_a_reducers_attribute_is_found(snippet):
    assert _reducer_assignments(f"def attach(self, ddp, reducer, collective):\n    {snippet}\n") != []
    assert _reducer_assignments("def attach(ddp, reducer):\n    ddp.reducer.set_collective(None)\n"
                                "    x = reducer.collective\n    ddp.reducer = reducer\n") == []
