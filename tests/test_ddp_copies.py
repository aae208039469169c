"""Copies of a wrapper, wrappers of a wrapper, parameters changed after wrap: who averages the gradients?

Each way a second object can come to own a parameter's gradient hooks, run side by side with torch's DDP in
one two-rank gloo session (``_session``, cached for the whole test run). The oracle of every step is the
explicit mean over ranks of the local gradients (a hook-free deep copy of the module, ``dist.all_reduce``);
``test_the_oracle_tells_averaged_from_local`` is its negative control. Each case is either correct (its
gradients equal the mean and torch's) or refused in one line, naming the parameter and the field.
"""

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks

IMPLS = {"torch": TorchDDP, "ours": miniddp.DistributedDataParallel}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _step(call, module, seed: int) -> dict:
    """One backward through ``call``, judged against the mean over ranks of ``module``'s local gradients."""
    rank, dtype = dist.get_rank(), next(module.parameters()).dtype
    gen = torch.Generator().manual_seed(100 * seed + rank)  # each rank its own batch
    x, y = torch.randn(6, 8, generator=gen, dtype=dtype), torch.randn(6, 4, generator=gen, dtype=dtype)
    ref = copy.deepcopy(module)  # a parameter's deep copy carries no hook (a fact below checks it)
    ref.zero_grad(set_to_none=True)
    F.mse_loss(ref(x), y).backward()
    local = [p.grad.clone() for p in ref.parameters()]
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    module.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            F.mse_loss(call(x), y).backward()
        except Exception as err:  # noqa: BLE001 - the fact is what was raised
            return {"outcome": type(err).__name__, "message": str(err), "grads": None}
    grads = [p.grad for p in module.parameters()]
    close = lambda a, b: all(u is not None and torch.allclose(u, v, atol=1e-6) for u, v in zip(a, b))  # noqa: E731
    outcome = "averaged" if close(grads, mean) else "local" if close(grads, local) else "other"
    return {"outcome": outcome, "grads": [g.clone() for g in grads], "differs": not close(local, mean),
            "unaveraged_warnings": sum("NOT averaged" in str(w.message) for w in caught)}


def _train(ddp, steps=3, seed=10) -> dict:
    """A few SGD steps through ``ddp``: the last step's verdict, and whether the replicas stayed equal."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        last = _step(ddp, ddp.module, seed + s)
        if last["outcome"] != "averaged":
            return last
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return {**last, "replicas_equal": all(torch.equal(every[0], f) for f in every)}


def _copies(impl: str, how: str, options: dict) -> dict:
    ddp = IMPLS[impl](_net(), **options)
    _step(ddp, ddp.module, 0)  # the original has run before it is copied (buckets rebuilt, static graph learned)
    if how == "deepcopy":
        twin = copy.deepcopy(ddp)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(ddp))
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(ddp, buf)
        twin = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    else:
        twin = copy.copy(ddp)
    return {"copy": _train(twin), "original": _step(ddp, ddp.module, 20), "copy_again": _step(twin, twin.module, 21),
            "same_module": twin.module is ddp.module}


def _wrapped_twice(impls) -> dict:
    model = _net()
    first, second = IMPLS[impls[0]](model), IMPLS[impls[1]](model)
    return {"second": _step(second, model, 1), "first": _step(first, model, 2), "second_again": _step(second, model, 3)}


def _nested(outer: str, inner: str) -> dict:
    model, calls = _net(), []

    def counting(state, bucket):  # torch's contract; counts the all-reduces each wrapper issues
        calls.append(state)
        return allreduce_hook(None, bucket)
    try:
        inside = IMPLS[inner](model)
        inside.register_comm_hook("inner", counting)
        ddp = IMPLS[outer](inside)
        ddp.register_comm_hook("outer", counting)
    except TypeError as err:
        return {"outcome": "TypeError", "message": str(err)}
    return {**_step(ddp, model, 1), "all_reduces": sorted(set(calls))}


def _deleted(impl: str) -> dict:
    model = _net()
    ddp = IMPLS[impl](model)
    _step(ddp, model, 0)
    del ddp
    gc.collect()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    bare = _step(model, model, 1)  # the bare module, its wrapper gone: local gradients, not a word
    return {"hooks_left": hooks, "bare_module": bare, "rewrapped": _step(IMPLS[impl](model), model, 2)}


def _changed(impl: str, change, options=None) -> dict:
    model = _net()
    ddp = IMPLS[impl](model, **(options or {}))
    _step(ddp, model, 0)
    try:
        change(ddp, model)
        return {"after": _step(ddp, model, 1)}
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def _replace(ddp, model):
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())


def _overwrite_float(ddp, model):
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    ddp.float()  # new Parameter objects, same dtype


CHANGES = {
    "double": lambda ddp, model: ddp.double(),
    "overwrite_float": _overwrite_float,
    "load_state_dict": lambda ddp, model: ddp.load_state_dict(ddp.state_dict()),
    "assign": lambda ddp, model: model.load_state_dict(model.state_dict(), assign=True),
    "apply": lambda ddp, model: (torch.manual_seed(1), model.apply(
        lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)),
    "replace": _replace,
    "added": lambda ddp, model: model.add_module("extra", nn.Linear(4, 4)),
}


def _groups(rank) -> dict:
    pair = dist.new_group([0, 1])  # a group of its own, not the default one
    ddp = miniddp.DistributedDataParallel(_net(), process_group=pair)
    twin = copy.deepcopy(ddp)
    try:
        pickle.dumps(ddp)
        refused = None
    except TypeError as err:
        refused = str(err)
    world = miniddp.DistributedDataParallel(_net())
    world.register_comm_hook(None, fp16_compress_hook)
    theirs = TorchDDP(_net())
    theirs.register_comm_hook(None, fp16_compress_hook)
    facts = {"deepcopy_keeps_group": twin.process_group is pair, "copy_trains": _train(twin)["outcome"],
             "pickle_refused": refused, "unpickled_group_is_default": pickle.loads(pickle.dumps(world))._process_group}
    for name, ddp in (("ours", world), ("torch", theirs)):  # does the copy keep the comm hook?
        twin = copy.deepcopy(ddp)
        facts[f"{name}_hook"] = {"original": _step(ddp, ddp.module, 5), "copy": _step(twin, twin.module, 5)}
    facts["blob"] = pickle.dumps(world) if rank == 0 else None  # loaded in the test process, without a group
    return facts


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or what it raised: one scenario that fails locally on every rank does not end the session."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - recorded as the scenario's fact
        return {"crashed": f"{type(err).__name__}: {err}"}


def _session(rank, world_size) -> dict:
    bare = _net()
    facts = {"control": _step(bare, bare, 0)}  # a bare module: nothing averages
    ddp = miniddp.DistributedDataParallel(_net())
    hooks = lambda module: [len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()]  # noqa: E731
    twin = copy.deepcopy(ddp)  # kept alive: its hooks go with it
    facts["hooks"] = {"module_deepcopy": hooks(copy.deepcopy(ddp.module)), "ddp_deepcopy": hooks(twin.module),
                      "original": hooks(ddp.module)}  # the oracle's deep copies carry none
    for impl in IMPLS:
        for how in ("deepcopy", "pickle", "torch.save", "copy.copy"):
            facts[(impl, how)] = _guarded(_copies, impl, how, {})
        for options in ({"find_unused_parameters": True}, {"static_graph": True}, {"gradient_as_bucket_view": True}):
            facts[(impl, "deepcopy", *options)] = _guarded(_copies, impl, "deepcopy", options)
        facts[(impl, "twice")] = _guarded(_wrapped_twice, (impl, impl))
        facts[(impl, "deleted")] = _guarded(_deleted, impl)
        for name, change in CHANGES.items():
            facts[(impl, name)] = _guarded(_changed, impl, change)
        facts[(impl, "replace", "find_unused_parameters")] = _guarded(
            _changed, impl, _replace, {"find_unused_parameters": True})
        for inner in IMPLS:
            facts[(impl, "nested", inner)] = _guarded(_nested, impl, inner)
    facts["mixed"] = {order: _guarded(_wrapped_twice, order) for order in (("torch", "ours"), ("ours", "torch"))}
    facts["groups"] = _guarded(_groups, rank)
    return facts


def _run(rank: dict, *key) -> dict:
    run = rank[key if len(key) > 1 else key[0]]
    assert "crashed" not in run, (key, run)
    return run


@pytest.fixture(scope="module")
def facts(once):
    return once("ddp_copies", lambda: run_on_ranks(_session, 2, timeout=180))


def test_the_oracle_tells_averaged_from_local(facts):
    for rank in facts:  # a bare module's gradients are judged local, not averaged: the ranks' batches differ
        assert rank["control"]["outcome"] == "local" and rank["control"]["differs"]


def test_a_deep_copy_hooks_its_own_parameters(facts):
    for rank in facts:  # one hook per parameter on the original and on the copy; none on the oracle's copies
        assert rank["hooks"] == {"module_deepcopy": [0] * 6, "ddp_deepcopy": [1] * 6, "original": [1] * 6}


def _same(a: dict, b: dict) -> bool:
    return all(torch.allclose(u, v, atol=1e-6) for u, v in zip(a["grads"], b["grads"]))


COPIES = [("deepcopy",), ("pickle",), ("torch.save",), ("copy.copy",), ("deepcopy", "find_unused_parameters"),
          ("deepcopy", "static_graph"), ("deepcopy", "gradient_as_bucket_view")]
TORCH_COPY_LOCAL = {("deepcopy", "static_graph")}  # torch 2.13: a copy made after the first iteration never averages


@pytest.mark.parametrize("key", COPIES, ids=" ".join)
def test_a_copy_and_its_original_both_average_like_torch(facts, key):
    for rank in facts:
        ours, theirs = _run(rank, "ours", *key), _run(rank, "torch", *key)
        for run in (ours, theirs) if key not in TORCH_COPY_LOCAL else (ours,):
            assert run["copy"]["outcome"] == "averaged", run["copy"]
            assert run["copy"]["replicas_equal"]
            assert run["original"]["outcome"] == run["copy_again"]["outcome"] == "averaged"
            assert run["same_module"] == (key == ("copy.copy",))  # copy.copy: an alias of the same module
        if key in TORCH_COPY_LOCAL:
            assert theirs["copy"]["outcome"] == theirs["copy_again"]["outcome"] == "local"
            continue
        for step in ("copy", "original", "copy_again"):
            assert _same(ours[step], theirs[step]), (key, step)


def test_wrapping_one_module_twice(facts):
    for rank in facts:
        theirs = _run(rank, "torch", "twice")  # each reducer acts only when its own forward armed it
        assert [r["outcome"] for r in theirs.values()] == ["averaged"] * 3
        ours = _run(rank, "ours", "twice")
        assert ours["first"]["outcome"] == "WrappedAgainError"  # the older wrapper refuses, not averaging nothing
        assert ours["second"]["outcome"] == ours["second_again"]["outcome"] == "averaged"
        for order, run in rank["mixed"].items():  # torch's and ours on one module: the armed one averages, once
            assert "crashed" not in run and [r["outcome"] for r in run.values()] == ["averaged"] * 3, (order, run)


def test_a_wrapper_of_a_wrapper_is_refused_at_wrap(facts):
    for rank in facts:
        for inner in IMPLS:
            ours = _run(rank, "ours", "nested", inner)
            assert ours["outcome"] == "TypeError" and "ddp.module" in ours["message"], ours
            theirs = _run(rank, "torch", "nested", inner)  # torch: both reducers average, two all-reduces per bucket
            assert theirs["outcome"] == "averaged" and theirs["all_reduces"] == ["inner", "outer"], theirs


def test_a_deleted_wrapper_leaves_no_hook_behind(facts):
    for rank in facts:
        for impl in IMPLS:
            run = _run(rank, impl, "deleted")
            assert run["hooks_left"] == 0
            assert run["bare_module"]["outcome"] == "local" and run["bare_module"]["unaveraged_warnings"] == 0
            assert run["rewrapped"]["outcome"] == "averaged"


REFUSED = {"double": "0.weight.dtype", "overwrite_float": "0.weight is another Parameter",
           "assign": "0.weight is another Parameter", "replace": "0.weight is another Parameter",
           ("replace", "find_unused_parameters"): "0.weight is another Parameter", "added": "extra.weight"}


@pytest.mark.parametrize("change", list(REFUSED), ids=lambda c: " ".join(c) if isinstance(c, tuple) else c)
def test_a_parameter_replaced_or_converted_after_wrap_is_refused_where_torch_stays_silent(facts, change):
    key = change if isinstance(change, tuple) else (change,)
    for rank in facts:
        assert _run(rank, "torch", *key)["after"]["outcome"] in ("local", "other")  # torch: not averaged, no error
        ours = _run(rank, "ours", *key)["after"]
        assert ours["outcome"] == "RuntimeError" and REFUSED[change] in ours["message"], ours


@pytest.mark.parametrize("change", ["load_state_dict", "apply"])
def test_in_place_changes_keep_averaging_like_torch(facts, change):
    for rank in facts:
        ours, theirs = _run(rank, "ours", change)["after"], _run(rank, "torch", change)["after"]
        assert ours["outcome"] == theirs["outcome"] == "averaged" and _same(ours, theirs)


def test_process_groups_and_comm_hooks_of_copies(facts):
    for rank in facts:
        groups = _run(rank, "groups")
        assert groups["deepcopy_keeps_group"] and groups["copy_trains"] == "averaged"
        assert "process_group" in groups["pickle_refused"]
        assert groups["unpickled_group_is_default"] is None  # None: the default group, looked up at each use
        ours, theirs = groups["ours_hook"], groups["torch_hook"]
        assert ours["original"]["outcome"] == "other" and _same(ours["copy"], ours["original"])  # fp16, both
        assert theirs["original"]["outcome"] == "other" and theirs["copy"]["outcome"] == "averaged"  # torch drops it


def test_loading_a_wrapper_without_a_process_group_is_refused_in_one_line(facts):
    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match="init_distributed"):
        pickle.loads(facts[0]["groups"]["blob"])
