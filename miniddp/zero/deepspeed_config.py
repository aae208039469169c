"""DeepSpeed's config, read in one place: a file, JSON, base64 or a dict, or what ``accelerate launch`` passes.

What
    The one reader of a DeepSpeed config: it reads and checks (the keys, the ``"auto"`` values, the refusals);
    ``training/deepspeed_args.py`` only turns what it returns into the trainer's settings. ``load_deepspeed_config``
    takes what ``TrainingArguments(deepspeed=...)`` takes: a JSON file's path, JSON text (or base64 of it) or a
    dict. ``accelerate_deepspeed_config`` rebuilds the config that ``accelerate launch`` (and ``miniddp launch``)
    hands the processes in ``ACCELERATE_*`` variables, as Accelerate's ``DeepSpeedPlugin`` does;
    ``accelerate_variables`` turns a YAML's ``deepspeed_config`` block into those variables (``VARIABLES``:
    Accelerate's names, both ways), refusing a key miniddp does not implement before any process starts.
    ``check_file`` checks what a config says alone: its keys (``deepspeed_keys.check_keys``), its optimizer and
    scheduler blocks (``deepspeed_optim.read_blocks``), and fp16 with ZeRO stage 1 or 2, which the trainer
    refuses whatever its flags. ``read_deepspeed_config(config, source, args)`` checks it against the trainer's
    values (TrainingArguments' names, and ``world_size``): each ``"auto"`` filled, a value that disagrees
    refused, and returns the ``ZeroSettings``, DeepSpeed's schedule included. Every refusal is a
    ``DeepSpeedConfigError`` in one line naming the key.

Why
    Users arrive with a ``ds_config.json`` or an Accelerate YAML that says ``distributed_type: DEEPSPEED``. One
    reader means the launcher, ``miniddp config`` and the trainer refuse the same keys with the same words. A file
    that cannot be read as JSON (not UTF-8, nested past Python's recursion limit) is one line too, never a
    traceback.

How DeepSpeed and Hugging Face differ
    DeepSpeed reads its JSON itself; Hugging Face's ``HfTrainerDeepSpeedConfig`` fills the ``"auto"`` values first,
    and Accelerate's ``DeepSpeedPlugin`` builds a config from its variables when no file is given (ZeRO stage 2 by
    default). Like DeepSpeed, a JSON key written twice is refused. ``accelerate launch`` ignores DeepSpeed on the
    CPU (``use_cpu``); miniddp's ZeRO runs there on gloo.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import json
import os

from .deepspeed_keys import STAGES, DeepSpeedConfigError, ZeroSettings, check_keys, zero_settings
from .deepspeed_optim import read_blocks

MAX_DEPTH = 32  # DeepSpeed's deepest keys are a few levels down; far below Python's recursion limit
TRUE_WORDS = ("1", "true", "yes", "y", "t", "on")  # Accelerate's str_to_bool
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


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DeepSpeedConfigError("deepspeed", key, "is written twice in the JSON: keep one")
        seen[key] = value
    return seen


def _parse(text: str, named: str) -> dict:
    """JSON text as DeepSpeed reads it (a key written twice refused), every failure one line naming ``named``."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except DeepSpeedConfigError as err:  # before ValueError: _no_duplicates' own
        raise DeepSpeedConfigError(named, err.key, "is written twice in the JSON: keep one") from None
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(named, None, f"is not JSON ({err.msg}, line {err.lineno}): a DeepSpeed config "
                                   'is a JSON object, e.g. {"zero_optimization": {"stage": 2}}') from None
    except RecursionError:  # json's decoder recurses once per level
        raise DeepSpeedConfigError(named, None, f"nests deeper than {MAX_DEPTH} levels: a DeepSpeed config "
                                   "is a few levels deep") from None


def _too_deep(config) -> bool:
    """Whether ``config`` nests deeper than ``MAX_DEPTH`` (walked without recursion: deepcopy and _flat recurse)."""
    level = [config]
    for _ in range(MAX_DEPTH):
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else node)
                 if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


def load_deepspeed_config(value, source: str = "deepspeed") -> tuple[dict, str]:
    """(the config as a dict, how to name where it came from): a path, JSON text, base64 JSON, or a dict."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    not_json = "is no file, JSON or base64 JSON: give the path of a DeepSpeed config file (ds_config.json)"
    if isinstance(value, dict):
        config, named = value, source
    elif not isinstance(value, str):
        raise DeepSpeedConfigError(source, None, f"must be a JSON file's path, JSON text or a dict, not a "
                                   f"{type(value).__name__}")
    elif os.path.isfile(value):
        named = f"{source}={value!r}"
        try:
            with open(value, "rb") as f:
                raw = f.read()
        except OSError as err:
            raise DeepSpeedConfigError(named, None, f"cannot be read ({err.strerror or err})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:  # JSON files are UTF-8 (RFC 8259); DeepSpeed's json.load says the same
            raise DeepSpeedConfigError(named, None, f"is not UTF-8 text (byte {err.start}: {raw[err.start]:#04x}): "
                                       "save it as UTF-8") from err
        config = _parse(text, named)
    elif value.lstrip().startswith("{"):
        config, named = _parse(value, source), source
    else:  # Hugging Face also takes base64 of the JSON
        try:
            text = base64.urlsafe_b64decode(value.encode()).decode("utf-8")
        except (binascii.Error, ValueError):  # not base64, or not UTF-8 inside (UnicodeError is a ValueError)
            raise DeepSpeedConfigError(source, None, f"{value!r} {not_json}") from None
        if not text.lstrip().startswith("{"):  # base64 of something else
            raise DeepSpeedConfigError(source, None, f"{value!r} {not_json}")
        config, named = _parse(text, source), source
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(named, None, 'must be a JSON object, e.g. {"zero_optimization": {"stage": 2}}')
    if _too_deep(config):
        raise DeepSpeedConfigError(named, None, f"nests deeper than {MAX_DEPTH} levels: a DeepSpeed config is a "
                                   "few levels deep")
    return copy.deepcopy(config), named


def check_file(config: dict, source: str) -> int:
    """What a DeepSpeed JSON says alone, before any trainer reads it: its keys, its optimizer and scheduler blocks,
    and fp16 with ZeRO stage 1 or 2 (refused by the trainer whatever its flags); its ZeRO stage."""
    stage = check_keys(config, source)
    read_blocks(config, source)
    if stage > 0 and config.get("fp16", {}).get("enabled") is True:
        raise DeepSpeedConfigError(source, "fp16.enabled", f"=true cannot run with ZeRO stage {stage}: "
                                   f"{FP16_WITH_ZERO}: set bf16.enabled, or stage 0")
    return stage


def read_deepspeed_config(config: dict, source: str, args: dict) -> ZeroSettings:
    """``config`` checked against the trainer's values ``args`` (TrainingArguments' names, and ``world_size``: None
    while unknown), its ``"auto"`` values filled: the stage, the bucket cap and DeepSpeed's schedule."""
    return dataclasses.replace(zero_settings(config, source, args), schedule=read_blocks(config, source, args))


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
                                       "0-3 on its own engine): delete it, or use accelerate launch with DeepSpeed")
        if "deepspeed_config_file" in block and key not in WITH_FILE:
            raise DeepSpeedConfigError(source, where, f"{shown}: with deepspeed_config_file the JSON says it "
                                       "(Accelerate refuses both): delete it here")
        if key in ONLY and value != ONLY[key]:
            raise DeepSpeedConfigError(source, where, f"{shown}: miniddp implements {json.dumps(ONLY[key])} only "
                                       "(no offloading, no zero.Init or 16-bit save, torchrun on each machine): set it "
                                       "so or delete it")
        if key == "zero_stage" and (type(value) is not int or value not in STAGES):
            raise DeepSpeedConfigError(source, where, f"{shown}: miniddp runs ZeRO stage 0, 1, 2 or 3")
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
            raise DeepSpeedConfigError(source, key, f"is not implemented: stage 3 builds the model whole on every "
                                       f"rank, then shards it; final_model.pt is full: unset {VARIABLES[key]}")
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

