"""``fully_shard(module)``: ZeRO-3 / FSDP with torch FSDP2's names; the module stays itself, its parameters shard.

What
    ``fully_shard(module, *, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy())`` makes one unit of the
    parameters under ``module`` that no inner unit holds yet: call it bottom-up (each block, then the root). The
    module's class becomes ``FSDP<Class>`` (a subclass of ``FSDPModule`` and its own class), its parameters'
    names stay, and ``module.parameters()`` yields this rank's dim-0 shards (``fsdp_param.py``), so a plain
    ``torch.optim`` optimizer steps them. Parameters and buffers are broadcast from rank 0 first, as DDP does at
    its wrap. ``FSDPModule`` adds FSDP2's ``unshard()``, ``reshard()`` and ``set_requires_gradient_sync(flag)``
    (accumulation: the gradients stay full and are summed until a backward with sync).

Why
    When the model, its gradients and its optimizer state no longer fit on one device even with ZeRO-2, the
    parameters themselves must be sharded: each rank holds 1/N and gathers one unit at a time.

How torch differs
    ``torch.distributed.fsdp.fully_shard`` (``_fully_shard/_fully_shard.py``) takes a device ``mesh`` (HSDP with two
    dimensions), ``shard_placement_fn``, ``offload_policy`` and ``ignored_params``, shards into ``DTensor``s and
    does not broadcast: it trusts every rank to have built the same weights. Its root keeps its parameters after the
    forward, as here. A weight tied across units is refused here in one line; there it is documented as unsupported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .fsdp_param import FSDPParam
from .fsdp_param_group import FSDPParamGroup
from .fsdp_state import FSDPState
from .mixed_precision import MixedPrecisionPolicy


class FSDPModule:
    """Mixed into a ``fully_shard`` module's class: FSDP2's methods on its unit and the units below it."""

    def unshard(self) -> None:
        """Gather this unit's full parameters now (they stay until ``reshard()`` or the end of a backward)."""
        self._fsdp_state.unit.unshard()

    def reshard(self) -> None:
        """Free this unit's full parameters; the shards are registered again."""
        self._fsdp_state.unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the next backward passes keep full gradients, summed, and reduce-scatter nothing (accumulation);
        True: the next backward reduce-scatters them all, what was kept included."""
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                module._fsdp_state.unit.requires_gradient_sync = bool(requires_gradient_sync)


# --8<-- [start:fully_shard]
def fully_shard(module: nn.Module, *, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> nn.Module:
    """Shard the parameters under ``module`` that no inner unit holds into one unit; returns ``module``."""
    _check(module, reshard_after_forward, mp_policy)
    group = dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    registrations = _registrations(module)  # {id(param): (param, name, [(submodule, attribute)])}, this unit's
    _broadcast_from_rank0(module, [p for p, _, _ in registrations.values()], group)
    params = [FSDPParam(p, where, name, group, rank, world_size, mp_policy.compute_dtype(p.dtype))
              for p, name, where in registrations.values()]
    dtypes = {p.unsharded.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard({_name(module)}): its parameters have dtypes {sorted(map(str, dtypes))}; one "
                         "unit gathers one flat tensor: give mp_policy=MixedPrecisionPolicy(param_dtype=...) or "
                         "fully_shard the submodules of each dtype first")
    unit = FSDPParamGroup(params, _name(module), group, world_size, mp_policy, reshard_after_forward)
    for p, (original, _, _) in zip(params, registrations.values()):
        for tensor in (original, p.shard, p.unsharded):
            tensor._fsdp_unit = unit.name  # a later fully_shard that finds it (a tie) refuses it
        p.register("shard")
    module._fsdp_state = FSDPState(module, unit)
    module.__class__ = _fsdp_class(type(module))
    return module
# --8<-- [end:fully_shard]


def _registrations(module: nn.Module) -> dict:
    """The parameters this unit takes: under ``module``, outside every inner unit; each with all its names. One
    that another unit holds already (inner or not: a tie) is refused."""
    inside = {id(sub) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
              for sub in m.modules()}
    found: dict[int, tuple] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in inside:
            continue
        for attribute, param in list(sub._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{attribute}" if prefix else attribute
            holder = getattr(param, "_fsdp_unit", None)
            if holder is not None:
                raise ValueError(f"fully_shard({_name(module)}): {name} is the same parameter as one that the unit "
                                 f"{holder!r} holds (a tied weight): tied weights must be in one unit; fully_shard "
                                 "their common parent only")
            entry = found.setdefault(id(param), (param, name, []))
            if (sub, attribute) not in entry[2]:
                entry[2].append((sub, attribute))
    return found


def _check(module, reshard_after_forward, mp_policy) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard(module): module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard({_name(module)}): it is already a unit; call fully_shard once per module")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"fully_shard(reshard_after_forward={reshard_after_forward!r}): give True (free the "
                        "parameters after the forward) or False (keep them until the backward)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard(mp_policy={mp_policy!r}): give a miniddp.MixedPrecisionPolicy")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no process group: call torch.distributed.init_process_group (or "
                           "miniddp.init_distributed) first")
    if any(isinstance(m, FSDPModule) and m._fsdp_state.root is not None for m in module.modules()):
        raise RuntimeError(f"fully_shard({_name(module)}): a unit under it has already run a forward: apply "
                           "fully_shard bottom-up before the first forward")


def _broadcast_from_rank0(module: nn.Module, params: list, group) -> None:
    """Every rank starts from rank 0's weights (this unit's parameters) and buffers, as DDP's wrap does."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in params + [b for b in module.buffers() if b is not None]:
            dist.broadcast(tensor.data, source, group=group)


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: the module's own class with ``FSDPModule``'s methods first, made once per class."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def _name(module: nn.Module) -> str:
    state = getattr(module, "_fsdp_state", None)
    return state.unit.name if state is not None else type(module).__name__
