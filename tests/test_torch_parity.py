"""Where miniddp's DDP met torch's own tests and differed: each now does what torch's does, checked side by side.

The oracle is torch's DistributedDataParallel in the same two-rank process group (and, where torch's DDP cannot run
the case, one process on the whole batch): parameters and buffers torch is told to ignore
(``_set_params_and_buffers_to_ignore_for_model``), ``loss.backward(create_graph=True)`` (torch's
``test_ddp_create_graph``) with a gradient penalty through ``.grad``, a module with nothing to train, the checks
``register_comm_hook`` makes and torch's built-in hooks, and the drop-in reading torch's attribute names from
torch's class. Where torch's tests match an error's words (test_c10d_gloo.py, test_c10d_common.py), miniddp's
message starts with them; the test checks torch's own message holds the same words, so they are torch's.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp import comm_hooks
from miniddp.comm_hooks import GradBucket
from miniddp.comm_hooks.powersgd import PowerSGDState
from miniddp.engine import torch_surface
from miniddp.launching.spawn import run_on_ranks
from miniddp.teaching.exercise.swap import current

from models import MODELS

IGNORED = ["fc2.weight", "fc2.local"]  # a parameter and a buffer each rank keeps for itself
# torch's words, as its tests match them (test_c10d_gloo.py, test_c10d_common.py, distributed_test.py)
WORDS = {
    "not callable": (TypeError, "Communication hook must be callable."),
    "bucket annotation": (ValueError, "Communication hook: bucket annotation should be dist.GradBucket."),
    "return annotation": (ValueError, "Communication hook: return annotation should be torch.futures.Future"),
    "twice": (RuntimeError, "register_comm_hook or register_builtin_comm_hook can only be called once."),
    "builtin twice": (RuntimeError, "register_builtin_comm_hook or register_comm_hook can only be called once."),
    "no future": (RuntimeError, "callback must return a torch.futures.Future object, but got"),
    "nothing to train": (RuntimeError, "DistributedDataParallel is not needed when a module doesn't have any "
                                       "parameter that requires a gradient."),
    "powerSGD state": (ValueError, "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                                   "enabled, because PowerSGD can only be applied after the first two iterations "
                                   "in DDP."),
}


class LocalHead(nn.Module):
    """fc1 is shared; fc2 and the buffer ``fc2.local`` are each rank's own (ignored: of another shape on each rank,
    as in torch's ``test_ddp_ignore_params_arg``); ``stats`` is a buffer DDP still broadcasts."""

    def __init__(self, rank):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2, bias=False)
        self.fc2.register_buffer("local", torch.full((5 + rank,), float(rank)))
        self.register_buffer("stats", torch.full((3,), float(rank)))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)) + self.stats)


def _capture(fn):
    try:
        return {"value": fn()}
    except Exception as err:  # noqa: BLE001 - the type and the words are what the tests read
        return {"type": type(err), "message": str(err)}


def _gathered(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# --8<-- [start:ignore]
def _ignored_side_by_side(rank, steps=3):
    torch.manual_seed(1000 + rank)  # a different model on every rank: only the wrap makes the shared part equal
    mine = LocalHead(rank)
    theirs = copy.deepcopy(mine)
    miniddp.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(mine, IGNORED)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(theirs, IGNORED)
    marked = [getattr(t, "_ddp_ignored", False) for t in [*mine.parameters(), *mine.buffers()]]
    data_parallel = ([tuple(p.shape) for p in miniddp.DistributedDataParallel._get_data_parallel_params(mine)]
                     == [tuple(p.shape) for p in TorchDDP._get_data_parallel_params(theirs)])
    ours, ref = miniddp.DistributedDataParallel(mine, bucket_cap_mb=1e-5), TorchDDP(theirs)
    at_wrap = {name: t.detach().clone() for name, t in mine.state_dict().items()}
    grads, buffers, materialised = [], [], False
    for step in range(steps):
        if step == steps - 1:  # torch's use: a proxy replaced by its real layer after wrapping, still local
            torch.manual_seed(7 + rank)
            mine.fc2 = nn.Linear(3, 2, bias=False)
            theirs.fc2 = copy.deepcopy(mine.fc2)
            materialised = True
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        for model, wrapper in ((mine, ours), (theirs, ref)):
            with torch.no_grad():
                model.stats.fill_(10 * step + rank)  # broadcast before each forward: rank 0's
                if not materialised:
                    model.fc2.local.fill_(10 * step + rank)  # ignored: stays this rank's
            F.mse_loss(wrapper(x), y).backward()
        buffers.append([(b.clone(), c.clone()) for b, c in zip(mine.buffers(), theirs.buffers())])
        grads.append([(n, p.grad.clone(), q.grad.clone())
                      for (n, p), q in zip(mine.named_parameters(), theirs.parameters())])
        for model in (mine, theirs):
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    return {"at_wrap": _gathered(at_wrap), "grads": grads, "materialised": materialised,
            "buckets": sorted(n for bucket in ours.bucket_assignment for n in bucket),
            "reduced": len(ours.reducer.params), "flags": ours.parameters_to_ignore == ref.parameters_to_ignore,
            "marked": marked, "data_parallel": data_parallel, "buffers": buffers}
# --8<-- [end:ignore]


# --8<-- [start:create_graph]
def _create_graph(wrap, rank, make, penalty, steps):
    """``loss.backward(create_graph=True)``, then (``penalty``) a gradient penalty backpropagated through ``.grad``;
    SGD steps. Each step: (.grad after the first backward, does it require grad, .grad after the penalty)."""
    torch.manual_seed(0)
    model = make()
    ddp = wrap(model)
    seen = []
    for step in range(steps):
        torch.manual_seed(10 * step + rank)
        F.mse_loss(ddp(torch.randn(5, model.d_in)), torch.randn(5, 1)).backward(create_graph=True)
        first = [(p.grad.detach().clone(), p.grad.requires_grad) for p in model.parameters()]
        if penalty:
            sum(p.grad.pow(2).sum() for p in model.parameters()).backward()  # local in both: not averaged
        seen.append((first, [p.grad.detach().clone() for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None  # breaks the reference cycle create_graph makes (torch's warning)
    return seen, [p.detach().clone() for p in model.parameters()]


class OneWeight(nn.Module):
    """One parameter tensor: torch's DDP runs create_graph=True for two steps here (a second parameter, or a
    third step with a penalty, and it raises inside its reducer)."""

    d_in = 3

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1, bias=False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Deeper(nn.Module):
    d_in = 4

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _whole_batch(world_size, steps):
    """The oracle for ``Deeper``: one process, every rank's batch, a plain backward."""
    torch.manual_seed(0)
    model = Deeper()
    for step in range(steps):
        batches = []
        for r in range(world_size):
            torch.manual_seed(10 * step + r)
            batches.append((torch.randn(5, 4), torch.randn(5, 1)))
        F.mse_loss(model(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches])).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return [p.detach().clone() for p in model.parameters()]
# --8<-- [end:create_graph]


def _hook_checks(wrap):
    """What ``register_comm_hook`` refuses (or takes), on a fresh wrapper each."""
    def fresh():
        return wrap(nn.Linear(2, 2))

    def done(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def bad_bucket(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def bad_return(state, bucket: dist.GradBucket) -> int:
        return 1

    def not_a_future(state, bucket: dist.GradBucket):
        return 1

    def ours_bucket(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        return done(state, bucket)

    def twice(builtin):
        ddp = fresh()
        register = (lambda: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)) if builtin else \
            (lambda: ddp.register_comm_hook(None, done))
        register()
        register()

    def logged_refusal():  # torch's tests read a refusal back from the logging data (verify_ddp_error_logged)
        ddp = fresh()
        _capture(lambda: ddp.register_comm_hook(None, bad_bucket))
        data = ddp._get_ddp_logging_data()
        return {k: data.get(k) for k in ("iteration", "has_error", "error")}

    def trained_with(hook):
        ddp = fresh()
        ddp.register_comm_hook(None, hook)
        ddp(torch.randn(3, 2)).sum().backward()
        return True

    return {
        "not callable": _capture(lambda: fresh().register_comm_hook(None, 1)),
        "bucket annotation": _capture(lambda: fresh().register_comm_hook(None, bad_bucket)),
        "return annotation": _capture(lambda: fresh().register_comm_hook(None, bad_return)),
        "twice": _capture(lambda: twice(False)),
        "builtin twice": _capture(lambda: twice(True)),
        "no future": _capture(lambda: trained_with(not_a_future)),
        "torch's annotations": _capture(lambda: trained_with(done)),
        "miniddp's GradBucket": _capture(lambda: trained_with(ours_bucket)),
        "miniddp's hooks": _capture(lambda: [fresh().register_comm_hook(None, h) for h in (
            comm_hooks.allreduce_hook, comm_hooks.fp16_compress_hook)] and True),
        "nothing to train": _capture(lambda: wrap(nn.Module())),
        "logged": _capture(logged_refusal),
    }


def _builtin_hooks(wrap, rank, kind, steps=2):
    torch.manual_seed(1000 + rank)
    model = MODELS["mlp"]()
    ddp = wrap(model)
    ddp._register_builtin_comm_hook(kind)
    grads = []
    for step in range(steps):
        torch.manual_seed(10 * step + rank)
        F.mse_loss(ddp(torch.randn(6, 8)), torch.randn(6, 4)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return grads


def _under_the_drop_in():
    """miniddp's DDP built under torch's name after ``install()``: torch's names read from torch's class."""
    from miniddp import drop_in

    torch_surface.torch_ddp_names.cache_clear()  # read afresh under install(), as a process that installs first
    undo = drop_in.install()
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))  # miniddp's now
        return {"is_ours": isinstance(ddp, miniddp.DistributedDataParallel),
                "logger": _capture(lambda: ddp.logger), "names": len(torch_surface.torch_ddp_names())}
    finally:
        undo()
        torch_surface.torch_ddp_names.cache_clear()


def _session(rank, world_size):
    """Every check in one two-rank session (process start-up is the cost)."""
    torch.set_num_threads(1)
    # each part captured: one that raises (on every rank alike) fails its own tests, not the session
    out = {"ignored": _capture(lambda: _ignored_side_by_side(rank))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's create_graph notes; miniddp's "NOT averaged" for the penalty
        out["create_graph"] = _capture(lambda: {
            (who, penalty): _create_graph(wrap, rank, OneWeight, penalty, steps=2)
            for who, wrap in (("ours", miniddp.DistributedDataParallel), ("torch", TorchDDP))
            for penalty in (False, True)})
        out["deeper"] = _capture(lambda: _create_graph(miniddp.DistributedDataParallel, rank, Deeper, False, steps=3))
        out["oracle"] = _whole_batch(world_size, steps=3)
        out["hooks"] = {"ours": _hook_checks(miniddp.DistributedDataParallel), "torch": _hook_checks(TorchDDP)}
        out["builtin"] = _capture(lambda: {
            (who, kind.name): _builtin_hooks(wrap, rank, kind)
            for who, wrap in (("ours", miniddp.DistributedDataParallel), ("torch", TorchDDP))
            for kind in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS)})
    out["powerSGD state"] = {who: _capture(lambda cls=cls: cls(None, start_powerSGD_iter=1))
                             for who, cls in (("ours", PowerSGDState), ("torch", torch_powersgd.PowerSGDState))}
    out["drop_in"] = _capture(_under_the_drop_in)
    return out


def _value(result: dict, part: str):
    """A captured part's value, or the failure with what it raised."""
    r = result[part]
    assert "value" in r, f"{part}: {r.get('type')}: {r.get('message')}"
    return r["value"]


_SESSIONS: dict[str, list] = {}


@pytest.fixture
def session():
    key = current()
    if key not in _SESSIONS:
        _SESSIONS[key] = run_on_ranks(_session, 2, timeout=240)
    return _SESSIONS[key]


def test_ignored_parameters_and_buffers_stay_local_as_in_torch(session):
    for rank, result in enumerate(session):
        r = _value(result, "ignored")
        wraps = r["at_wrap"]  # every rank's state right after the wrap
        for name in ("fc1.weight", "fc1.bias", "stats"):  # shared: rank 0's everywhere
            assert all(torch.equal(w[name], wraps[0][name]) for w in wraps), name
        assert not torch.equal(wraps[0]["fc2.weight"], wraps[1]["fc2.weight"]), "an ignored parameter was broadcast"
        assert [w["fc2.local"].numel() for w in wraps] == [5, 6], "an ignored buffer was broadcast (or checked)"
        for step, named in enumerate(r["grads"]):
            for name, mine, theirs in named:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=f"rank {rank}, step {step}, {name}")
        assert r["materialised"]
        for step, pairs in enumerate(r["buffers"]):  # after each forward: (stats, fc2.local), ours and torch's
            for mine, theirs in pairs:
                assert torch.equal(mine, theirs), (rank, step)
            assert torch.equal(pairs[0][0], torch.full((3,), 10.0 * step)), "stats is rank 0's"
            if len(pairs) == 2:  # fc2 not yet replaced: its buffer is this rank's own, as it was set
                assert torch.equal(pairs[1][0], torch.full((5 + rank,), 10.0 * step + rank)), (rank, step)
        assert r["buckets"] == ["fc1.bias", "fc1.weight"] and r["reduced"] == 2 and r["flags"]
        assert r["marked"] == [False, False, True, False, True] and r["data_parallel"]  # fc2.weight, fc2.local
    # the ignored parameter's gradient is each rank's own, the shared ones the mean (the negative control)
    first = [_value(result, "ignored")["grads"][0] for result in session]
    (name, a, _), (_, b, _) = first[0][2], first[1][2]
    assert name == "fc2.weight" and not torch.equal(a, b)
    assert torch.equal(first[0][0][1], first[1][0][1])


def test_create_graph_averages_the_values_and_keeps_this_ranks_graph_as_torch(session):
    for rank, result in enumerate(session):
        for penalty in (False, True):
            (mine, mine_end), (theirs, theirs_end) = (_value(result, "create_graph")[(who, penalty)]
                                                      for who in ("ours", "torch"))
            for step, ((first, after), (first_t, after_t)) in enumerate(zip(mine, theirs)):
                for (g, needs), (h, needs_t) in zip(first, first_t):
                    torch.testing.assert_close(g, h, rtol=0, atol=1e-6, msg=f"rank {rank}, step {step}")
                    assert needs and needs_t  # .grad keeps a graph: higher-order gradients can flow
                for g, h in zip(after, after_t):  # the penalty's gradient, through this rank's graph / N
                    torch.testing.assert_close(g, h, rtol=0, atol=1e-6, msg=f"rank {rank}, step {step}")
            for p, q in zip(mine_end, theirs_end):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    # the values are the mean (equal on both ranks); the penalty's part is local, in torch and here
    (first_0, after_0), (first_1, after_1) = (_value(result, "create_graph")[("ours", True)][0][0]
                                              for result in session)
    assert torch.equal(first_0[0][0], first_1[0][0])
    assert not torch.equal(after_0[0], after_1[0])


def test_create_graph_with_several_parameters_trains_as_one_process_on_the_whole_batch(session):
    # torch's DDP raises inside its reducer here ("a leaf Variable that requires grad is being used in an in-place
    # operation"): the oracle is one process on every rank's batch
    for rank, result in enumerate(session):
        _, weights = _value(result, "deeper")
        for p, q in zip(weights, result["oracle"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.parametrize("check", ["not callable", "bucket annotation", "return annotation", "twice",
                                   "builtin twice", "no future", "nothing to train"])
def test_refusals_have_torchs_types_and_start_with_torchs_words(session, check):
    kind, words = WORDS[check]
    for rank, result in enumerate(session):
        mine, theirs = result["hooks"]["ours"][check], result["hooks"]["torch"][check]
        assert theirs.get("type") is not None and issubclass(theirs["type"], kind), (rank, theirs)
        if check != "nothing to train":  # torch's test matches the type only: the words are its message
            assert words in theirs["message"], f"torch's message changed: {theirs['message']!r}"
        assert mine.get("type") is not None and issubclass(mine["type"], kind), (rank, mine)
        assert mine["message"].startswith(words), mine["message"]
        assert len(mine["message"]) > len(words), "miniddp adds its explanation after torch's words"


def test_what_torch_accepts_and_miniddps_own_hooks_are_accepted(session):
    for result in session:
        for who in ("ours", "torch"):
            assert result["hooks"][who]["torch's annotations"] == {"value": True}, who
        # miniddp's GradBucket has torch's methods; miniddp's hooks' annotations are strings (future annotations)
        assert result["hooks"]["ours"]["miniddp's GradBucket"] == {"value": True}
        assert result["hooks"]["ours"]["miniddp's hooks"] == {"value": True}


def test_builtin_comm_hooks_train_as_torchs(session):
    for rank, result in enumerate(session):
        for kind, atol in (("ALLREDUCE", 1e-6), ("FP16_COMPRESS", 2e-3)):
            builtin = _value(result, "builtin")
            for step, (mine, theirs) in enumerate(zip(builtin[("ours", kind)], builtin[("torch", kind)])):
                for g, h in zip(mine, theirs):
                    torch.testing.assert_close(g, h, rtol=0, atol=atol, msg=f"{kind}, rank {rank}, step {step}")


def test_powersgd_state_refuses_an_early_start_with_torchs_words(session):
    kind, words = WORDS["powerSGD state"]
    mine, theirs = session[0]["powerSGD state"]["ours"], session[0]["powerSGD state"]["torch"]
    assert theirs["type"] is kind and words in theirs["message"]
    assert mine["type"] is kind and mine["message"].startswith(words)


def test_under_the_drop_in_a_torch_only_attribute_is_named(session):
    r = _value(session[0], "drop_in")
    assert r["is_ours"]
    assert r["logger"].get("type") is torch_surface.UnimplementedTorchAttribute, r["logger"]
    assert r["names"] == len(torch_surface.torch_ddp_names()) > 100  # torch's names, not miniddp's own


def test_a_refusal_is_kept_in_the_logging_data_as_torch_keeps_it(session):
    words = WORDS["bucket annotation"][1]
    for result in session:
        for who in ("ours", "torch"):
            logged = _value(result["hooks"][who], "logged")
            assert logged["has_error"] == 1 and logged["iteration"] is not None, (who, logged)
            assert words in logged["error"], (who, logged)
