"""ZeroOptimizer's all-gather left in flight after step() and waited for where each parameter is next read
(miniddp/zero/gather_prefetch.py), against DDP + the same plain optimizer.

The model has a tied weight (embedding and head), a parameter its parent reads before the child that holds it runs
(``body.weight``) and one read only by the parent (``proj``, whose own forward never runs): each must be waited for
where it is read. DDP and ZeRO agree to float32 rounding (1e-6, as in test_zero_stages.py), also when one rank
posts its exchanges late; the negative control: with the wait removed (the parameter handed out at once), that late
rank's pieces are read stale and the weights differ from DDP's. Ranks that record different orders are refused,
naming the rank; a parameter read through a reference held from before the step is named by the backward's check,
and trains exactly once the caller waits. One session per world size runs every check.
"""

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import miniddp
from miniddp.launching.spawn import run_on_ranks

STEPS, BATCH, TOL = 4, 4, 1e-6
CAP_MB = 0.0002  # a few buckets, so chunks cut across parameters


class Net(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)  # its forward never runs: the parent reads its parameters
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, tokens):
        h = self.emb(tokens)
        scale = 1 + self.body.weight.mean()  # read before body's own forward
        h = torch.tanh(self.body(h)) * scale
        return self.out(F.linear(h, self.proj.weight, self.proj.bias)).square().mean()


class Branches(Net):
    def forward(self, tokens):  # rank 1 reads proj before body: another order
        h = self.emb(tokens)
        if torch.distributed.get_rank() == 1:
            p = self.proj(h)
            return (self.body(h) + p).square().mean()
        b = self.body(h)
        return (b + self.proj(h)).square().mean()


class Kept(Net):
    def __init__(self, seed):
        super().__init__(seed)
        self.__dict__["kept"] = self.proj.weight  # a reference held outside _parameters

    def forward(self, tokens):
        h = self.emb(tokens)
        return F.linear(h, self.kept, self.proj.bias).square().mean() + self.body(h).mean()


def _batch(step, rank):
    return torch.randint(0, 10, (BATCH, 5), generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank, stage, cls=Net, late=0.0, no_wait=False, wait_first=False):
    """DDP + AdamW and DDP + ZeroOptimizer(AdamW) on the same batches; their state_dicts, and what was seen."""
    models = cls(rank), cls(rank)
    ddp, zddp = (miniddp.DistributedDataParallel(m, bucket_cap_mb=CAP_MB) for m in models)
    plain = torch.optim.AdamW(models[0].parameters(), lr=0.01)
    zero = miniddp.ZeroOptimizer(zddp, torch.optim.AdamW, stage=stage, lr=0.01)
    prefetch, seen = zero.prefetch, {"in_flight": []}
    if late and rank == 1:  # this rank posts its exchanges late: the other must wait for them
        post = prefetch.post
        prefetch.post = lambda *a: (time.sleep(late), post(*a))
    dropped = []  # the negative control: a parameter handed out without waiting for its exchange
    if no_wait:
        prefetch.reached = lambda param: dropped.append(prefetch.pending.pop(id(param), None))
    for step in range(STEPS):
        for model, opt in ((ddp, plain), (zddp, zero)):
            if wait_first and opt is zero:
                zero.wait_for_parameters()
            model(_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        seen["in_flight"].append(len(prefetch.pending))
    if wait_first:  # an eval forward is no exception for a kept reference: no backward would name it
        zero.wait_for_parameters()
    with torch.no_grad():  # an eval forward right after a step reads the gathered values
        seen["eval"] = (ddp(_batch(STEPS, rank)), zddp(_batch(STEPS, rank)))
    seen["order"] = [ddp.reducer.names[i] for i in prefetch.order]
    seen["states"] = (models[0].state_dict(), models[1].state_dict())  # as a checkpoint reads them
    for exchange in filter(None, dropped):  # landed before the next check's exchanges are posted
        exchange.wait()
    return seen


def _error(fn):
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    return None


def _session(rank, world):
    torch.set_num_threads(1)
    out = {"parity": {stage: _train(rank, stage) for stage in (1, 2)}}
    if world == 2:
        out["late"] = _train(rank, 2, late=0.15)
        out["late_no_wait"] = _train(rank, 2, late=0.15, no_wait=True)
        out["kept_waited"] = _train(rank, 2, cls=Kept, wait_first=True)
        out["orders"] = _error(lambda: _train(rank, 2, cls=Branches))
        out["kept"] = _error(lambda: _train(rank, 2, cls=Kept))  # last: it stops mid-backward
    return out


@pytest.fixture(scope="module")
def sessions():
    return {world: run_on_ranks(_session, world, timeout=300) for world in (2, 3)}


def _same(seen, tol=TOL):
    ddp, zero = seen["states"]
    assert ddp.keys() == zero.keys()
    for name in ddp:
        torch.testing.assert_close(zero[name], ddp[name], atol=tol, rtol=0, msg=name)
    torch.testing.assert_close(seen["eval"][1], seen["eval"][0], atol=tol, rtol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_stages_1_and_2_with_the_all_gather_in_flight_train_what_ddp_trains(sessions, world):
    for result in sessions[world]:
        for stage, seen in result["parity"].items():
            _same(seen)
            assert all(n > 0 for n in seen["in_flight"]), stage  # step() returned with exchanges in flight
            # first read first: the tied weight, body's read by the parent before body runs, proj's by the parent
            assert seen["order"] == ["emb.weight", "body.weight", "body.bias", "proj.weight", "proj.bias"]


def test_a_late_peer_is_waited_for_and_without_the_wait_the_weights_differ(sessions):
    for result in sessions[2]:
        _same(result["late"])
    with pytest.raises(AssertionError):  # rank 0 read rank 1's pieces before they came
        _same(sessions[2][0]["late_no_wait"], tol=100 * TOL)


def test_ranks_that_read_the_parameters_in_another_order_are_refused_naming_the_rank(sessions):
    for result in sessions[2]:
        assert result["orders"] is not None and "rank 1 " in result["orders"]


def test_a_parameter_read_through_a_reference_kept_from_before_the_step_is_named(sessions):
    for result in sessions[2]:
        assert result["kept"] is not None and "proj.weight" in result["kept"]
        _same(result["kept_waited"])  # waited for by the caller: exact
