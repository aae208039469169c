"""torch's DDP surface: the constructor's whole signature and what frameworks call on a DDP and its reducer.

The oracle is torch's DistributedDataParallel, side by side in one process group: built with the same positional
arguments, driven through the same framework code paths (Accelerate's ``trigger_sync_in_backward``, Lightning's
manual optimisation, ``_set_static_graph()``), the gradients, attributes and logging fields must agree. What
miniddp does not build is refused in one line naming the parameter or the attribute.
"""

import contextlib
import copy
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from test_static_graph import ReentrantTwice
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.engine.torch_arguments import RefusedArgument
from miniddp.engine.torch_surface import UnimplementedTorchAttribute, torch_ddp_names, torch_reducer_names
from miniddp.launching.spawn import run_on_ranks
from miniddp.teaching.exercise.swap import current

from models import MODELS

ORDER = [p for p in inspect.signature(TorchDDP.__init__).parameters if p not in ("self", "module")]


def _positional(**given) -> tuple:
    """torch's defaults in torch's positional order, with ``given`` in place: the arguments after ``module``."""
    defaults = inspect.signature(TorchDDP.__init__).parameters
    return tuple(given.pop(name) if name in given else defaults[name].default for name in ORDER)


# name: (model, torch's constructor arguments by name: both wrappers get them positionally, in torch's order)
CASES = {
    "views_and_small_buckets": ("mlp", {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True}),
    "find_unused": ("branchy", {"find_unused_parameters": True, "bucket_cap_mb": 0.001}),
    "static_graph": ("mlp", {"static_graph": True, "bucket_cap_mb": 0.001}),
    "bucket_cap_mb_list": ("mixed_dtypes", {"bucket_cap_mb_list": [0.0001, 0.001]}),
    "no_init_sync": ("mlp", {"init_sync": False}),
    "deprecated_broadcast_buffers_false": ("batchnorm", {"broadcast_buffers": False}),
    "forward_sync_buffers_false": ("batchnorm", {"forward_sync_buffers": False}),
    "both_buffer_flags": ("batchnorm", {"broadcast_buffers": False, "forward_sync_buffers": True}),
    "accepted_no_ops": ("mlp", {"dim": 1, "check_reduction": True, "batched_grad_copy": True}),
    "device_mesh": ("mlp", {"device_mesh": "MESH"}),
}
ATTRIBUTES = ("broadcast_buffers", "forward_sync_buffers", "find_unused_parameters", "static_graph",
              "gradient_as_bucket_view", "dim", "device_ids", "output_device", "require_backward_grad_sync",
              "require_forward_param_sync", "batched_grad_copy", "mixed_precision", "skip_all_reduce_unused_params")
# logging fields both know the same way (bucket_sizes: torch's first buckets ignore bucket_cap_mb unless it finds
# unused parameters or has a per-bucket list; miniddp's always follow it)
LOGGED = ("module_name", "world_size", "rank", "backend_name", "device_ids", "output_device", "broadcast_buffers",
          "bucket_cap_bytes", "find_unused_parameters", "gradient_as_bucket_view", "has_sync_bn",
          "is_multi_device_module", "num_parameter_tensors", "total_parameter_size_bytes", "dtypes",
          "has_rebuilt_buckets", "rebuilt_bucket_sizes", "static_graph", "master_addr", "master_port",
          "cuda_visible_devices", "torch_distributed_debug")


@contextlib.contextmanager
def _quiet():
    """torch 2.13's FutureWarnings (broadcast_buffers, check_reduction) and its static-graph notes, silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _spread(tensors) -> float:
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return max((e - everyone[0]).abs().max().item() for e in everyone)


def _side_by_side(rank, model_name, given, steps=4):
    """Both wrappers built from the same positional arguments; worst gradient and parameter differences, the
    spread of our parameters across ranks, and our attributes and logging fields beside torch's."""
    torch.manual_seed(1000 + rank)  # a different model on every rank: only the wrap makes them equal
    mine = MODELS[model_name]()
    for b in mine.buffers():
        if b.is_floating_point():
            b.add_(rank)  # different buffers too: whether the wrap copies them shows
    theirs = copy.deepcopy(mine)
    given = dict(given)
    if given.get("device_mesh") == "MESH":
        given["device_mesh"] = dist.init_device_mesh("cpu", (dist.get_world_size(),))
    args = _positional(**given)
    ours, ref = miniddp.DistributedDataParallel(mine, *args), TorchDDP(theirs, *args)
    buffer_spread_at_wrap = _spread(mine.buffers()) if list(mine.buffers()) else 0.0
    at_wrap = max((a.double() - b.double()).abs().max().item()
                  for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    worst_grad = worst_param = 0.0
    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        if model_name == "branchy":
            mine.use_branch = theirs.use_branch = not (rank == 0 and step % 2 == 0)  # unused on some ranks
        for model, opt in zip((ours, ref), optimizers):
            F.mse_loss(model(x), y).backward()
        for p, q in zip(mine.parameters(), theirs.parameters()):
            worst_grad = max(worst_grad, 0.0 if p.grad is None and q.grad is None else
                             (p.grad.double() - q.grad.double()).abs().max().item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    worst_param = max((a.double() - b.double()).abs().max().item()
                      for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
    logged_ours, logged_theirs = ours._get_ddp_logging_data(), ref._get_ddp_logging_data()
    return {"grad": worst_grad, "param": worst_param, "at_wrap": at_wrap, "spread": _spread(mine.parameters()),
            "buffer_spread_at_wrap": buffer_spread_at_wrap,
            "attributes": {a: (getattr(ours, a), getattr(ref, a)) for a in ATTRIBUTES},
            "logged": {k: (logged_ours.get(k), logged_theirs.get(k))
                       for k in (*LOGGED, "bucket_sizes", "can_set_static_graph")},
            "extra_keys": sorted(set(logged_ours) - set(logged_theirs))}


def _capture(fn):
    try:
        return {"value": fn()}
    except Exception as err:  # the type and its fields are what the tests read
        return {"type": type(err), "parameter": getattr(err, "parameter", None), "name": getattr(err, "name", None),
                "message": str(err), "bases": type(err).__mro__}


# --8<-- [start:accelerate]
def _accelerate_trigger_sync(wrap, rank, trigger=True):
    """Two forwards under no_sync, the first backward local, the second synced by Accelerate's
    ``trigger_sync_in_backward`` (accelerate/accelerator.py): both flags True, ``reducer.prepare_for_backward([])``."""
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ddp = wrap(model)
    torch.manual_seed(rank)
    with ddp.no_sync():
        loss_a = F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4))
        loss_b = F.mse_loss(ddp(torch.randn(4, 8)), torch.ones(4, 4))
    loss_a.backward()
    old = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
    if trigger:
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
    try:
        loss_b.backward()
    finally:
        ddp.require_backward_grad_sync, ddp.require_forward_param_sync = old
    return [p.grad.clone() for p in model.parameters()]
# --8<-- [end:accelerate]


class ManualStep(nn.Module):
    """Lightning's manual optimisation inside the wrapper's forward (``_DDPForwardRedirection``): the loss, then
    ``prepare_for_backward(ddp, loss)`` (lightning/pytorch/overrides/distributed.py), the backward, after a first
    static-graph backward ``reducer._delay_all_reduce()`` (its ``DDPStrategy.post_backward``), and at the end of
    the inner forward ``require_backward_grad_sync = False`` (given back True after the outer forward)."""

    def __init__(self):
        super().__init__()
        self.net = MODELS["branchy"]()
        self.wrapper = []  # the DDP, in a list: as an attribute it would become a submodule
        self.delay_done = False

    def forward(self, x, y):
        from lightning.pytorch.overrides.distributed import prepare_for_backward

        ddp = self.wrapper[0]
        loss = F.mse_loss(self.net(x), y)
        prepare_for_backward(ddp, loss)
        loss.backward()
        if ddp.static_graph and not self.delay_done:
            ddp.reducer._delay_all_reduce()
            self.delay_done = True
        ddp.require_backward_grad_sync = False
        return loss.detach()


def _lightning_manual(wrap, rank, vary, steps=3):
    torch.manual_seed(0)
    step_module = ManualStep()
    ddp = wrap(step_module)
    step_module.wrapper.append(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        torch.manual_seed(10 * step + rank)
        step_module.net.use_branch = not (vary and rank == 1 and step == 1)  # unused on one rank, once
        ddp(torch.randn(4, 8), torch.randn(4, 4))
        ddp.require_backward_grad_sync = True
        grads.append([p.grad.clone() for p in step_module.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return grads


def _set_static_graph(wrap, rank, steps=4):
    torch.manual_seed(0)
    model = ReentrantTwice()
    model.uses_extra = rank == 0
    ddp = wrap(model)
    ddp._set_static_graph()
    grads = []
    for step in range(steps):
        torch.manual_seed(10 * rank + step)
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    return grads, ddp._get_ddp_logging_data().get("static_graph")


def _set_static_graph_too_late(wrap):
    ddp = wrap(MODELS["mlp"]())
    ddp(torch.randn(2, 8)).sum().backward()
    ddp._set_static_graph()


def _refusals(rank):
    model = MODELS["mlp"]()
    p = model.fc1.weight
    mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),))
    refused = {
        "delay_all_reduce_named_params": dict(delay_all_reduce_named_params=[("fc1.weight", p)],
                                              param_to_hook_all_reduce=model.fc3.weight),
        "param_to_hook_all_reduce": dict(param_to_hook_all_reduce=model.fc3.weight),
        "mixed_precision": dict(mixed_precision=torch.nn.parallel.distributed._MixedPrecision(torch.float16)),
        "skip_all_reduce_unused_params": dict(skip_all_reduce_unused_params=True),
        "output_device": dict(output_device=1),
        "device_mesh": dict(device_mesh=mesh, process_group=dist.group.WORLD),
        "bucket_cap_mb_list": dict(bucket_cap_mb="auto", bucket_cap_mb_list=[1, 2]),
    }
    accepted = {"output_device": dict(output_device="cpu"), "dim": dict(dim=3), "device_ids": dict(device_ids=[]),
                "check_reduction": dict(check_reduction=True), "batched_grad_copy": dict(batched_grad_copy=True)}
    with _quiet():
        return ({name: _capture(lambda kw=kw: miniddp.DistributedDataParallel(MODELS["mlp"](), **kw))
                 for name, kw in refused.items()},
                {name: _capture(lambda kw=kw: type(miniddp.DistributedDataParallel(MODELS["mlp"](), **kw)).__name__)
                 for name, kw in accepted.items()})


def _attributes(rank):
    model = MODELS["mlp"]()
    ddp = miniddp.DistributedDataParallel(model)
    theirs = TorchDDP(MODELS["mlp"]())
    framework_reads = {name: _capture(lambda n=name: [getattr(ddp, n)] and True) for name in (
        "module", "reducer", "require_backward_grad_sync", "require_forward_param_sync", "find_unused_parameters",
        "static_graph", "no_sync", "register_comm_hook", "join", "_get_ddp_logging_data", "_set_static_graph")}
    reducer_reads = {name: _capture(lambda n=name: [getattr(ddp.reducer, n)] and True) for name in (
        "prepare_for_backward", "_rebuild_buckets", "_delay_all_reduce")}
    return {
        "ddp_missing": _capture(lambda: ddp.logger), "hasattr_missing": hasattr(ddp, "_check_reducer_finalized"),
        "reducer_missing": _capture(lambda: ddp.reducer._get_local_used_map()),
        "not_torchs": _capture(lambda: ddp.no_such_attribute), "reducer_not_torchs": _capture(lambda: ddp.reducer.xyz),
        "framework_reads": framework_reads, "reducer_reads": reducer_reads,
        "torch_instance_names": sorted(set(vars(theirs)) - set(vars(nn.Module())) - torch_ddp_names()),
        "torch_reducer_names": sorted({n for n in dir(theirs.reducer) if not n.startswith("__")}
                                      - torch_reducer_names()),
        "nothing_due": ddp.reducer._rebuild_buckets(),
        "rebuild_calls": {who: _rebuild_by_hand(wrap) for who, wrap in (
            ("ours", miniddp.DistributedDataParallel), ("torch", TorchDDP))},
    }


def _rebuild_by_hand(wrap):
    """After the first backward, ``reducer._rebuild_buckets()`` rebuilds once (True), then finds nothing (False)."""
    ddp = wrap(MODELS["mlp"](), bucket_cap_mb=0.001)
    ddp(torch.randn(2, 8)).sum().backward()
    return ddp.reducer._rebuild_buckets(), ddp.reducer._rebuild_buckets()


def _session(rank, world_size):
    """Every check in one two-rank session (process start-up is the cost here)."""
    torch.set_num_threads(1)
    torch_wrap = lambda m, **kw: TorchDDP(m, **kw)  # noqa: E731
    ours_wrap = lambda m, **kw: miniddp.DistributedDataParallel(m, **kw)  # noqa: E731
    with _quiet():
        out = {"cases": {name: _capture(lambda m=m, g=g: _side_by_side(rank, m, g)) for name, (m, g) in CASES.items()}}
        out["trigger"] = {who: _accelerate_trigger_sync(wrap, rank) for who, wrap in (("ours", ours_wrap),
                                                                                       ("torch", torch_wrap))}
        out["trigger"]["spread"] = _spread(out["trigger"]["ours"])
        out["untriggered_spread"] = _spread(_accelerate_trigger_sync(ours_wrap, rank, trigger=False))
        out["trigger_find_unused"] = {who: _capture(lambda w=wrap: _accelerate_trigger_sync(
            lambda m: w(m, find_unused_parameters=True), rank)) for who, wrap in (("ours", ours_wrap),
                                                                                   ("torch", torch_wrap))}
        out["lightning"] = {
            (who, option): _capture(lambda w=wrap, o=option: _lightning_manual(
                lambda m: w(m, **{o: True}), rank, vary=o == "find_unused_parameters"))
            for who, wrap in (("ours", ours_wrap), ("torch", torch_wrap))
            for option in ("find_unused_parameters", "static_graph")}
        out["static"] = {who: _set_static_graph(lambda m, w=wrap: w(m, bucket_cap_mb=0.001), rank)
                         for who, wrap in (("ours", ours_wrap), ("torch", torch_wrap))}
        out["static_late"] = {who: _capture(lambda w=wrap: _set_static_graph_too_late(w))
                              for who, wrap in (("ours", ours_wrap), ("torch", torch_wrap))}
    out["refusals"], out["accepted"] = _refusals(rank)
    out["attributes"] = _attributes(rank)
    return out


_SESSIONS: dict[str, list] = {}


@pytest.fixture
def session():
    pytest.importorskip("lightning")
    key = current()
    if key not in _SESSIONS:
        _SESSIONS[key] = run_on_ranks(_session, 2, timeout=240)
    return _SESSIONS[key]


def test_the_constructor_is_torchs_signature_plus_tracer():
    ours = list(inspect.signature(miniddp.DistributedDataParallel.__init__).parameters.values())
    theirs = list(inspect.signature(TorchDDP.__init__).parameters.values())
    assert len(theirs) >= 20, "torch's signature was not read"  # a vacuous comparison would pass on nothing
    assert [(p.name, p.kind, p.default) for p in ours[:-1]] == [(p.name, p.kind, p.default) for p in theirs]
    assert (ours[-1].name, ours[-1].kind, ours[-1].default) == ("tracer", inspect.Parameter.KEYWORD_ONLY, None)


@pytest.mark.parametrize("case", list(CASES))
def test_positional_construction_trains_as_torch(session, case):
    for rank, result in enumerate(session):
        r = result["cases"][case]
        assert "value" in r, f"{case}, rank {rank}: {r.get('type')}: {r.get('message')}"
        r = r["value"]
        assert r["grad"] < 1e-6 and r["param"] < 1e-6, f"{case}, rank {rank}: differs from torch's DDP: {r}"
        assert r["at_wrap"] == 0.0, f"{case}, rank {rank}: after the wrap, state differs from torch's"
        for name, (mine, theirs) in r["attributes"].items():
            assert mine == theirs, f"{case}, rank {rank}: ddp.{name} is {mine!r}, torch's {theirs!r}"
        # the wrap copied rank 0's parameters, unless init_sync=False (the negative control: they stay apart)
        assert (r["spread"] > 0) == (case == "no_init_sync"), f"{case}, rank {rank}: spread {r['spread']}"


def test_buffers_follow_torch_2_13s_two_flags(session):
    # BatchNorm's running stats start different on each rank: the deprecated broadcast_buffers=False leaves them
    # apart at wrap; forward_sync_buffers copies them at wrap whatever its value, and wins over broadcast_buffers
    # (what happens in each forward is compared with torch's in test_positional_construction_trains_as_torch)
    spreads = {case: session[0]["cases"][case]["value"]["buffer_spread_at_wrap"]
               for case in ("deprecated_broadcast_buffers_false", "forward_sync_buffers_false", "both_buffer_flags")}
    assert spreads["deprecated_broadcast_buffers_false"] > 0
    assert spreads["forward_sync_buffers_false"] == spreads["both_buffer_flags"] == 0.0


def test_logging_data_has_torchs_fields(session):
    for case in CASES:
        for rank, result in enumerate(session):
            r = result["cases"][case]["value"]
            assert r["extra_keys"] == [], f"{case}, rank {rank}: keys torch's logging data lacks: {r['extra_keys']}"
            for key in LOGGED + (("bucket_sizes",) if case in ("find_unused", "bucket_cap_mb_list") else ()):
                mine, theirs = r["logged"][key]
                assert mine == theirs, f"{case}, rank {rank}: logging {key!r} is {mine!r}, torch's {theirs!r}"
            # Lightning's teardown suggests static_graph=True when .get("can_set_static_graph") is true: torch
            # writes it only once it finds the graph not static (0), miniddp never does: no suggestion from either
            mine, theirs = r["logged"]["can_set_static_graph"]
            assert mine is None and not theirs
    assert session[0]["cases"]["static_graph"]["value"]["logged"]["static_graph"] == (1, 1)
    assert session[0]["cases"]["bucket_cap_mb_list"]["value"]["logged"]["bucket_cap_bytes"][0] == int(0.001 * 2**20)


def test_accelerates_trigger_sync_in_backward_averages_inside_no_sync(session):
    for rank, result in enumerate(session):
        for mine, theirs in zip(result["trigger"]["ours"], result["trigger"]["torch"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        assert result["trigger"]["spread"] == 0.0, f"rank {rank}: the triggered backward did not average"
        assert result["untriggered_spread"] > 0, "negative control: without the trigger the backward stays local"
        # with find_unused_parameters=True, prepare_for_backward([]) marks everything unused: both raise
        for who in ("ours", "torch"):
            assert issubclass(result["trigger_find_unused"][who].get("type"), RuntimeError), (who, rank)


def test_lightning_manual_optimisation_trains_as_torch(session):
    for rank, result in enumerate(session):
        for option in ("find_unused_parameters", "static_graph"):
            mine, theirs = result["lightning"][("ours", option)], result["lightning"][("torch", option)]
            assert "value" in mine, f"{option}, rank {rank}: {mine.get('type')}: {mine.get('message')}"
            assert "value" in theirs, f"{option}, rank {rank}: torch: {theirs.get('message')}"
            for step, (a, b) in enumerate(zip(mine["value"], theirs["value"])):
                assert len(a) == len(b), f"{option}, rank {rank}, step {step}: other parameters got gradients"
                for x, y in zip(a, b):
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    last = [result["lightning"][("ours", "find_unused_parameters")]["value"][-1] for result in session]
    assert all(torch.equal(a, b) for a, b in zip(*last)), "the ranks' gradients were not averaged"


def test_set_static_graph_before_the_first_forward_equals_torchs(session):
    for rank, result in enumerate(session):
        (mine, mine_logged), (theirs, theirs_logged) = result["static"]["ours"], result["static"]["torch"]
        assert mine_logged == theirs_logged == 1
        for step, (a, b) in enumerate(zip(mine, theirs)):
            for x, y in zip(a, b):
                assert (x is None) == (y is None), f"rank {rank}, step {step}"
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-7)
        for who in ("ours", "torch"):  # after a forward: too late, in both, in torch's words (its own test's)
            late = result["static_late"][who]
            assert issubclass(late["type"], RuntimeError), (who, rank)
            assert "should be called before training loop starts" in late["message"], (who, late["message"])


_REFUSED = ["delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
            "skip_all_reduce_unused_params", "output_device", "device_mesh", "bucket_cap_mb_list"]


@pytest.mark.parametrize("parameter", _REFUSED)
def test_a_value_miniddp_cannot_honour_is_refused_in_one_line(session, parameter):
    r = session[0]["refusals"][parameter]
    assert r.get("type") is RefusedArgument, r
    assert ValueError in r["bases"] and NotImplementedError in r["bases"]
    assert r["parameter"] == parameter and parameter in r["message"] and "\n" not in r["message"]


def test_what_miniddp_honours_is_not_refused(session):
    # the negative control: the same parameters with values miniddp honours
    for name, r in session[0]["accepted"].items():
        assert r == {"value": "DistributedDataParallel"}, f"{name}: {r}"


def test_an_unimplemented_torch_attribute_is_named_in_one_line(session):
    a = session[0]["attributes"]
    for key, name in (("ddp_missing", "logger"), ("reducer_missing", "_get_local_used_map")):
        r = a[key]
        assert r.get("type") is UnimplementedTorchAttribute and AttributeError in r["bases"], r
        assert r["name"] == name and name in r["message"] and "\n" not in r["message"]
    assert a["hasattr_missing"] is False  # an AttributeError: hasattr and getattr(..., default) still answer
    # a name torch does not have either: the plain AttributeError
    for key in ("not_torchs", "reducer_not_torchs"):
        assert a[key]["type"] is AttributeError, a[key]
    # what the frameworks read exists (the negative control)
    for name, r in {**a["framework_reads"], **a["reducer_reads"]}.items():
        assert "value" in r, f"{name}: {r}"
    assert a["nothing_due"] is False  # nothing to rebuild before a backward
    assert a["rebuild_calls"]["ours"] == a["rebuild_calls"]["torch"] == (True, False)
    # every attribute of a real torch DDP and its reducer is one miniddp knows torch has
    assert a["torch_instance_names"] == [] and a["torch_reducer_names"] == []


def _torchs_join_on_each(rank, world_size):
    from torch.distributed.algorithms.join import Join as TorchJoin

    torch.set_num_threads(1)
    seen = {}
    for name, cls in (("torch", TorchDDP), ("ours", miniddp.DistributedDataParallel)):
        ddp = cls(nn.Linear(3, 2))
        try:
            with TorchJoin([ddp]):
                ddp(torch.randn(2, 3)).sum().backward()
            seen[name] = "trained"
        except TypeError as err:
            seen[name] = ("TypeError", "\n" in str(err), hasattr(ddp, "_join_config"))
        with ddp.join() if name == "ours" else TorchJoin([ddp]):  # each one's own Join still trains
            ddp(torch.randn(2, 3)).sum().backward()
    return seen


def test_torchs_join_is_refused_at_once_rather_than_left_to_hang():
    # torch's Join relies on the joinable's forward to notify it; miniddp's forward notifies miniddp's Join
    # (Accelerate's join_uneven_inputs is torch's Join): refused when torch's Join is built, one line
    seen = run_on_ranks(_torchs_join_on_each, 1, timeout=60)[0]
    assert seen == {"torch": "trained", "ours": ("TypeError", False, False)}
