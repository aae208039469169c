"""Preparing a run: the model wrapped in DDP, the data sharded, the optimizer, mixed precision.

What
    What ``Trainer.__init__`` builds before the first step, one function per object, each from
    the ``TrainingConfig``. ``prepare_model``: gradient checkpointing, the move to the rank's
    device, ``DistributedDataParallel`` with the ``ddp_*`` settings and the ``ddp_comm_hook``; with ``fsdp`` (or
    DeepSpeed's stage 3) ``prepare_fsdp_model`` instead: ``fully_shard`` on the units the settings name, then the
    root (``sharded_model.py``), and a ``ShardedModel`` where DDP would be.
    ``prepare_dataloader``: a ``ShardSampler`` and a ``DataLoader`` with its own generator.
    ``prepare_optimizer``: AdamW (over this rank's shards under FSDP; with ZeRO stage 1 or 2:
    ``miniddp.ZeroOptimizer`` of AdamW, attached to DDP before its first forward), its learning rate decayed
    linearly to 0 over ``max_steps``.
    ``prepare_mixed_precision``: autocast for bf16 and fp16, a ``GradScaler`` for fp16.

Why
    The loop in ``trainer.py`` should read as one step: forward, backward, sync, optimizer step.
    Where each flag lands is then one place to check, flag by flag
    (``test_every_ddp_flag_reaches_ddp_and_the_process_group``).

How Hugging Face differs
    Accelerate's ``Accelerator.prepare(model, optimizer, dataloader, scheduler)`` does this for
    ``transformers.Trainer``: torch's DDP with ``DistributedDataParallelKwargs``, and a
    ``DistributedSampler`` or batches dispatched from rank 0. ``Trainer.create_optimizer_and_scheduler``
    defaults to AdamW and a linear schedule, as here (with warmup and more optimizers there).
    Both call the model's ``gradient_checkpointing_enable()``; here a model without one gets an
    error naming the alternative, and one whose buffers DDP would broadcast is refused. With a
    DeepSpeed config, ``deepspeed.initialize`` wraps model and optimizer in DeepSpeed's engine there;
    miniddp attaches its ZeRO to its own DDP.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils.data import DataLoader

from ..comm_hooks import hook_by_name
from ..composed import DistributedDataParallel  # bucket_cap_mb="auto" included
from ..data.sharding import ShardSampler
from ..zero.reduce_scatter_optimizer import ZeroOptimizer
from .config import TrainingConfig
from .sharded_model import shard_model


def enable_gradient_checkpointing(model: torch.nn.Module, broadcast_buffers: bool, keywords=None) -> None:
    """``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=keywords)`` (Transformers 5:
    ``activation_checkpointing_enable``, the same with a new name), as Hugging Face calls it; or why it cannot."""
    new = getattr(model, "activation_checkpointing_enable", None)
    enable = new or getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"gradient_checkpointing=True but {type(model).__name__} has no "
                         "gradient_checkpointing_enable() method (Hugging Face models have one): add it, or "
                         "checkpoint inside your forward with torch.utils.checkpoint")
    if broadcast_buffers and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
                                 for m in model.modules()):  # constant buffers (BERT's position_ids) are harmless
        raise ValueError("ddp_broadcast_buffers=True with gradient_checkpointing on a model with BatchNorm running "
                         "statistics: set ddp_broadcast_buffers=False")
    if keywords is None:
        enable()
    else:
        enable(**{"activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs": keywords})


# --8<-- [start:wrap]
def prepare_model(model: torch.nn.Module, args: TrainingConfig, device: torch.device):
    """(the model on ``device``, its DDP wrapper, the comm hook's ``(state, hook)`` or None: plain all-reduce)."""
    if args.fsdp_settings.enabled:
        return prepare_fsdp_model(model, args, device)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model, args.ddp_broadcast_buffers, args.gradient_checkpointing_kwargs)
    model = model.to(device)  # the unwrapped model: what a checkpoint saves
    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=args.ddp_bucket_cap_mb, broadcast_buffers=args.ddp_broadcast_buffers,
        find_unused_parameters=args.ddp_find_unused_parameters, static_graph=args.ddp_static_graph)
    comm_hook = hook_by_name(args.ddp_comm_hook, None, args.ddp_comm_powersgd_rank, args.ddp_comm_powersgd_start_iter)
    if comm_hook is not None:
        ddp.register_comm_hook(*comm_hook)
    return model, ddp, comm_hook


def prepare_fsdp_model(model: torch.nn.Module, args: TrainingConfig, device: torch.device):
    """(the model on ``device``, sharded in place into units; its ``ShardedModel``; None: no comm hook)."""
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model, False, args.gradient_checkpointing_kwargs)  # buffers: broadcast once
    model = model.to(device)
    return model, shard_model(model, args.fsdp_settings, args.mixed_precision, args.ddp_broadcast_buffers), None


def prepare_dataloader(dataset, args: TrainingConfig, rank: int, world_size: int, device: torch.device,
                       collate_fn=None) -> tuple[ShardSampler, DataLoader]:
    """This rank's shard of ``dataset``, in micro-batches of ``per_device_train_batch_size``."""
    sampler = ShardSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler,
                        collate_fn=collate_fn, pin_memory=device.type == "cuda", drop_last=args.dataloader_drop_last,
                        generator=torch.Generator())  # its own: iter() must not draw from torch's RNG
    return sampler, loader
# --8<-- [end:wrap]


# --8<-- [start:optimizer]
def prepare_optimizer(ddp, args: TrainingConfig, max_steps: int, zero_stage: int = 0, schedule=None):
    """AdamW for ``ddp``'s model (ZeRO stage 1 or 2: sharded by ``ZeroOptimizer``), and a schedule that decays
    its learning rate linearly to 0 at ``max_steps`` (or ``schedule``'s: a DeepSpeed config's scheduler block)."""
    if zero_stage in (0, 3):  # stage 3 runs fully_shard: ddp.module.parameters() are this rank's shards
        optimizer = torch.optim.AdamW(ddp.module.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    else:  # before DDP's first forward: its buckets' reduce-scatter and this rank's shard are set up now
        optimizer = ZeroOptimizer(ddp, torch.optim.AdamW, stage=zero_stage, lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    factor = (lambda s: max(0.0, 1 - s / max_steps)) if schedule is None else \
        schedule.lr_lambda(args.learning_rate, max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler
# --8<-- [end:optimizer]


def prepare_mixed_precision(mixed_precision: str, device: torch.device):
    """(a context manager factory for the forward, a ``GradScaler`` or None): ``no``, ``bf16`` or ``fp16``."""
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp else nullcontext
    scaler = torch.amp.GradScaler(device.type) if mixed_precision == "fp16" else None  # fp16 underflows unscaled
    return autocast, scaler
