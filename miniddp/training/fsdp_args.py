"""The ``fsdp`` and ``fsdp_config`` fields of ``TrainingConfig`` (or Accelerate's ``FSDP_*`` variables) turned into
how the trainer runs ``miniddp.fully_shard``: which modules become units, and whether they reshard after forward.

What
    ``fsdp_settings(config, zero_stage, environ)`` returns ``FSDPSettings``. Its sources, first found wins: the
    ``fsdp`` field (Transformers' words: ``full_shard`` = ``reshard_after_forward=True``, ZeRO-3; ``shard_grad_op`` =
    ``False``, ZeRO-2-like; ``auto_wrap`` = units by class name or by size, else the root alone is one unit) with
    ``fsdp_config`` (a JSON file, JSON text or a dict, with or without the ``fsdp_`` prefix); DeepSpeed's
    ``zero_optimization.stage: 3``; the ``FSDP_*`` variables ``accelerate launch`` (and ``miniddp launch``) set with
    ``ACCELERATE_USE_FSDP=true``. ``fsdp_keys.read_block`` is the one reader of the keys, for all three. Every
    refusal is one ``FSDPConfigError`` line naming the key, when the config is built, before any process group
    exists: offloading, hybrid sharding, fp16 (a ``GradScaler`` would find an inf in one rank's shard only: that rank
    alone would skip the step), a comm hook or ``ddp_bucket_cap_mb`` (a unit is FSDP's bucket), ``torch_compile``
    (dynamo does not trace fully_shard's hooks here), and DeepSpeed at the same time.

Why
    A key accepted and then not acted on is a silent wrong answer: ``transformer_layer_cls_to_wrap`` without
    ``auto_wrap`` wraps nothing in Transformers, and ``full_shard`` with ``reshard_after_forward: false`` says two
    things; each is one line here.

How Hugging Face and Accelerate differ
    ``TrainingArguments._process_fsdp_args`` builds the arguments of Accelerate's ``FullyShardedDataParallelPlugin``,
    which reads the same ``FSDP_*`` variables when none are given, and runs torch's FSDP1 by default (``version: 1``)
    or FSDP2; both versions run miniddp's ``fully_shard`` (FSDP2's API) here. With ``version: 2`` Transformers passes
    ``reshard_after_forward`` from ``fsdp_config`` (default false) whatever the word; here the word decides. Accelerate
    saves ``SHARDED_STATE_DICT`` by default with FSDP2; miniddp's checkpoints always hold full tensors.
"""

from __future__ import annotations

import os

from .fsdp_keys import (
    OFFLOAD,
    OPTIONS,
    TRUE_WORDS,
    VARIABLES,
    FSDPConfigError,
    FSDPSettings,
    load_fsdp_config,
    read_block,
)


def options_of(fsdp) -> list[str]:
    """The ``fsdp`` field's words: a string of words, a list of them, True (full_shard) or ""/None/False (off)."""
    if fsdp is True:
        return ["full_shard"]
    if not fsdp:
        return []
    words = fsdp.split() if isinstance(fsdp, str) else fsdp
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise FSDPConfigError("fsdp", None, f"={fsdp!r} must be words like \"full_shard auto_wrap\"")
    for word in words:
        if word not in OPTIONS:
            raise FSDPConfigError("fsdp", None, f"={fsdp!r}: {word!r} is not one of {', '.join(OPTIONS)}")
    return list(words)


# --8<-- [start:transformers]
def transformers_settings(fsdp, fsdp_config) -> FSDPSettings:
    """TrainingArguments' ``fsdp`` words and ``fsdp_config``, as ``_process_fsdp_args`` reads them."""
    words, block = options_of(fsdp), load_fsdp_config(fsdp_config)
    source = f"fsdp={' '.join(words)!r}"
    if not words:
        if block:
            raise FSDPConfigError("fsdp_config", None, "is read only with fsdp set: add fsdp=\"full_shard auto_wrap\"")
        return FSDPSettings()
    if "offload" in words:
        raise FSDPConfigError(source, None, f"'offload': {OFFLOAD.replace('set it false or delete it', 'remove it')}")
    if any(w.startswith("hybrid") for w in words):
        raise FSDPConfigError(source, None, "hybrid sharding (a 2-D mesh) is not implemented: use full_shard")
    if "full_shard" in words and "shard_grad_op" in words:
        raise FSDPConfigError(source, None, "full_shard and shard_grad_op exclude each other: keep one")
    conf = read_block(block, "fsdp_config", prefix="fsdp_")
    if "auto_wrap_policy" in conf or "sharding_strategy" in conf:
        raise FSDPConfigError("fsdp_config", next(k for k in ("auto_wrap_policy", "sharding_strategy") if k in conf),
                              "is Accelerate's YAML key; with TrainingArguments the fsdp words say it "
                              "(auto_wrap, full_shard, shard_grad_op)")
    said = True if "full_shard" in words else False if "shard_grad_op" in words else None
    reshard = conf.get("reshard_after_forward", True if said is None else said)
    if said is not None and reshard != said:
        raise FSDPConfigError("fsdp_config", "reshard_after_forward", f"={str(reshard).lower()} contradicts "
                              f"{source}: full_shard reshards, shard_grad_op keeps: say it once")
    classes, size = conf.get("transformer_layer_cls_to_wrap", ()), conf.get("min_num_params", 0)
    if "auto_wrap" not in words:
        if classes or size:
            raise FSDPConfigError("fsdp_config", "transformer_layer_cls_to_wrap" if classes else "min_num_params",
                                  f"is read only with auto_wrap: add it, fsdp=\"{' '.join(words)} auto_wrap\"")
        return FSDPSettings(True, reshard, "none", source=source)
    if classes and size:
        raise FSDPConfigError("fsdp_config", None, "min_num_params and transformer_layer_cls_to_wrap exclude each "
                              "other (as in Transformers): keep one")
    return FSDPSettings(True, reshard, "size" if size else "transformer", classes, size, source)
# --8<-- [end:transformers]


def accelerate_block_settings(conf: dict, source: str) -> FSDPSettings:
    """A parsed Accelerate ``fsdp_config`` (or its variables): its wrap policy and resharding."""
    reshard = conf.get("reshard_after_forward", conf.get("sharding_strategy", True))
    policy = conf.get("auto_wrap_policy", "NO_WRAP")
    if policy == "TRANSFORMER_BASED_WRAP":
        return FSDPSettings(True, reshard, "transformer", conf.get("transformer_layer_cls_to_wrap", ()), source=source)
    if policy == "SIZE_BASED_WRAP":
        return FSDPSettings(True, reshard, "size", min_num_params=conf.get("min_num_params", 0), source=source)
    return FSDPSettings(True, reshard, "none", source=source)


def accelerate_fsdp_settings(environ=None) -> FSDPSettings | None:
    """What ``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables ask for, as Accelerate's plugin reads them; None
    unless ``ACCELERATE_USE_FSDP`` is true. A variable the chosen policy does not read is not read."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() not in TRUE_WORDS:
        return None
    source = "accelerate's fsdp_config (FSDP_* variables)"
    block = {key: env[name] for key, name in VARIABLES.items() if name in env}
    policy = str(block.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        block.pop("fsdp_transformer_layer_cls_to_wrap", None)
    if policy != "SIZE_BASED_WRAP":
        block.pop("fsdp_min_num_params", None)  # accelerate launch always sets it (1e8 by default)
    if "fsdp_reshard_after_forward" in block:
        block.pop("fsdp_sharding_strategy", None)  # accelerate launch always sets both
    return accelerate_block_settings(read_block(block, source, prefix="fsdp_"), source)


# --8<-- [start:settings]
def fsdp_settings(config, zero_stage: int = 0, environ=None) -> FSDPSettings:
    """What ``config`` (``fsdp``/``fsdp_config``, DeepSpeed's stage 3, or accelerate launch's variables) asks of
    ``fully_shard``, and the refusal of the trainer's settings it cannot run with."""
    env = os.environ if environ is None else environ
    settings = transformers_settings(config.fsdp, config.fsdp_config)
    deepspeed = config.deepspeed is not None or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in TRUE_WORDS
    if settings.enabled and deepspeed:
        raise FSDPConfigError(settings.source, None, "and deepspeed at the same time: choose one (ZeRO stage 3 in "
                              "the DeepSpeed config runs fully_shard too)")
    if not settings.enabled and zero_stage == 3:
        settings = FSDPSettings(True, True, "deepspeed", source="ZeRO stage 3 (deepspeed)")
    if not settings.enabled and not deepspeed:
        settings = accelerate_fsdp_settings(env) or settings
    if not settings.enabled:
        return settings
    where = settings.source
    if config.mixed_precision == "fp16":
        raise FSDPConfigError(where, None, "cannot run with mixed_precision='fp16': a GradScaler would find an inf "
                              "in one rank's shard only, and that rank alone would skip the step: use bf16")
    if config.ddp_comm_hook != "no":
        raise FSDPConfigError(where, None, f"cannot run with ddp_comm_hook={config.ddp_comm_hook!r}: a unit's "
                              "gradients are reduce-scattered, which a DDP hook cannot replace: use no")
    if config.ddp_bucket_cap_mb is not None:
        raise FSDPConfigError(where, None, f"cannot run with ddp_bucket_cap_mb={config.ddp_bucket_cap_mb!r}: a "
                              "unit is FSDP's bucket (choose units with auto_wrap): leave it unset")
    if config.torch_compile:
        raise FSDPConfigError(where, None, "cannot run with torch_compile: dynamo does not trace fully_shard's "
                              "hooks here: set torch_compile=False")
    return settings
# --8<-- [end:settings]
