"""The ``deepspeed`` field of ``TrainingConfig``: the ZeRO stage a run asks for, from DeepSpeed's or Accelerate's names.

What
    ``deepspeed_settings(config, world_size)`` reads ``config.deepspeed`` (a DeepSpeed JSON's path, JSON text or a
    dict) or, when it is None, what ``accelerate launch`` (and ``miniddp launch``) hands the processes in
    ``ACCELERATE_*`` variables (``accelerate_deepspeed_config``), checks it with ``zero/deepspeed_config.py``
    against the config's batch, clipping and precision, and its optimizer and scheduler blocks with
    ``zero/deepspeed_optim.py`` against its learning rate, weight decay and steps, and returns the
    ``ZeroSettings``: stage 0 (DDP and AdamW), 1 or 2 (``miniddp.ZeroOptimizer``), and DeepSpeed's schedule when
    the config has one. With stage 1 or 2 it refuses, in one line, what ZeRO cannot do here:
    ``mixed_precision="fp16"`` (``GradScaler.unscale_`` reads ``.grad``, which ZeRO leaves None, and each rank
    would find an inf in its own shard only: one rank would skip a step the others take), a ``ddp_comm_hook``
    (the bucket's collective is ZeRO's reduce-scatter) and ``ddp_bucket_cap_mb="auto"`` (it rebuilds the buckets
    ZeRO's shards are cut from). ``VARIABLES`` is Accelerate's table of YAML keys and variables, both ways:
    ``accelerate_variables`` turns a YAML's ``deepspeed_config`` block into them for the launcher, refusing a key
    miniddp does not implement before any process starts; a JSON it names is checked alone (``check_file``), fp16
    with stage 1 or 2 included, which the trainer would refuse whatever its flags.

Why
    The config is checked when it is built, so that a bad key or a mismatch is exit status 2 of the CLI, before
    any process group exists; the Trainer checks again with the world size it joined (``train_batch_size``).

How Hugging Face and Accelerate differ
    ``TrainingArguments.__post_init__`` does the same: ``HfTrainerDeepSpeedConfig(deepspeed)`` when the field is
    set, else Accelerate's ``DeepSpeedPlugin()`` from the ``ACCELERATE_*`` variables when
    ``ACCELERATE_USE_DEEPSPEED`` is true (ZeRO stage 2 by default); DeepSpeed then runs fp16 with its own loss
    scaler. ``accelerate launch`` ignores DeepSpeed on the CPU (``use_cpu``); miniddp's ZeRO runs there on gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..zero.deepspeed_config import (
    STAGES,
    DeepSpeedConfigError,
    ZeroSettings,
    check_keys,
    load_deepspeed_config,
    zero_settings,
)
from ..zero.deepspeed_optim import read_blocks

TRUE_WORDS = ("1", "true", "yes", "y", "t", "on")  # Accelerate's str_to_bool
MATCHED = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "mixed_precision",
           "ddp_bucket_cap_mb", "learning_rate", "weight_decay", "max_steps")  # what a DeepSpeed config must agree with
FP16_WITH_ZERO = "GradScaler unscales .grad, which ZeRO leaves None (each rank holds a shard of the gradient)"
# --8<-- [start:variables]
# Accelerate's deepspeed_config keys (its YAML: accelerate/commands/config/cluster.py) and the variable accelerate
# launch passes each in (utils/launch.py, prepare_deepspeed_cmd_env), which DeepSpeedPlugin reads back
VARIABLES = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
             "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
             "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
             "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
             "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
             "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
             "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
             "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"}
# keys miniddp takes only with the value that describes what it does anyway
ONLY = {"offload_optimizer_device": "none", "offload_param_device": "none", "offload_optimizer_nvme_path": "none",
        "offload_param_nvme_path": "none", "zero3_init_flag": False, "zero3_save_16bit_model": False,
        "deepspeed_multinode_launcher": "standard"}  # standard: torchrun on each machine, as miniddp launch runs
WITH_FILE = ("deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher")  # Accelerate's rule
# --8<-- [end:variables]


def world_size_from_env(environ=None) -> int | None:
    """torchrun's ``WORLD_SIZE`` (None outside torchrun: the Trainer checks again once it knows)."""
    size = (os.environ if environ is None else environ).get("WORLD_SIZE", "")
    return int(size) if size.isascii() and size.isdigit() and int(size) > 0 else None


# --8<-- [start:yaml]
def accelerate_variables(block, source: str) -> dict[str, str]:
    """The variables accelerate launch sets for a YAML's ``deepspeed_config`` block, each key checked first."""
    if not isinstance(block, dict):
        raise DeepSpeedConfigError(source, "deepspeed_config", f": {json.dumps(block, default=str)} must be a "
                                   "mapping of accelerate's DeepSpeed keys, e.g. `zero_stage: 2`")
    for key, value in block.items():
        where, shown = f"deepspeed_config.{key}", f": {json.dumps(value, default=str)}"
        if key not in VARIABLES and key not in ONLY:
            raise DeepSpeedConfigError(source, where, f"{shown}: not implemented in miniddp (it runs ZeRO stages "
                                       "0-2 on its own engine): delete it, or use accelerate launch with DeepSpeed")
        if "deepspeed_config_file" in block and key not in WITH_FILE:
            raise DeepSpeedConfigError(source, where, f"{shown}: with deepspeed_config_file the JSON says it "
                                       "(Accelerate refuses both): delete it here")
        if key in ONLY and value != ONLY[key]:
            raise DeepSpeedConfigError(source, where, f"{shown}: miniddp implements {json.dumps(ONLY[key])} only "
                                       "(no offloading, no stage 3, torchrun on each machine): set it so or delete it")
        if key == "zero_stage" and (type(value) is not int or value not in STAGES):
            raise DeepSpeedConfigError(source, where, f"{shown}: miniddp runs ZeRO stage 0, 1 or 2" +
                                       (" (stage 3, parameter sharding, is DeepSpeed's)" if value == 3 else ""))
        if key == "gradient_accumulation_steps" and (type(value) is not int or value < 1):
            raise DeepSpeedConfigError(source, where, f"{shown} must be a whole number >= 1")
        if key == "gradient_clipping" and (type(value) not in (int, float) or not value >= 0):
            raise DeepSpeedConfigError(source, where, f"{shown} must be a number >= 0 (0: no clipping)")
    if "deepspeed_config_file" in block:  # its keys now, before any process starts (the rest: the trainer's)
        check_file(*load_deepspeed_config(block["deepspeed_config_file"], f"{source}: deepspeed_config_file"))
    return {"ACCELERATE_USE_DEEPSPEED": "true",
            **{VARIABLES[k]: str(v).lower() if isinstance(v, bool) else str(v) for k, v in block.items()
               if k in VARIABLES}}
# --8<-- [end:yaml]


def check_file(config: dict, source: str) -> int:
    """What a DeepSpeed JSON says alone, before any trainer reads it: its keys, its optimizer and scheduler blocks,
    and fp16 with ZeRO stage 1 or 2 (refused by the trainer whatever its flags); its ZeRO stage."""
    stage = check_keys(config, source)
    read_blocks(config, source)
    if stage > 0 and config.get("fp16", {}).get("enabled") is True:
        raise DeepSpeedConfigError(source, "fp16.enabled", f"=true cannot run with ZeRO stage {stage}: "
                                   f"{FP16_WITH_ZERO}: set bf16.enabled, or stage 0")
    return stage


# --8<-- [start:accelerate]
def accelerate_deepspeed_config(environ=None) -> tuple[dict, str] | None:
    """The DeepSpeed config that ``accelerate launch`` passes in ``ACCELERATE_*`` variables, rebuilt as Accelerate's
    ``DeepSpeedPlugin.__post_init__`` does, and where it came from; None unless ``ACCELERATE_USE_DEEPSPEED``."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in TRUE_WORDS:
        return None
    if env.get(VARIABLES["deepspeed_config_file"], "none") != "none":  # the JSON says all
        return load_deepspeed_config(env[VARIABLES["deepspeed_config_file"]], VARIABLES["deepspeed_config_file"])
    source = "accelerate's deepspeed_config (ACCELERATE_* variables)"
    for key in ("zero3_init_flag", "zero3_save_16bit_model"):
        if env.get(VARIABLES[key], "false").lower() in TRUE_WORDS:
            raise DeepSpeedConfigError(source, key, f"is a ZeRO stage 3 setting; miniddp implements stages 0-2: "
                                       f"unset {VARIABLES[key]}")
    stage = env.get(VARIABLES["zero_stage"], "2")  # Accelerate's default stage
    config = {"zero_optimization": {"stage": int(stage) if stage.isascii() and stage.isdigit() else stage}}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):  # "auto" when unset: the trainer's
        given = env.get(VARIABLES[key], "auto")
        try:
            config[key] = "auto" if given == "auto" else int(given) if given.isdigit() else float(given)
        except ValueError:
            raise DeepSpeedConfigError(source, key, f"({VARIABLES[key]}={given!r}) must be a number") from None
    for place in ("optimizer", "param"):
        device = env.get(VARIABLES[f"offload_{place}_device"], "none")
        if device != "none":  # refused by check_keys, naming zero_optimization.offload_<place>.device
            config["zero_optimization"][f"offload_{place}"] = {"device": device}
    return config, source
# --8<-- [end:accelerate]


# --8<-- [start:settings]
def deepspeed_settings(config, world_size: int | None = None, environ=None) -> ZeroSettings:
    """What ``config.deepspeed`` (or accelerate launch's variables) asks for, checked against ``config``."""
    given = load_deepspeed_config(config.deepspeed) if config.deepspeed is not None else \
        accelerate_deepspeed_config(environ)
    if given is None:
        return ZeroSettings()
    ds_config, source = given
    args = {**{name: getattr(config, name) for name in MATCHED}, "world_size": world_size}
    zero = dataclasses.replace(zero_settings(ds_config, source, args), schedule=read_blocks(ds_config, source, args))
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
