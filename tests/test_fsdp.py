"""miniddp.fully_shard (FSDP / ZeRO-3) against torch's own fully_shard and against one process on the global batch.

The model has an embedding, layer norms (one frozen), biases and rows that 2 and 3 ranks cut unevenly (7, 10 and 11
rows), three blocks wrapped first and the root last, as FSDP2 is applied. Side by side on every rank: torch's
``torch.distributed.fsdp.fully_shard`` (it runs on gloo on CPU), miniddp's, and one process on the whole batch. Both
FSDPs see the same mean gradient, so they agree to float32 rounding; bf16 compute is compared to torch's bf16 and,
loosely, to one process in fp32. The same sessions hold accumulation without sync, reshard_after_forward=False,
the full state dict (saved at 2 ranks, loaded at 3 with the optimizer's state, then trained on), prefetch (after
the first step every unit finds its parameters already in flight), the refusals (a tied weight across units, a
parent reading a freed parameter, a changed order of units) and four negative controls that must fail: no mean,
a reshard without a gather before the backward, a prefetch of the wrong unit and a parent reading a freed
parameter registered as a shard. One multi-rank session per world size runs every check.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import miniddp
from miniddp.fsdp import clip_grad_norm_ as fsdp_clip
from miniddp.fsdp import (
    fsdp_param,
    fsdp_param_group,
    fsdp_state,
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)
from miniddp.fsdp.fsdp_state import UnitOrderError
from miniddp.launching.spawn import run_on_ranks

STEPS, BATCH, D, VOCAB = 3, 3, 7, 11
TOL, TOL_BF16 = 2e-6, 2e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, D + 3), nn.Linear(D + 3, D)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, seed=0, frozen=True):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 5)
        if frozen:
            self.blocks[1].ln.requires_grad_(False)

    def forward(self, tokens, order=(0, 1, 2)):
        h = self.emb(tokens)
        for i in order:
            h = self.blocks[i](h)
        return self.head(self.norm(h)).square().mean()


class ReadsChild(Net):
    """A parent whose forward reads a block's bias after that block ran: outside the block's unit."""

    def forward(self, tokens, order=(0, 1, 2)):
        return super().forward(tokens) + self.blocks[0].out.bias.sum()


class Checkpointed(Net):
    """Each block recomputed in the backward (activation checkpointing), reentrant or not."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, tokens, order=(0, 1, 2)):
        h = self.emb(tokens)
        for i in order:
            h = checkpoint(self.blocks[i], h, use_reentrant=self.reentrant)
        return self.head(self.norm(h)).square().mean()


def _checkpointed(rank, world) -> dict:
    gaps = {}
    one = Net()
    _train(one, _optimizer("adamw", one.parameters()), world, None)
    for reentrant in (False, True):
        model = _ours(Checkpointed(reentrant))
        _train(model, _optimizer("adamw", model.parameters()), rank, world)
        gaps[reentrant] = _gap(miniddp.full_state_dict(model), one.state_dict())
    with torch.no_grad():  # an evaluation forward: gathered, then back to the shards
        gaps["eval"] = (model(_tokens(9, 0, 0)) - one(_tokens(9, 0, 0))).abs().item()
    gaps["eval, shards again"] = tuple(model.blocks[0].fc.weight.shape)
    return gaps


def _clipped(rank, world) -> dict:
    """One step clipped to a small norm: miniddp's clip over the shards, torch's over the shards, one process."""
    out = {}
    one = Net()
    sum(one(_tokens(0, 0, r)) for r in range(world)).div(world).backward()
    out["one"] = torch.nn.utils.clip_grad_norm_(one.parameters(), 0.01).item()
    for name, clip in (("ours", fsdp_clip), ("torch's on shards", torch.nn.utils.clip_grad_norm_)):
        model = _ours(Net())
        optimizer = _optimizer("sgd", model.parameters())
        model(_tokens(0, 0, rank)).backward()
        out[name] = clip(model if clip is fsdp_clip else model.parameters(), 0.01).item()
        optimizer.step()
        out[name + ", weights"] = miniddp.full_state_dict(model)
    _optimizer("sgd", one.parameters()).step()
    out["one, weights"] = one.state_dict()
    return out


def _wrap(model, shard, **kw):
    for block in model.blocks:
        shard(block, **kw)
    shard(model, **kw)
    return model


def _torch_fsdp(model, mp=None, **kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    return _wrap(model, fully_shard, **kw)


def _ours(model, mp=None, **kw):
    if mp is not None:
        kw["mp_policy"] = miniddp.MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    return _wrap(model, miniddp.fully_shard, **kw)


def _tokens(step, micro, rank):
    return torch.randint(0, VOCAB, (BATCH, 4), generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(model, optimizer, rank, world, steps=STEPS, micro=1, first=0):
    """``steps`` optimizer steps of ``micro`` micro-batches each; a fully_shard model syncs the last one only.
    ``world=None``: one process on the batches of ranks ``0..rank-1`` together, their mean."""
    for step in range(first, first + steps):
        for m in range(micro):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(m == micro - 1)
            if world is None:  # one process: the global batch, the mean over ranks
                sum(model(_tokens(step, m, r)) for r in range(rank)).div(rank * micro).backward()
            else:
                (model(_tokens(step, m, rank)) / micro).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model) -> dict:
    state = model.state_dict()
    if any(hasattr(v, "full_tensor") for v in state.values()):  # torch's: DTensors
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    if isinstance(model, miniddp.FSDPModule):
        return miniddp.full_state_dict(model)
    return state


def _gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].numel())


def _compare(rank, world, optim="adamw", mp=None, micro=1, **kw):
    """(miniddp vs torch, miniddp vs one process): the largest difference of any weight after training."""
    ours, theirs, one = _ours(Net(), mp, **kw), _torch_fsdp(Net(), mp, **kw), Net()
    for model in (ours, theirs):
        _train(model, _optimizer(optim, model.parameters()), rank, world, micro=micro)
    _train(one, _optimizer(optim, one.parameters()), world, None, micro=micro)
    mine = _full(ours)
    return _gap(mine, _full(theirs)), _gap(mine, one.state_dict())


def _broken(rank, world, monkeypatch_target, replacement, **kw):
    """``_compare`` with one function replaced; the error's type if it raises instead."""
    owner, name = monkeypatch_target
    saved = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        return _compare(rank, world, **kw)
    except RuntimeError as error:
        return type(error).__name__
    finally:
        setattr(owner, name, saved)


def _land_the_sum(self):  # no mean: the reduce-scatter's sum lands as it is
    future, out = self.pending_reduce
    future.wait()
    self.pending_reduce = None
    for p, start in zip(self.grad_params, self.grad_offsets):
        p.shard.grad = out[start : start + p.shard_numel].view(p.shard_shape).to(p.shard.dtype).clone()


def _no_gather_before_backward(self, grad):  # the backward reads what the forward freed
    root = self.root
    if not root.callback_queued:
        root.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(root._end_backward)
    self.unit.in_backward = True
    return grad


def _prefetch_this_unit(self, phase, state):  # the wrong unit: the one about to run, not the next
    order, at = self.orders[phase], self.position[phase]
    self.position[phase] = at + 1
    if not self.recorded[phase]:
        order.append(state)
    elif at < len(order):
        order[at].unit.issue_gather()


def _prefetch_hits(rank, world, advance=None):
    """Per phase, how many units found their gather already in flight when their hook began (posted by an earlier
    unit's), of how many hooks ran."""
    model = _ours(Net())
    optimizer = _optimizer("adamw", model.parameters())
    _train(model, optimizer, rank, world, steps=1)
    seen = {"forward": [], "backward": []}
    State = fsdp_state.FSDPState
    saved = State._pre_forward, State._pre_backward, State._advance

    def pre_forward(state, *args):
        seen["forward"].append(state.unit.state == "gathering")
        return saved[0](state, *args)

    def pre_backward(state, grad):
        if not state.unit.in_backward:
            seen["backward"].append(state.unit.state == "gathering")
        return saved[1](state, grad)
    State._pre_forward, State._pre_backward, State._advance = pre_forward, pre_backward, advance or saved[2]
    try:
        _train(model, optimizer, rank, world, steps=1, first=1)
    finally:
        State._pre_forward, State._pre_backward, State._advance = saved
    return {phase: (sum(hits), len(hits)) for phase, hits in seen.items()}


def _refusals(rank, world) -> dict:
    refused = {}
    tied = Net()
    tied.head.weight = nn.Parameter(torch.randn(5, D))
    tied.blocks[0].fc.weight = tied.blocks[2].fc.weight  # one weight in two units
    try:
        _wrap(tied, miniddp.fully_shard)
    except ValueError as error:
        refused["tied"] = "fc.weight" in str(error)
    parent = _ours(ReadsChild())
    try:
        parent(_tokens(0, 0, rank)).backward()
    except RuntimeError as error:
        refused["parent"] = "blocks.0.out.bias" in str(error)
    # the same read with the shard registered where the freed parameter is: no error, a wrong sum
    saved = fsdp_param.FSDPParam.register
    fsdp_param.FSDPParam.register = lambda self, kind: saved(self, "shard" if kind == "freed" else kind)
    try:
        silent = _ours(ReadsChild())
        silent(_tokens(0, 0, rank)).backward()
        refused["parent, shard registered"] = "no error"
    except RuntimeError:
        refused["parent, shard registered"] = "raised"
    finally:
        fsdp_param.FSDPParam.register = saved
    model = _ours(Net())
    _train(model, _optimizer("sgd", model.parameters()), rank, world, steps=1)
    try:  # every rank changes the order alike: refused before any collective goes astray
        model(_tokens(1, 0, rank), order=(2, 1, 0)).backward()
    except UnitOrderError:
        refused["order"] = True
    differs = _ours(Net())
    try:  # rank 1 runs another order from the first step: found at the end of that backward, on every rank
        differs(_tokens(0, 0, rank), order=(0, 1, 2) if rank != 1 else (0, 2, 1)).backward()
    except UnitOrderError as error:
        refused["ranks differ"] = "[1]" in str(error)
    return refused


def _state_dicts(rank, world, path) -> dict:
    """At 2 ranks: train, save the full model and optimizer. At 3: load both, train on; compare to one process."""
    out = {}
    if world == 2:
        model = _ours(Net())
        optimizer = _optimizer("adamw", model.parameters())
        _train(model, optimizer, rank, world)
        full, optim = miniddp.full_state_dict(model), full_optimizer_state_dict(model, optimizer)
        plain = Net(seed=5)
        plain.load_state_dict(full)  # the plain model's names: it loads as it is
        out["plain"] = _gap(plain.state_dict(), full)
        if rank == 0:
            torch.save({"model": full, "optim": optim}, path)
        return out
    saved = torch.load(path, weights_only=False)
    model = _ours(Net(seed=9))
    optimizer = _optimizer("adamw", model.parameters())
    miniddp.load_full_state_dict(model, saved["model"])
    load_full_optimizer_state_dict(model, optimizer, saved["optim"])
    out["loaded"] = _gap(miniddp.full_state_dict(model), saved["model"])
    _train(model, optimizer, rank, world, steps=1, first=STEPS)
    one = Net()
    one_optimizer = _optimizer("adamw", one.parameters())
    _train(one, one_optimizer, 2, None)  # what 2 ranks trained, then a step on 3 ranks' batches
    _train(one, one_optimizer, world, None, steps=1, first=STEPS)
    out["resumed vs one"] = _gap(miniddp.full_state_dict(model), one.state_dict())
    return out


def _session(rank, world, path):
    torch.set_num_threads(1)
    results = {"adamw": _compare(rank, world), "accumulate": _compare(rank, world, micro=2),
               "keep": _compare(rank, world, reshard_after_forward=False),
               "no mean": _broken(rank, world, (fsdp_param_group.FSDPParamGroup, "land_gradients"), _land_the_sum,
                                  optim="sgd"),  # AdamW's step barely sees a gradient's scale
               "no gather before backward": _broken(rank, world, (fsdp_state.FSDPState, "_pre_backward"),
                                                    _no_gather_before_backward),
               "prefetch": _prefetch_hits(rank, world),
               "wrong prefetch": _prefetch_hits(rank, world, _prefetch_this_unit),
               "refused": _refusals(rank, world), "clip": _clipped(rank, world),
               "state dicts": _state_dicts(rank, world, path)}
    if world == 3:
        results["sgd"] = _compare(rank, world, optim="sgd")
    else:
        results["bf16"] = _compare(rank, world, mp=(torch.bfloat16, torch.float32))
        results["checkpointing"] = _checkpointed(rank, world)
    model = _ours(Net())
    _train(model, _optimizer("adamw", model.parameters()), rank, world, steps=1)
    units = [m._fsdp_state.unit for m in model.modules() if isinstance(m, miniddp.FSDPModule)]
    results["held"] = (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in Net().parameters()),
                       sum(p.unsharded.numel() for u in units for p in u.params))
    model.blocks[0].unshard()
    results["unshard"] = tuple(model.blocks[0].fc.weight.shape)
    model.blocks[0].reshard()
    results["reshard"] = tuple(model.blocks[0].fc.weight.shape)
    return results


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp") / "full.pt")
    return {world: run_on_ranks(_session, world, args=(path,), timeout=300) for world in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", ["adamw", "accumulate", "keep"])
def test_fully_shard_trains_what_torchs_fully_shard_and_one_process_train(sessions, world, check):
    for to_torch, to_one in (result[check] for result in sessions[world]):
        assert to_torch < TOL and to_one < TOL


def test_sgd_with_momentum_at_three_ranks(sessions):
    for to_torch, to_one in (result["sgd"] for result in sessions[3]):
        assert to_torch < TOL and to_one < TOL


def test_a_bf16_policy_matches_torchs_bf16_and_one_process_loosely(sessions):
    for to_torch, to_one in (result["bf16"] for result in sessions[2]):
        assert to_torch < TOL and 0 < to_one < TOL_BF16  # bf16 compute is not fp32's


def test_activation_checkpointing_reentrant_or_not_and_an_evaluation_forward(sessions):
    for result in sessions[2]:
        gaps = result["checkpointing"]
        assert gaps[False] < TOL and gaps[True] < TOL and gaps["eval"] < TOL
        assert gaps["eval, shards again"] == (-(-(D + 3) // 2), D)


@pytest.mark.parametrize("world", [2, 3])
def test_the_comparison_fails_without_the_mean(sessions, world):
    for to_torch, to_one in (result["no mean"] for result in sessions[world]):
        assert to_torch > 100 * TOL and to_one > 100 * TOL


@pytest.mark.parametrize("world", [2, 3])
def test_a_backward_without_a_gather_again_fails_instead_of_reading_freed_memory(sessions, world):
    assert all(result["no gather before backward"] == "RuntimeError" for result in sessions[world])


@pytest.mark.parametrize("world", [2, 3])
def test_after_the_first_step_every_unit_but_the_first_finds_its_gather_in_flight(sessions, world):
    for result in sessions[world]:
        forward, backward = result["prefetch"]["forward"], result["prefetch"]["backward"]
        assert forward == (3, 4)  # the root gathers its own; each block was posted by the unit before it
        assert backward == (3, 4)  # each block by the unit after it (the root never freed its own)
        wrong = result["wrong prefetch"]
        assert wrong["forward"][0] < forward[0]  # the negative control: prefetching the current unit is no prefetch


def test_refusals_name_what_they_refuse(sessions):
    for result in sessions[2]:
        refused = result["refused"]
        assert refused["tied"] is True and refused["parent"] is True and refused["order"] is True
        assert refused["ranks differ"] is True
        assert refused["parent, shard registered"] == "no error"  # the negative control: silently wrong


@pytest.mark.parametrize("world", [2, 3])
def test_between_steps_a_rank_holds_about_one_nth_of_the_parameters_and_no_full_one(sessions, world):
    for result in sessions[world]:
        held, whole, full = result["held"]
        assert whole / world <= held <= whole / world + 12 * (D + 3)  # at most a padding row per parameter
        assert full == 0
        assert result["unshard"] == (D + 3, D) and result["reshard"] == (-(-(D + 3) // world), D)


def test_a_full_state_dict_saved_at_two_ranks_loads_at_three_and_trains_on(sessions):
    for result in sessions[2]:
        assert result["state dicts"]["plain"] == 0
    for result in sessions[3]:
        assert result["state dicts"]["loaded"] == 0
        assert result["state dicts"]["resumed vs one"] < TOL


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_over_the_shards_is_the_whole_models_and_torchs_own_on_shards_is_not(sessions, world):
    for result in sessions[world]:
        clip = result["clip"]
        assert abs(clip["ours"] - clip["one"]) < 1e-5 * clip["one"]
        assert _gap(clip["ours, weights"], clip["one, weights"]) < TOL
        assert abs(clip["torch's on shards"] - clip["one"]) > 1e-3 * clip["one"]  # this rank's shards' norm only
