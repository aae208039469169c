"""The ``deepspeed`` field of ``TrainingConfig`` turned into the trainer's settings: the ZeRO stage a run asks for.

What
    This module reads no config itself: ``zero/deepspeed_config.py`` is the one reader (the keys, the ``"auto"``
    values, the refusals); this one only turns its result into the trainer's settings. ``deepspeed_settings(config,
    world_size)`` takes ``config.deepspeed`` (a DeepSpeed JSON's path, JSON text or a dict) or, when it is None,
    what ``accelerate launch`` (and ``miniddp launch``) hands the processes (``accelerate_deepspeed_config``), hands
    the reader the trainer's values it must agree with (``MATCHED``: the batch, clipping and precision, learning
    rate, weight decay and steps) and returns the ``ZeroSettings``: stage 0 (DDP and AdamW), 1 or 2
    (``miniddp.ZeroOptimizer``), and DeepSpeed's schedule when the config has one. With stage 1 or 2 it refuses, in
    one line, the trainer's settings ZeRO cannot run with: ``mixed_precision="fp16"`` (``GradScaler.unscale_``
    reads ``.grad``, which ZeRO leaves None, and each rank would find an inf in its own shard only: one rank would
    skip a step the others take), a ``ddp_comm_hook`` (the bucket's collective is ZeRO's reduce-scatter) and
    ``ddp_bucket_cap_mb="auto"`` (it rebuilds the buckets ZeRO's shards are cut from).

Why
    The config is checked when it is built, so that a bad key or a mismatch is exit status 2 of the CLI, before
    any process group exists; the Trainer checks again with the world size it joined (``train_batch_size``).

How Hugging Face and Accelerate differ
    ``TrainingArguments.__post_init__`` does the same: ``HfTrainerDeepSpeedConfig(deepspeed)`` when the field is
    set, else Accelerate's ``DeepSpeedPlugin()`` from the ``ACCELERATE_*`` variables when
    ``ACCELERATE_USE_DEEPSPEED`` is true (ZeRO stage 2 by default); DeepSpeed then runs fp16 with its own loss
    scaler.
"""

from __future__ import annotations

import os

from ..zero.deepspeed_config import (
    FP16_WITH_ZERO,
    accelerate_deepspeed_config,
    load_deepspeed_config,
    read_deepspeed_config,
)
from ..zero.deepspeed_keys import ZeroSettings

MATCHED = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "mixed_precision",
           "ddp_bucket_cap_mb", "learning_rate", "weight_decay", "max_steps")  # what a DeepSpeed config must agree with


def world_size_from_env(environ=None) -> int | None:
    """torchrun's ``WORLD_SIZE`` (None outside torchrun: the Trainer checks again once it knows)."""
    size = (os.environ if environ is None else environ).get("WORLD_SIZE", "")
    return int(size) if size.isascii() and size.isdigit() and int(size) > 0 else None


# --8<-- [start:settings]
def deepspeed_settings(config, world_size: int | None = None, environ=None) -> ZeroSettings:
    """What ``config.deepspeed`` (or accelerate launch's variables) asks for, checked against ``config``."""
    given = load_deepspeed_config(config.deepspeed) if config.deepspeed is not None else \
        accelerate_deepspeed_config(environ)
    if given is None:
        return ZeroSettings()
    ds_config, source = given
    args = {**{name: getattr(config, name) for name in MATCHED}, "world_size": world_size}
    zero = read_deepspeed_config(ds_config, source, args)
    if zero.stage == 0:
        return zero
    where = f"ZeRO stage {zero.stage} ({source})"
    if config.mixed_precision == "fp16":
        raise ValueError(f"mixed_precision='fp16' cannot run with {where}: {FP16_WITH_ZERO}: use bf16, or stage 0")
    if config.ddp_comm_hook != "no":
        raise ValueError(f"ddp_comm_hook={config.ddp_comm_hook!r} cannot run with {where}: the bucket's collective "
                         "is ZeRO's reduce-scatter, which a hook cannot replace: use no, or stage 0")
    if config.ddp_bucket_cap_mb == "auto":
        raise ValueError(f"ddp_bucket_cap_mb='auto' cannot run with {where}: the cost model rebuilds the buckets "
                         "after the first step, and ZeRO cuts its shards from the first ones: give a number of MiB")
    return zero
# --8<-- [end:settings]
