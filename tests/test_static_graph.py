"""static_graph=True: reentrant checkpointing works, the used set is learned once, a changed graph is named.

The oracle is torch's DDP with ``static_graph=True`` on the same model, side by side in one process group.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import miniddp
from miniddp.engine.static_graph import StaticGraphChangedError
from miniddp.launching.spawn import run_on_ranks
from miniddp.teaching.exercise.swap import current


# --8<-- [start:model]
class ReentrantTwice(nn.Module):
    """One layer checkpointed twice with use_reentrant=True: its hook fires twice per backward, and the graph
    walk of find_unused_parameters cannot see it. ``never`` gets no gradient on any rank, ``rank_zero_only``
    only on rank 0."""

    def __init__(self):
        super().__init__()
        self.a, self.shared, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.never, self.rank_zero_only = nn.Linear(8, 4), nn.Linear(8, 4)
        self.uses_extra, self.uses_never, self.segments = False, False, 2  # what a test changes to alter the graph

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for _ in range(self.segments):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        out = self.c(h)
        if self.uses_extra:
            out = out + self.rank_zero_only(h)
        if self.uses_never:
            out = out + self.never(h)
        return out
# --8<-- [end:model]


def _train(rank, wrap, steps=5, change=None):
    """Gradients of ``steps`` SGD steps on this rank's own batches; ``change(model, step)`` may alter the graph."""
    torch.manual_seed(0)
    model = ReentrantTwice()
    model.uses_extra = rank == 0
    ddp = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        if change is not None:
            change(model, step)
        torch.manual_seed(10 * rank + step)
        F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, getattr(ddp, "bucket_assignment", None)


def _error(fn):
    try:
        fn()
    except Exception as err:  # the type and our fields are what the test reads
        return type(err), getattr(err, "names", None), getattr(err, "ranks", None), str(err)
    return None


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def _use_never_on_rank_1(model, step):
    if step == 2 and not model.uses_extra:  # rank 1
        model.uses_never = True


def _one_segment_on_rank_0(model, step):
    if step == 2 and model.uses_extra:  # rank 0: the shared layer's hook fires once, not twice
        model.segments = 1


def _session(rank, world_size):
    """Every check in one two-rank session (process start-up is the cost here)."""
    small = {"bucket_cap_mb": 0.001}  # several buckets, so their order and launch matter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's static_graph logging notes
        theirs, _ = _train(rank, lambda m: TorchDDP(m, static_graph=True, **small))
    ours, buckets = _train(rank, lambda m: miniddp.DistributedDataParallel(m, static_graph=True, **small))
    first_buckets = miniddp.DistributedDataParallel(ReentrantTwice(), **small).bucket_assignment
    return {
        "theirs": theirs, "ours": ours, "rebuilt": buckets != first_buckets,
        "without": _error(lambda: _train(rank, lambda m: miniddp.DistributedDataParallel(m, **small), steps=1)),
        "walk": _error(lambda: _train(rank, lambda m: miniddp.DistributedDataParallel(
            m, find_unused_parameters=True, **small), steps=1)),
        "new_param": _error(lambda: _train(rank, lambda m: miniddp.DistributedDataParallel(
            m, static_graph=True, **small), change=_use_never_on_rank_1)),
        "fewer_calls": _error(lambda: _train(rank, lambda m: miniddp.DistributedDataParallel(
            m, static_graph=True, **small), change=_one_segment_on_rank_0)),
        "join": _error(lambda: miniddp.DistributedDataParallel(ReentrantTwice(), static_graph=True).join()),
        "both_flags": _warnings(lambda: miniddp.DistributedDataParallel(
            ReentrantTwice(), static_graph=True, find_unused_parameters=True)),
    }


_SESSIONS: dict[str, list] = {}  # one two-rank session per implementation (miniddp exercise checks several)


@pytest.fixture
def session():
    key = current()
    if key not in _SESSIONS:
        _SESSIONS[key] = run_on_ranks(_session, 2, timeout=120)
    return _SESSIONS[key]


def test_reentrant_checkpointing_with_static_graph_equals_torch(session):
    for rank in (0, 1):
        theirs, ours = session[rank]["theirs"], session[rank]["ours"]
        for step, (t, o) in enumerate(zip(theirs, ours)):
            for name in t:
                if t[name] is None:  # `never`: no rank had it, .grad stays None (torch: the same)
                    assert o[name] is None, f"rank {rank}, step {step}: {name}.grad must stay None, as in torch"
                else:
                    torch.testing.assert_close(o[name], t[name], rtol=0, atol=1e-7, msg=lambda m, r=rank, s=step,
                                               n=name: f"rank {r}, step {s}: {n}.grad differs from torch's: {m}")
    for name, a in session[0]["ours"][-1].items():
        b = session[1]["ours"][-1][name]
        assert a is None or torch.equal(a, b), f"last step: {name}.grad differs between rank 0 and rank 1"


def test_buckets_are_rebuilt_from_the_second_backward(session):
    for rank in (0, 1):
        assert session[rank]["rebuilt"], f"rank {rank}: the buckets after 5 steps are still the wrap's"


def test_without_static_graph_the_second_hook_call_is_an_error(session):
    # the negative control: the same model needs static_graph; without it the shared layer's second
    # gradient would arrive after its bucket was sent
    for rank in (0, 1):
        kind, _, _, message = session[rank]["without"]
        assert kind is RuntimeError and "shared." in message and "use_reentrant=False" in message
        kind, _, _, message = session[rank]["walk"]
        assert kind is RuntimeError and "graph walk" in message


def test_a_parameter_used_after_the_first_iteration_is_named_on_every_rank(session):
    for rank in (0, 1):
        _changed_error(rank, session[rank]["new_param"], [1], {"never.weight", "never.bias"},
                       "rank 1 starts using `never` at step 2")


def _changed_error(rank, error, ranks, names, what):
    assert error is not None, f"rank {rank}: nothing was raised when {what}"
    kind, got_names, got_ranks, message = error
    assert kind is StaticGraphChangedError, f"rank {rank}: {kind.__name__} raised when {what}: {message}"
    assert got_ranks == ranks, f"rank {rank}: the error's .ranks is {got_ranks}, not {ranks}, when {what}"
    assert set(got_names) == names, f"rank {rank}: the error's .names is {got_names}, not {sorted(names)}, when {what}"


def test_fewer_hook_calls_than_in_the_first_iteration_are_named_on_every_rank(session):
    for rank in (0, 1):
        _changed_error(rank, session[rank]["fewer_calls"], [0], {"shared.weight", "shared.bias"},
                       "rank 0 checkpoints `shared` once instead of twice at step 2")


def test_join_is_refused_and_the_redundant_flag_is_warned(session):
    for rank in (0, 1):
        assert session[rank]["join"][0] is NotImplementedError
        assert any("find_unused_parameters=True adds nothing" in m for m in session[rank]["both_flags"])
