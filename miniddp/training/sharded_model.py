"""The trainer's ``fully_shard`` model: which modules become units, and what the loop and the checkpointer call on it.

What
    ``units_to_wrap(model, settings)`` picks the modules that become units, bottom-up (the root is always the last
    unit, applied by ``shard_model``): ``transformer`` each module of a class named in
    ``transformer_layer_cls_to_wrap`` (none given: the model's ``_no_split_modules``, as Transformers' models list
    their blocks); ``size`` each module holding more than ``min_num_params`` parameters, counted before any wrap
    (Accelerate's FSDP2 size policy); ``deepspeed`` (ZeRO stage 3, which has no wrap policy: it gathers per submodule)
    the ``_no_split_modules`` blocks when the model names them, else every module that holds parameters itself and
    shares none (a tied weight stays in the root's unit); ``none`` the root alone. ``ShardedModel`` is what the
    loop calls where it calls DDP: the call, ``no_sync()`` (``set_requires_gradient_sync(False)`` until the context
    ends), ``clip_grad_norm_`` (the norm from the shards: one all-reduce) and an empty bucket layout for the
    checkpointer. ``FullModelState`` and ``FullOptimizerState`` give the checkpointer ``state_dict()`` /
    ``load_state_dict()`` in full tensors under the plain model's names: collectives every rank calls, loadable at
    any world size.

Why
    The loop stays one loop: DDP, ZeRO and FSDP differ in what a step communicates, not in its shape.

How Hugging Face differs
    Accelerate's ``fsdp2_prepare_model`` applies the same policies (``fsdp2_prepare_auto_wrap_policy``) to
    ``get_module_children_bottom_up(model)[:-1]``, then the root; recent versions also make the input embedding and
    the last norm with the output embedding units of their own. Its ``clip_grad_norm_`` calls torch's on the
    ``DTensor`` shards, whose norm is global.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..fsdp import (
    MixedPrecisionPolicy,
    clip_grad_norm_,
    full_optimizer_state_dict,
    full_state_dict,
    fully_shard,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from .fsdp_keys import FSDPSettings


# --8<-- [start:units]
def units_to_wrap(model: nn.Module, settings: FSDPSettings) -> list[nn.Module]:
    """The modules ``settings`` makes units, each before the modules that contain it; the root is not among them."""
    modules = [m for m in reversed(list(model.modules())) if m is not model]  # a module after all it contains
    names = settings.layer_classes or tuple(getattr(model, "_no_split_modules", None) or ())
    if settings.wrap == "transformer" or (settings.wrap == "deepspeed" and names):
        if not names:
            raise ValueError(f"fsdp auto_wrap: {type(model).__name__} has no _no_split_modules: name the classes to "
                             'wrap in fsdp_config, e.g. {"transformer_layer_cls_to_wrap": ["MyBlock"]}, or give '
                             "min_num_params")
        present = {type(m).__name__: type(m) for m in modules}
        missing = [n for n in names if n not in present]
        if missing:
            raise ValueError(f"fsdp auto_wrap: the model has no module of class {missing[0]} "
                             f"(transformer_layer_cls_to_wrap); its classes: {', '.join(sorted(present))}")
        classes = tuple(present[n] for n in names)
        return [m for m in modules if isinstance(m, classes)]
    if settings.wrap == "size":
        counts = {id(m): sum(p.numel() for p in m.parameters()) for m in modules}  # before any wrap shards them
        return [m for m in modules if counts[id(m)] > settings.min_num_params]
    if settings.wrap == "deepspeed":
        owners: dict[int, int] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        return [m for m in modules if any(True for _ in m.parameters(recurse=False))
                and all(owners[id(p)] == 1 for p in m.parameters(recurse=False))]
    return []
# --8<-- [end:units]


def shard_model(model: nn.Module, settings: FSDPSettings, mixed_precision: str,
                broadcast_buffers: bool = True) -> ShardedModel:
    """``fully_shard`` each unit of ``units_to_wrap``, then the root; bf16: gathered and computed in bf16, the
    gradients averaged in fp32 (torch's usual pair), the shards (the optimizer's weights) in their own dtype."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    units = units_to_wrap(model, settings)
    names = {id(m): name for name, m in model.named_modules()}
    for module in units:
        fully_shard(module, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy)
    return ShardedModel(model, [names[id(m)] for m in units] + ["(root)"], broadcast_buffers)


# --8<-- [start:adapter]
class ShardedModel:
    """Where the loop calls DDP: a ``fully_shard`` model's call, ``no_sync``, clipping and (no) bucket layout."""

    def __init__(self, module: nn.Module, unit_names: list[str], broadcast_buffers: bool = True):
        self.module = module  # the model itself, sharded in place: its parameters() are this rank's shards
        self.unit_names = unit_names  # each unit's module name, the root last
        # BatchNorm's running statistics change in every training forward, on each rank its own: with
        # ddp_broadcast_buffers they are rank 0's before each forward, as DDP makes them (fully_shard broadcasts
        # buffers once, at the wrap, as torch's does not at all)
        self.running = [b for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                        and m.track_running_stats for b in m.buffers(recurse=False)] if broadcast_buffers else []

    def __call__(self, *args, **kwargs):
        if self.module.training:
            for buffer in self.running:
                dist.broadcast(buffer, 0)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside keep full gradients and reduce-scatter nothing; the next one outside sends all."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm from every rank's shards (one all-reduce), each shard's gradient scaled by the same."""
        return clip_grad_norm_(self.module, max_norm)

    def layout_state(self) -> dict:
        return {}  # a unit's reduce-scatter sums in an order its shards fix: nothing to save

    def load_layout_state(self, state: dict) -> None:
        pass
# --8<-- [end:adapter]


class FullModelState:
    """The checkpointer's view of a ``fully_shard`` model: full tensors under the plain model's names."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        """A collective: every rank gets the full tensors (copied out of the gather's padded buffer)."""
        return {k: v.detach().clone() for k, v in full_state_dict(self.module).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        load_full_state_dict(self.module, state_dict)


class FullOptimizerState:
    """The checkpointer's view of the optimizer over the shards: its state full, keyed by parameter name."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups  # a resume with changes sets this run's learning rate in them

    def state_dict(self) -> dict:
        return full_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        load_full_optimizer_state_dict(self.module, self.optimizer, state_dict)
