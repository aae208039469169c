"""Full state dicts of a ``fully_shard`` model and of its optimizer: gathered to save, cut again to load.

What
    ``full_state_dict(module)``: a collective; every rank gets the full tensors under the module's own names
    (``model.state_dict()``'s keys without any wrapper prefix), loadable into the plain model. ``load_full_state_dict
    (module, state_dict)``: each rank keeps its dim-0 piece of each full tensor, so a checkpoint saved at one world
    size loads at any other. ``full_optimizer_state_dict(module, optimizer)`` / ``load_full_optimizer_state_dict``
    do the same for a ``torch.optim`` optimizer over the shards: each elementwise state (Adam's moments, SGD's
    momentum) is gathered like its parameter and keyed by the parameter's name. Between steps only: mid-step the
    module holds full or freed tensors, not shards.

Why
    A checkpoint should not depend on how many ranks wrote it: resume at another world size, or load the weights
    into one process for inference.

How torch differs
    torch's ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` / ``set_model_state_dict`` with
    ``StateDictOptions(full_state_dict=True)``, and the ``*_optimizer_*`` pair) does this for FSDP2's ``DTensor``s;
    ``torch.distributed.checkpoint`` also saves sharded files without gathering (FSDP2's ``SHARDED_STATE_DICT``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.shard_collectives import all_gather


def units_of(module: nn.Module) -> list:
    """The ``FSDPParamGroup``s under ``module``, each checked to be between steps."""
    units = [m._fsdp_state.unit for m in module.modules() if hasattr(m, "_fsdp_state")]
    for unit in units:
        if unit.state != "sharded" or unit.in_backward:
            raise RuntimeError(f"fully_shard: unit {unit.name!r} is gathered (mid-step, or after unshard()): read or "
                               "load state dicts between steps, or call reshard() first")
    return units


def _keys(module: nn.Module) -> dict:
    """{id(FSDPParam): [state dict keys]}: every name under which ``module.state_dict()`` holds its shard."""
    prefix_of: dict[int, list[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        prefix_of.setdefault(id(sub), []).append(prefix)
    keys: dict[int, list[str]] = {}
    for unit in units_of(module):
        for p in unit.params:
            keys[id(p)] = [f"{pre}.{attr}" if pre else attr for sub, attr in p.registrations
                           for pre in prefix_of.get(id(sub), [])]
    return keys


def gather_full(p, shard: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``p``'s shard, from every rank, as one full tensor shaped like the parameter."""
    out = shard.new_empty(p.world_size * p.shard_numel)
    all_gather(out, shard.detach().reshape(-1).contiguous(), p.group).wait()
    return p.unpad(out).clone()  # its own storage: not a view of the padded buffer (torch.save would write it)


def my_piece(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's padded dim-0 piece of ``full`` (the parameter's shape), shaped like the shard."""
    return p.pad(full)[p.rank * p.shard_rows : (p.rank + 1) * p.shard_rows].reshape(p.shard_shape)


# --8<-- [start:full]
def full_state_dict(module: nn.Module) -> dict:
    """The full tensors of ``module``'s state, under its own names, on every rank (a collective)."""
    state, keys = module.state_dict(), _keys(module)
    for unit in units_of(module):
        for p in unit.params:
            full = gather_full(p, p.shard)
            for key in keys[id(p)]:
                state[key] = full
    return state


def load_full_state_dict(module: nn.Module, state_dict: dict) -> None:
    """Load full tensors (saved at any world size): each rank keeps its piece of every parameter."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}: "
                       "give full_state_dict()'s (or the plain model's state_dict()) for this model")
    keys = _keys(module)
    sharded = {key: p for unit in units_of(module) for p in unit.params for key in keys[id(p)]}
    with torch.no_grad():
        for key, tensor in own.items():
            given = state_dict[key]
            p = sharded.get(key)
            shape = p.shape if p is not None else tensor.shape
            if tuple(given.shape) != tuple(shape):
                raise ValueError(f"load_full_state_dict: {key} has shape {tuple(given.shape)}, the model's is "
                                 f"{tuple(shape)}: give full tensors (full_state_dict()), not shards")
            tensor.copy_(my_piece(p, given.to(tensor.device)) if p is not None else given)
# --8<-- [end:full]


def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with each parameter named and each elementwise state full (a collective)."""
    keys = _keys(module)
    found = {id(p.shard): (p, keys[id(p)][0]) for u in units_of(module) for p in u.params}
    saved = optimizer.state_dict()
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    names, state = [], {}
    for index, param in enumerate(ordered):
        if id(param) not in found:
            raise ValueError("full_optimizer_state_dict: the optimizer steps a tensor that is not a shard of this "
                             "module: build it over module.parameters() after fully_shard")
        p, name = found[id(param)]
        names.append(name)
        if index in saved["state"]:
            state[name] = {k: gather_full(p, v) if _elementwise(v, p) else v for k, v in saved["state"][index].items()}
    groups, start = [], 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": names[start : start + count]})
        start += count
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Each rank keeps its piece of every elementwise state; the options as saved (any world size)."""
    keys = _keys(module)
    found = {keys[id(p)][0]: p for u in units_of(module) for p in u.params}
    index = {name: i for i, name in enumerate(n for g in state_dict["param_groups"] for n in g["params"])}
    unknown = sorted(set(index) - set(found))
    if unknown:
        raise KeyError(f"load_full_optimizer_state_dict: parameters {unknown[:5]} are not in this model")
    state = {index[name]: {k: my_piece(found[name], v) if _elementwise(v, found[name]) else v
                           for k, v in entry.items()} for name, entry in state_dict["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state_dict["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _elementwise(value, p) -> bool:
    """A state shaped like the shard (saving) or like the parameter (loading): Adam's moments, not its step."""
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) in (tuple(p.shard_shape), tuple(p.shape))


def clip_grad_norm_(module: nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model from the shards' gradients: each rank's sum of
    squares, summed over ranks (one all-reduce), then every shard's gradient scaled. torch's own function would
    see only this rank's shards: call this one."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    units = units_of(module)
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.stack([g.double().square().sum() for g in grads]).sum() if grads else \
        torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(squares, group=units[0].group if units else None)
    norm = squares.sqrt().float()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm
