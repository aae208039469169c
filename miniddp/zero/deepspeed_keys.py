"""DeepSpeed's keys, checked against what miniddp implements: ZeRO stage 0, 1 or 2 on its own engine, 3 on fully_shard.

What
    The key table of ``deepspeed_config.py``, the one reader of a DeepSpeed config. This is miniddp's ZeRO
    (``reduce_scatter_optimizer.py``) read from DeepSpeed's names, not DeepSpeed. ``check_keys`` accepts
    ``zero_optimization.stage`` 0, 1, 2 or 3, the batch, clipping and precision keys, and the ZeRO keys that describe
    what miniddp does anyway (``ACCEPTED``); every other key is a ``DeepSpeedConfigError`` whose ``.key`` is its
    dotted path, in one line with the fix. ``zero_settings`` fills ``"auto"`` from the trainer's values and refuses
    a concrete value that disagrees with them, as Hugging Face's ``HfTrainerDeepSpeedConfig.trainer_config_process``
    does (``transformers/integrations/deepspeed.py``); a value no trainer setting could match (NaN, infinity, a
    negative or fractional count) is refused as such first (``number_problem``; 1.0 counts as 1). The
    ``optimizer`` and ``scheduler`` blocks are ``deepspeed_optim.py``'s.

Why
    The stage is the part that teaches (what is sharded, what it costs). A key accepted and then not acted on
    (offloading, ZeRO++, an optimizer other than AdamW) would be a silent wrong answer: each is one line at
    config time, before any rank trains.

How DeepSpeed and Hugging Face differ
    DeepSpeed reads ~150 keys and builds its own engine, optimizer and loss scaler; Hugging Face fills the
    ``"auto"`` values and lets DeepSpeed clip (an absent ``gradient_clipping`` means no clipping there, whatever
    ``max_grad_norm`` says; here ``max_grad_norm`` applies). ``reduce_bucket_size`` counts elements there; here
    it is DDP's bucket cap at 4 bytes an element (``"auto"``, which Hugging Face fills with hidden_size², keeps
    ``ddp_bucket_cap_mb``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

STAGES = (0, 1, 2, 3)
ELEMENT_BYTES = 4  # reduce_bucket_size counts fp32 gradient elements; DDP's cap counts MiB
# --8<-- [start:accepted]
# What miniddp reads. "matched": "auto" or equal to the trainer's value (Hugging Face's trainer_config_process).
ACCEPTED = {
    "train_micro_batch_size_per_gpu": "matched: per_device_train_batch_size",
    "gradient_accumulation_steps": "matched: gradient_accumulation_steps",
    "train_batch_size": "matched: per_device_train_batch_size x world size x gradient_accumulation_steps",
    "gradient_clipping": "matched: max_grad_norm (0: no clipping)",
    "fp16.enabled": "matched: mixed_precision fp16 (its loss-scale keys only while fp16 is off)",
    "bf16.enabled": "matched: mixed_precision bf16",
    "zero_optimization.stage": "0 (DDP), 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too: "
                               "miniddp.fully_shard, units per block, see docs/trainer.md)",
    "zero_optimization.reduce_bucket_size": "DDP's bucket cap, elements x 4 bytes; auto: ddp_bucket_cap_mb (stage 3: "
                                            "read, not used: a unit is FSDP's bucket)",
    "zero_optimization.reduce_scatter": "true: each bucket is reduce-scattered",
    "zero_optimization.allgather_partitions": "true: the parameters are all-gathered after the step",
    "zero_optimization.allgather_bucket_size": "read, not used: the all-gather goes bucket by bucket",
    "zero_optimization.overlap_comm": "read, not used: buckets always go out during the backward",
    "zero_optimization.contiguous_gradients": "read, not used: a bucket is one contiguous buffer",
    "zero_optimization.offload_optimizer.device": "none: nothing is offloaded",
    "zero_optimization.offload_param.device": "none: nothing is offloaded",
    "zero_optimization.sub_group_size": "read, not used: the optimizer steps each rank's shards at once",
    "zero_optimization.stage3_prefetch_bucket_size": "read, not used: the next unit's gather is posted in the recorded "
                                                     "order, one unit ahead",
    "zero_optimization.stage3_param_persistence_threshold": "read, not used: every parameter of a unit is sharded",
    "zero_optimization.stage3_max_live_parameters": "read, not used: one unit (and the next, prefetched) is gathered",
    "zero_optimization.stage3_max_reuse_distance": "read, not used: a unit is freed after its forward",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "read, not used: final_model.pt is always gathered "
                                                                   "full, in the parameters' dtype",
    "zero_allow_untested_optimizer": "read, not used: ZeRO steps torch's AdamW",
    "steps_per_print": "read, not used: DeepSpeed's console log; the trainer logs every logging_steps",
    "wall_clock_breakdown": "false: no timing breakdown",
}
# --8<-- [end:accepted]
FIXES = {  # blocks users often bring, and what to do instead
    "zero_optimization.offload_optimizer": "miniddp keeps the optimizer state on the device: set its device to "
                                           "none or delete the block (offloading is DeepSpeed's)",
    "zero_optimization.offload_param": "miniddp keeps the parameters on the device: set its device to none or "
                                       "delete the block (offloading is DeepSpeed's)",
}
BLOCKS = ("optimizer", "scheduler")  # read by deepspeed_optim.py (deepspeed_config.py reads both)
# the range of a concrete value, checked before it is compared: (smallest, a whole number?)
RANGES = {"train_micro_batch_size_per_gpu": (1, True), "gradient_accumulation_steps": (1, True),
          "train_batch_size": (1, True), "gradient_clipping": (0, False),
          "zero_optimization.reduce_bucket_size": (1, False)}


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config miniddp cannot run as written; ``.key`` is the dotted path it is about (None: the
    config as a whole), ``.source`` where the config came from (a file: its path), ``.disagrees_with`` the
    trainer's setting a valid value contradicts (None: the value, or the key, is refused by itself)."""

    def __init__(self, source: str, key: str | None, problem: str, disagrees_with: str | None = None):
        where = f"{key}{'' if problem[:1] in '=:' else ' '}" if key else ""
        super().__init__(f"{source}: {where}{problem}")
        self.key, self.source, self.disagrees_with = key, source, disagrees_with


@dataclass(frozen=True)
class ZeroSettings:
    """What a DeepSpeed config asks of miniddp."""

    stage: int = 0  # 0: plain DDP; 1: the optimizer state sharded; 2: the gradients too; 3: fully_shard
    bucket_cap_mb: float | None = None  # from zero_optimization.reduce_bucket_size; None: ddp_bucket_cap_mb's
    schedule: object = None  # deepspeed_optim.Schedule, from the scheduler block; None: the trainer's linear decay


def number_problem(value, low: float, whole: bool) -> str | None:
    """Why ``value`` is no number >= ``low`` (whole: an integral float is its int, as 1.0 == 1), NaN and infinity
    being none; None: it is one. The text follows the key's name, as DeepSpeedConfigError writes it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low or \
            (whole and value != int(value)):
        return f"={json.dumps(value, default=str)} must be a {'whole' if whole else 'finite'} number >= {low:g}"
    return None


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty block stays as itself."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


PRIORITY = ("zero_optimization.stage", "zero_optimization.offload_optimizer.device",
            "zero_optimization.offload_param.device")  # said first: the refusal that matters most


def _refusal(key: str, value, flat: dict) -> str | None:
    """Why ``key`` (its value ``value``) cannot run here, with the fix; None when it can."""
    if key.split(".")[0] in BLOCKS:
        return None  # deepspeed_optim.py's
    if value == {} and any(name.startswith(key + ".") for name in ACCEPTED):
        return None  # an empty block of keys miniddp reads: DeepSpeed's defaults
    block = next((b for b in FIXES if key == b or key.startswith(b + ".")), None)
    if key.startswith("zero_optimization.offload_") and flat.get(f"{block}.device") == "none":
        return None  # offloading to "none": its other keys configure nothing
    if block is not None and key not in ACCEPTED:
        return FIXES[block]
    if key.startswith(("zero_optimization.stage3_", "zero_optimization.zero_")) and key not in ACCEPTED:
        return "is a ZeRO++ (or stage 3 tuning) setting miniddp does not implement: delete it"
    if key.startswith("fp16.") and flat.get("fp16.enabled") is not True:
        return None  # a loss scaler that is off configures nothing
    if key not in ACCEPTED:
        return "is a DeepSpeed setting miniddp does not implement: delete it (what miniddp reads: docs/trainer.md)"
    wanted = {"zero_optimization.reduce_scatter": True, "zero_optimization.allgather_partitions": True,
              "wall_clock_breakdown": False, "zero_optimization.offload_optimizer.device": "none",
              "zero_optimization.offload_param.device": "none"}
    if key in wanted and value != wanted[key]:
        return f"={json.dumps(value)}: {FIXES.get(key.rpartition('.')[0]) or 'set it to ' + json.dumps(wanted[key])}"
    if key == "zero_optimization.stage" and (value not in STAGES or type(value) is not int):
        return f"={json.dumps(value)} must be 0, 1, 2 or 3"
    return None


def check_keys(config: dict, source: str = "deepspeed") -> int:
    """Refuse the first key miniddp does not implement (its dotted path, the fix); return the ZeRO stage."""
    return _check_flat(_flat(config), source)


def _check_flat(flat: dict, source: str) -> int:
    for key in sorted(flat, key=lambda k: PRIORITY.index(k) if k in PRIORITY else len(PRIORITY)):
        why = _refusal(key, flat[key], flat)
        if why is not None:
            raise DeepSpeedConfigError(source, key, why)
    return flat.get("zero_optimization.stage", 0)


# --8<-- [start:matched]
def _trainer_value(key: str, args: dict):
    """The trainer's value that DeepSpeed's ``key`` must agree with, and its name (None: not known yet)."""
    world, per_device, steps = args.get("world_size"), args["per_device_train_batch_size"], \
        args["gradient_accumulation_steps"]
    return {
        "train_micro_batch_size_per_gpu": (args["per_device_train_batch_size"], "per_device_train_batch_size"),
        "gradient_accumulation_steps": (args["gradient_accumulation_steps"], "gradient_accumulation_steps"),
        "train_batch_size": (world and world * per_device * steps,
                             f"world_size {world} x per_device_train_batch_size x gradient_accumulation_steps"),
        "gradient_clipping": (args["max_grad_norm"], "max_grad_norm"),
        "fp16.enabled": (args["mixed_precision"] == "fp16", f"mixed_precision={args['mixed_precision']!r}"),
        "bf16.enabled": (args["mixed_precision"] == "bf16", f"mixed_precision={args['mixed_precision']!r}"),
    }[key]


def zero_settings(config: dict, source: str, args: dict) -> ZeroSettings:
    """``config`` checked, its ``"auto"`` values taken from ``args`` (TrainingArguments' names, and
    ``world_size``: None while unknown) and its concrete values compared with them."""
    flat = _flat(config)
    for key in [k for k in ACCEPTED if k in flat and ACCEPTED[k].startswith("matched")]:
        value, (want, name) = flat[key], _trainer_value(key, args)
        if value == "auto":
            flat[key] = value if want is None else want  # Hugging Face's fill_match
            continue
        problem = (None if isinstance(value, bool) else f"={json.dumps(value, default=str)} must be true or false") \
            if key.endswith(".enabled") else number_problem(value, *RANGES[key])  # NaN is no disagreement
        if problem:
            raise DeepSpeedConfigError(source, key, f'{problem}, or "auto" (the trainer\'s)')
        if want is not None and value != want:
            raise DeepSpeedConfigError(source, key, f"={json.dumps(value)} disagrees with {name} "
                                       f'({json.dumps(want)}): set it to "auto" (filled from the trainer, as '
                                       f"Hugging Face does) or to {json.dumps(want)}", disagrees_with=name)
    stage = _check_flat(flat, source)  # with "auto" filled: fp16's loss-scale keys count once fp16 is on
    cap = flat.get("zero_optimization.reduce_bucket_size", "auto")
    if cap == "auto" or stage == 3:  # stage 3 runs fully_shard: a unit is its bucket
        return ZeroSettings(stage=stage)
    if number_problem(cap, *RANGES["zero_optimization.reduce_bucket_size"]):
        raise DeepSpeedConfigError(source, "zero_optimization.reduce_bucket_size", number_problem(
            cap, *RANGES["zero_optimization.reduce_bucket_size"]) + ' elements, or "auto" (ddp_bucket_cap_mb)')
    mb = cap * ELEMENT_BYTES / 2**20
    if args.get("ddp_bucket_cap_mb") not in (None, mb):
        raise DeepSpeedConfigError(source, "zero_optimization.reduce_bucket_size", f"={json.dumps(cap)} ({mb:g} MiB) "
                                   f"disagrees with ddp_bucket_cap_mb={args['ddp_bucket_cap_mb']!r}: set one of them "
                                   '(the other "auto" or unset)', disagrees_with="ddp_bucket_cap_mb")
    return ZeroSettings(stage=stage, bucket_cap_mb=mb)
# --8<-- [end:matched]
