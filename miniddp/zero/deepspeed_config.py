"""DeepSpeed's config names, read into what miniddp implements: ZeRO stage 0, 1 or 2 on miniddp's own engine.

What
    This is miniddp's ZeRO (``zero_ddp_optimizer.py``) read from DeepSpeed's names, not DeepSpeed.
    ``load_deepspeed_config(value)`` takes what ``TrainingArguments(deepspeed=...)`` takes: a JSON file's
    path, JSON text (or base64 of it) or a dict. ``check_keys`` accepts ``zero_optimization.stage`` 0, 1 or 2,
    the batch, clipping and precision keys, and the ZeRO keys that describe what miniddp does anyway
    (``ACCEPTED``); every other key is a ``DeepSpeedConfigError`` whose ``.key`` is its dotted path, in one line
    with the fix. ``zero_settings`` fills ``"auto"`` from the trainer's values and refuses a concrete value that
    disagrees with them, as Hugging Face's ``HfTrainerDeepSpeedConfig.trainer_config_process`` does
    (``transformers/integrations/deepspeed.py``).

Why
    Users arrive with a ``ds_config.json`` or an Accelerate YAML that says ``distributed_type: DEEPSPEED``; the
    stage is the part that teaches (what is sharded, what it costs). A key accepted and then not acted on
    (offloading, stage 3, DeepSpeed's own optimizer) would be a silent wrong answer: each is one line at
    config time, before any rank trains.

How DeepSpeed and Hugging Face differ
    DeepSpeed reads ~150 keys and builds its own engine, optimizer and loss scaler; Hugging Face fills the
    ``"auto"`` values and lets DeepSpeed clip (an absent ``gradient_clipping`` means no clipping there, whatever
    ``max_grad_norm`` says; here ``max_grad_norm`` applies). ``reduce_bucket_size`` counts elements there; here
    it is DDP's bucket cap at 4 bytes an element (``"auto"``, which Hugging Face fills with hidden_size², keeps
    ``ddp_bucket_cap_mb``). Like DeepSpeed, a JSON key written twice is refused.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from dataclasses import dataclass

STAGES = (0, 1, 2)
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
    "zero_optimization.stage": "0 (DDP), 1 (optimizer state sharded) or 2 (gradients too)",
    "zero_optimization.reduce_bucket_size": "DDP's bucket cap, elements x 4 bytes; auto: ddp_bucket_cap_mb",
    "zero_optimization.reduce_scatter": "true: each bucket is reduce-scattered",
    "zero_optimization.allgather_partitions": "true: the parameters are all-gathered after the step",
    "zero_optimization.allgather_bucket_size": "read, not used: the all-gather goes bucket by bucket",
    "zero_optimization.overlap_comm": "read, not used: buckets always go out during the backward",
    "zero_optimization.contiguous_gradients": "read, not used: a bucket is one contiguous buffer",
    "zero_optimization.offload_optimizer.device": "none: nothing is offloaded",
    "zero_optimization.offload_param.device": "none: nothing is offloaded",
    "zero_allow_untested_optimizer": "read, not used: ZeRO steps torch's AdamW",
    "steps_per_print": "read, not used: DeepSpeed's console log; the trainer logs every logging_steps",
    "wall_clock_breakdown": "false: no timing breakdown",
}
# --8<-- [end:accepted]
FIXES = {  # blocks users often bring, and what to do instead
    "optimizer": "is DeepSpeed's own optimizer: delete the block; the trainer steps torch's AdamW with "
                 "learning_rate and weight_decay (Hugging Face's Trainer does so when the block is absent)",
    "scheduler": "is DeepSpeed's own schedule: delete the block; the trainer decays the learning rate linearly "
                 "to 0 (Hugging Face's default)",
    "zero_optimization.offload_optimizer": "miniddp keeps the optimizer state on the device: set its device to "
                                           "none or delete the block (offloading is DeepSpeed's)",
    "zero_optimization.offload_param": "miniddp keeps the parameters on the device: set its device to none or "
                                       "delete the block (offloading is DeepSpeed's)",
}
BLOCKS = ("optimizer", "scheduler")  # named as a whole, not by their first key


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config miniddp cannot run as written; ``.key`` is the dotted path it is about (None: the
    config as a whole)."""

    def __init__(self, source: str, key: str | None, problem: str):
        where = f"{key}{'' if problem[:1] in '=:' else ' '}" if key else ""
        super().__init__(f"{source}: {where}{problem}")
        self.key = key


@dataclass(frozen=True)
class ZeroSettings:
    """What a DeepSpeed config asks of miniddp."""

    stage: int = 0  # 0: plain DDP; 1: the optimizer state sharded; 2: the gradients too
    bucket_cap_mb: float | None = None  # from zero_optimization.reduce_bucket_size; None: ddp_bucket_cap_mb's


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DeepSpeedConfigError("deepspeed", key, "is written twice in the JSON: keep one")
        seen[key] = value
    return seen


def load_deepspeed_config(value, source: str = "deepspeed") -> tuple[dict, str]:
    """(the config as a dict, how to name where it came from): a path, JSON text, base64 JSON, or a dict."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(value, dict):
        return copy.deepcopy(value), source
    if not isinstance(value, str):
        raise DeepSpeedConfigError(source, None, f"must be a JSON file's path, JSON text or a dict, not a "
                                   f"{type(value).__name__}")
    named = f"{source}={value!r}" if os.path.isfile(value) else source
    try:
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                config = json.load(f, object_pairs_hook=_no_duplicates)
        elif value.lstrip().startswith("{"):
            config = json.loads(value, object_pairs_hook=_no_duplicates)
        else:  # Hugging Face also takes base64 of the JSON
            config = json.loads(base64.urlsafe_b64decode(value.encode()).decode("utf-8"),
                                object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        if not (named != source or value.lstrip().startswith("{")):  # base64 of something else
            raise DeepSpeedConfigError(source, None, f"{value!r} is no file, JSON or base64 JSON: give the path of a "
                                       "DeepSpeed config file (ds_config.json)") from None
        raise DeepSpeedConfigError(named, None, f"is not JSON ({err.msg}, line {err.lineno}): a DeepSpeed config "
                                   'is a JSON object, e.g. {"zero_optimization": {"stage": 2}}') from None
    except (binascii.Error, UnicodeDecodeError, ValueError) as err:
        if isinstance(err, DeepSpeedConfigError):  # a key written twice
            raise DeepSpeedConfigError(named, err.key, "is written twice in the JSON: keep one") from None
        raise DeepSpeedConfigError(source, None, f"{value!r} is no file, JSON or base64 JSON: give the path of a "
                                   "DeepSpeed config file (ds_config.json)") from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(named, None, 'must be a JSON object, e.g. {"zero_optimization": {"stage": 2}}')
    return config, named


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
    if value == {} and any(name.startswith(key + ".") for name in ACCEPTED):
        return None  # an empty block of keys miniddp reads: DeepSpeed's defaults
    block = next((b for b in FIXES if key == b or key.startswith(b + ".")), None)
    if key.startswith("zero_optimization.offload_") and flat.get(f"{block}.device") == "none":
        return None  # offloading to "none": its other keys configure nothing
    if block is not None and key not in ACCEPTED:
        return FIXES[block]
    if key.startswith(("zero_optimization.stage3_", "zero_optimization.zero_")):
        return "is a ZeRO stage 3 (or ZeRO++) setting; miniddp implements stages 0-2: delete it"
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
        return (f"={json.dumps(value)}: ZeRO stage 3 (parameter sharding) is not implemented in miniddp: use 0, 1 "
                "or 2, or DeepSpeed itself") if value == 3 else f"={json.dumps(value)} must be 0, 1 or 2"
    return None


def check_keys(config: dict, source: str = "deepspeed") -> int:
    """Refuse the first key miniddp does not implement (its dotted path, the fix); return the ZeRO stage."""
    return _check_flat(_flat(config), source)


def _check_flat(flat: dict, source: str) -> int:
    for key in sorted(flat, key=lambda k: PRIORITY.index(k) if k in PRIORITY else len(PRIORITY)):
        why = _refusal(key, flat[key], flat)
        if why is not None:  # DeepSpeed's optimizer or schedule: the block is named, not its first key
            raise DeepSpeedConfigError(source, key.split(".")[0] if key.startswith(BLOCKS) else key, why)
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
        if value == "auto" and want is not None:
            flat[key] = want  # Hugging Face's fill_match
        elif value != "auto" and want is not None:
            kind = bool if key.endswith(".enabled") else int if key != "gradient_clipping" else (int, float)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)) or value != want:
                raise DeepSpeedConfigError(source, key, f"={json.dumps(value)} disagrees with {name} "
                                           f'({json.dumps(want)}): set it to "auto" (filled from the trainer, as '
                                           f"Hugging Face does) or to {json.dumps(want)}")
    stage = _check_flat(flat, source)  # with "auto" filled: fp16's loss-scale keys count once fp16 is on
    cap = flat.get("zero_optimization.reduce_bucket_size", "auto")
    if cap == "auto":
        return ZeroSettings(stage=stage)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 1:
        raise DeepSpeedConfigError(source, "zero_optimization.reduce_bucket_size", f"={json.dumps(cap)} must be a "
                                   'number of elements >= 1, or "auto" (ddp_bucket_cap_mb)')
    mb = cap * ELEMENT_BYTES / 2**20
    if args.get("ddp_bucket_cap_mb") not in (None, mb):
        raise DeepSpeedConfigError(source, "zero_optimization.reduce_bucket_size", f"={json.dumps(cap)} ({mb:g} MiB) "
                                   f"disagrees with ddp_bucket_cap_mb={args['ddp_bucket_cap_mb']!r}: set one of them "
                                   '(the other "auto" or unset)')
    return ZeroSettings(stage=stage, bucket_cap_mb=mb)
# --8<-- [end:matched]
