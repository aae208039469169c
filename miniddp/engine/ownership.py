"""Who averages a parameter's gradients: copies of a wrapper, wrappers of a wrapper, parameters changed after wrap.

What
    ``copy.deepcopy(ddp)``, ``pickle`` and ``torch.save``/``torch.load`` give a wrapper of the copied module
    with a reducer and hooks of its own: ``wrapper_state`` leaves the reducer behind and the copy builds a
    fresh one (no collective; its buckets are rebuilt after its first iteration, as a new wrapper's are).
    A deep copy keeps the original's process group (same process, same peers); an unpickled one uses the
    default group, and a wrapper of another group is refused at pickling. The comm hook and its state are
    copied too; a ``tracer`` stays with the original. ``copy.copy(ddp)`` is an alias sharing the module
    and its reducer. ``refuse_nested`` refuses a DistributedDataParallel as the module.
    ``WrappedParameters`` remembers each parameter as wrapped (the object, ``requires_grad``, dtype, device)
    and names the first change at the next grad-enabled forward.

Why
    A reducer averages through hooks on parameter *objects*. A copy's parameters are new objects without
    hooks: a reducer copied along got no gradient at all (an error that advised
    ``find_unused_parameters=True``, and with that flag the gradients were never averaged, without a word).
    A parameter replaced after wrapping (``module.w = nn.Parameter(...)``, ``load_state_dict(assign=True)``)
    has no hook, one converted (``.double()``) no bucket of its dtype: its gradient stays local.

How torch differs
    torch's ``__getstate__``/``__setstate__`` (``torch/nn/parallel/distributed.py``) also drop the reducer
    and build another, always on the default group: a wrapper of another group cannot be copied or pickled,
    and the copy's reducer has no comm hook (it sends plain all-reduces). Ours keeps the comm hook and its
    state (copied). ``copy.copy``: torch builds a second reducer on the same parameters; ours shares the one.
    torch checks no parameter after wrap: a replaced or converted one is silently not averaged.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

WRAPPED_AGAIN = ("this DistributedDataParallel no longer averages gradients: its model was wrapped again by a newer "
                 "DistributedDataParallel (a notebook cell run twice, or two Trainers on one model), which took its "
                 "gradient hooks. Use the newest wrapper; for two independent ones, wrap a copy (copy.deepcopy(model) "
                 "or copy.deepcopy(ddp)).")


def refuse_nested(module: torch.nn.Module, ours: type) -> None:
    """A DistributedDataParallel (``ours`` or torch's) given as the module to wrap: one line, at wrap."""
    theirs = torch.nn.parallel.distributed.DistributedDataParallel
    if isinstance(module, (ours, theirs)):
        raise TypeError(f"module is already a {type(module).__module__}.DistributedDataParallel: a second wrapper "
                        "puts a second reducer on the same parameters (torch's averages every gradient twice). "
                        "Wrap the model once: DistributedDataParallel(ddp.module), or keep using ddp.")


# --8<-- [start:copies]
def wrapper_state(ddp) -> dict:
    """What a copy carries: everything but the reducer, whose hooks are on the original's parameters, and an
    open ``join()``; the comm hook travels as ``(state, hook)``, for the copy's own reducer."""
    state = torch.nn.Module.__getstate__(ddp)
    reducer = state.pop("reducer")
    state.pop("join_context", None)
    state["_comm_hook"] = reducer.registered_hook  # (state, hook), or None: the default path
    return state


def deep_copy(ddp, memo: dict):
    """``copy.deepcopy(ddp)``: the module copied, a reducer of its own; a process group (the wrapper's, or
    the comm hook's) is this process's connection to its peers, shared with the copy, never copied."""
    clone = type(ddp).__new__(type(ddp))
    memo[id(ddp)] = clone
    state = wrapper_state(ddp)
    hook_state = state["_comm_hook"][0] if state["_comm_hook"] else None
    for group in (state["_process_group"], hook_state, getattr(hook_state, "process_group", None)):
        if isinstance(group, dist.ProcessGroup):
            memo[id(group)] = group
    clone.__setstate__(copy.deepcopy(state, memo))
    return clone


def alias(ddp):
    """``copy.copy(ddp)``: another wrapper object on the same module and the same reducer; both work."""
    other = type(ddp).__new__(type(ddp))
    other.__dict__.update(ddp.__dict__)
    return other


def pickled_state(ddp) -> dict:
    """``pickle`` / ``torch.save``: no process group travels; the loaded wrapper uses the default group."""
    state = wrapper_state(ddp)
    state["_process_group"] = _default_only(state["_process_group"], "process_group")
    if state["_comm_hook"] is not None and isinstance(state["_comm_hook"][0], dist.ProcessGroup):
        state["_comm_hook"] = (_default_only(state["_comm_hook"][0], "the comm hook's state"), state["_comm_hook"][1])
    return state


def _default_only(group, what: str):
    if group is None or group == dist.group.WORLD:
        return None  # the default group, looked up again where the copy is loaded
    raise TypeError(f"{what} is not the default process group, and a process group cannot be pickled (the loaded "
                    "wrapper would use the default group). Save ddp.module (or its state_dict) and wrap it again "
                    "after loading; copy.deepcopy(ddp) keeps the group.")


def restored_state(state: dict):
    """The loaded state, ready for ``nn.Module.__setstate__``; returns the comm hook's ``(state, hook)``."""
    if not dist.is_initialized():
        raise RuntimeError("a copied or loaded DistributedDataParallel needs a process group: call "
                           "miniddp.init_distributed() (or torch.distributed.init_process_group) first, or save and "
                           "load ddp.module instead")
    return state.pop("_comm_hook") or (None, None)
# --8<-- [end:copies]


# --8<-- [start:wrapped]
class WrappedParameters:
    """Each parameter as ``DistributedDataParallel`` wrapped it; ``check`` raises at the first change."""

    def __init__(self, module: torch.nn.Module):
        self.named = list(module.named_parameters())  # (name, parameter) at wrap, frozen ones too, tied ones once
        self.was = [(p.requires_grad, p.dtype, p.device) for _, p in self.named]

    def trained(self) -> list:
        """The (name, parameter) pairs the reducer averages: those that required grad at wrap."""
        return [(n, p) for (n, p), (requires_grad, _, _) in zip(self.named, self.was) if requires_grad]

    def check(self, module: torch.nn.Module) -> None:
        """Every grad-enabled forward: the same parameter objects, each with the same requires_grad, dtype and
        device (a few attribute reads per parameter, no communication)."""
        now = list(module.parameters())
        if len(now) == len(self.named) and all(p is q and (p.requires_grad, p.dtype, p.device) == was
                                               for p, (_, q), was in zip(now, self.named, self.was)):
            return
        change = self._first_change(module)
        if change is not None:  # None: the same parameters, registered in another order
            raise RuntimeError(change)

    def _first_change(self, module: torch.nn.Module) -> str | None:
        now = dict(module.named_parameters())
        for (name, p), was in zip(self.named, self.was):
            q = now.pop(name, None)
            if q is None:
                return (f"{name} is no longer a parameter of the module (deleted or renamed after wrapping): "
                        "DistributedDataParallel averages the parameters it wrapped. Wrap the model again.")
            if q is not p:
                return (f"{name} is another Parameter than the one DistributedDataParallel wrapped (replaced after "
                        "wrapping: module.<name> = nn.Parameter(...), load_state_dict(..., assign=True), or .to() "
                        "with torch.__future__.set_overwrite_module_params_on_conversion(True)), so its gradient "
                        "would never be averaged. Copy values into the wrapped parameter instead (load_state_dict "
                        "without assign=True, or with torch.no_grad(): p.copy_(new)), or wrap the model again.")
            for field, before, after in zip(("requires_grad", "dtype", "device"), was,
                                            (q.requires_grad, q.dtype, q.device)):
                if before != after:
                    return f"{name}.{field} changed from {before} to {after} after wrapping: " + _FIX[field]
        added = next(iter(now), None)
        return None if added is None else (
            f"{added} was added to the module after wrapping: DistributedDataParallel averages the parameters it "
            "wrapped, so its gradient would never be averaged. Add parameters before wrapping, or wrap the model "
            "again.")
# --8<-- [end:wrapped]


_FIX = {
    "requires_grad": "DistributedDataParallel chose the parameters it averages when it wrapped the model. Set "
                     "requires_grad before wrapping (to change it mid-training, wrap the model again).",
    "dtype": "its buckets hold the dtypes it wrapped (torch's DDP stops averaging such a gradient without a word). "
             "Convert the model (.to(), .double(), .half()) before wrapping it, or wrap it again.",
    "device": "its buckets live on the devices it wrapped. Move the model (.to(), .cuda()) before wrapping it, "
              "or wrap it again.",
}
