"""The keys of an FSDP config, read in one place: Transformers' ``fsdp_config``, Accelerate's YAML block, its variables.

What
    ``KEYS``: each key miniddp reads and what it does here (acted on, read and not needed, or refused).
    ``read_block(block, source, prefix)`` checks a block key by key and parses each value (``"true"`` is true, FSDP1's
    ``FULL_SHARD`` / ``SHARD_GRAD_OP`` are ``reshard_after_forward`` true / false, class names become a tuple);
    ``load_fsdp_config`` reads ``fsdp_config`` (a dict, JSON text or a JSON file's path, a key written twice refused);
    ``accelerate_fsdp_variables`` turns a YAML's ``fsdp_config`` block into the variables ``accelerate launch`` sets
    (``VARIABLES``: Accelerate's names), each key checked before any process starts. ``FSDPSettings`` is what the
    trainer runs (``fsdp_args.py`` builds it); every refusal is one ``FSDPConfigError`` line naming the key.

Why
    The launcher, ``miniddp config`` and the trainer refuse the same keys with the same words, as the DeepSpeed keys
    have one table (``zero/deepspeed_keys.py``).

How Accelerate differs
    ``FullyShardedDataParallelPlugin.__post_init__`` (``accelerate/utils/dataclasses.py``) reads the same variables
    and warns about the FSDP1 keys FSDP2 no longer needs; a key it does not know in the YAML is passed on and ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "y", "t", "on"), ("0", "false", "no", "n", "f", "off")
OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")  # Transformers'
POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")  # Accelerate's fsdp_auto_wrap_policy
STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # FSDP1's sharding strategy -> reshard_after_forward
OFFLOAD = "offloading is not implemented in miniddp (the shards stay on the device): set it false or delete it"
# --8<-- [start:keys]
# fsdp_config's keys (Transformers' names; Accelerate's YAML adds the fsdp_ prefix): what each does here
KEYS = {
    "version": "1 or 2: both run miniddp.fully_shard (FSDP2's API)",
    "reshard_after_forward": "true: free the gathered parameters after each unit's forward (full_shard); false: keep "
                             "them until its backward (shard_grad_op)",
    "sharding_strategy": "FSDP1's name: FULL_SHARD (reshard after forward) or SHARD_GRAD_OP (keep)",
    "auto_wrap_policy": "Accelerate's: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP (the root alone)",
    "transformer_layer_cls_to_wrap": "class names: each module of one of them is a unit (none: _no_split_modules)",
    "min_num_params": "size-based wrap: each module holding more parameters than this is a unit",
    "state_dict_type": "FULL_STATE_DICT or SHARDED_STATE_DICT: checkpoints hold full tensors either way",
    "offload_params": "false only", "cpu_offload": "false only",
    "activation_checkpointing": "false only: use gradient_checkpointing=True",
    "backward_prefetch": "read, not used: the next unit's all-gather is posted in the recorded order",
    "forward_prefetch": "read, not used: the next unit's all-gather is posted in the recorded order",
    "limit_all_gathers": "read, not used: one all-gather ahead at most", "use_orig_params": "read, not used: FSDP2 "
                         "always keeps the original parameters", "sync_module_states": "read, not used: fully_shard "
                         "broadcasts rank 0's weights", "cpu_ram_efficient_loading": "read, not used: every rank "
                         "builds the model, then rank 0's weights are broadcast",
    "xla": "false only", "xla_fsdp_v2": "false only", "xla_fsdp_grad_ckpt": "false only",
}
# --8<-- [end:keys]
BOOLEANS = ("reshard_after_forward", "offload_params", "cpu_offload", "activation_checkpointing", "forward_prefetch",
            "limit_all_gathers", "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading", "xla",
            "xla_fsdp_v2", "xla_fsdp_grad_ckpt")
FALSE_ONLY = {"offload_params": OFFLOAD, "cpu_offload": OFFLOAD, "xla": "miniddp runs no XLA: delete it",
              "xla_fsdp_v2": "miniddp runs no XLA: delete it", "xla_fsdp_grad_ckpt": "miniddp runs no XLA: delete it",
              "activation_checkpointing": "set gradient_checkpointing=True instead (the model's "
                                          "gradient_checkpointing_enable)"}
# --8<-- [start:variables]
# Accelerate's YAML key -> the variable accelerate launch passes it in (accelerate/utils/launch.py), read back by
# FullyShardedDataParallelPlugin; the key without fsdp_ is fsdp_config's
VARIABLES = {f"fsdp_{key}": f"FSDP_{key.upper()}" for key in (
    "version", "reshard_after_forward", "sharding_strategy", "offload_params", "auto_wrap_policy", "min_num_params",
    "state_dict_type", "backward_prefetch", "forward_prefetch", "use_orig_params", "cpu_ram_efficient_loading",
    "sync_module_states", "activation_checkpointing")} | {"fsdp_transformer_layer_cls_to_wrap":
                                                         "FSDP_TRANSFORMER_CLS_TO_WRAP"}
# --8<-- [end:variables]


class FSDPConfigError(ValueError):
    """An FSDP setting miniddp cannot run as written; ``.key`` names it (None: the combination)."""

    def __init__(self, source: str, key: str | None, problem: str):
        where = f"{key}{'' if problem[:1] in '=:' else ' '}" if key else ""
        super().__init__(f"{source}: {where}{problem}")
        self.key, self.source = key, source


@dataclass(frozen=True)
class FSDPSettings:
    """How the trainer shards the model with ``fully_shard`` (``enabled`` False: DDP)."""

    enabled: bool = False
    reshard_after_forward: bool = True  # full_shard / ZeRO-3; False: shard_grad_op
    wrap: str = "none"  # "transformer" (by class name), "size" (min_num_params), "deepspeed", "none" (the root only)
    layer_classes: tuple = ()  # "transformer": class names; (): the model's _no_split_modules
    min_num_params: int = 0  # "size": a module with more parameters than this is a unit
    source: str = ""  # where it was asked for, for messages


def _bool(value, source, key):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise FSDPConfigError(source, key, f"={json.dumps(value, default=str)} must be true or false")


def _whole(value, source, key, low=0):
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise FSDPConfigError(source, key, f"={json.dumps(value, default=str)} must be a whole number >= {low}")
    return value


# --8<-- [start:read_block]
def read_block(block: dict, source: str, prefix: str = "") -> dict:
    """``block`` (fsdp_config's keys, ``prefix`` stripped) checked key by key; the values, parsed."""
    out = {}
    for given, value in block.items():
        key = given[len(prefix):] if prefix and given.startswith(prefix) else given
        named = given  # the user's spelling, with or without the prefix
        if key not in KEYS:
            raise FSDPConfigError(source, named, f"is not an FSDP setting miniddp reads: delete it (it reads "
                                  f"{', '.join(KEYS)}{', each with fsdp_ before it' if prefix else ''})")
        if key in out:
            raise FSDPConfigError(source, named, "is given twice (with and without fsdp_): keep one")
        if key in ("sharding_strategy", "reshard_after_forward") and isinstance(value, str) and \
                value.lower() not in TRUE_WORDS + FALSE_WORDS:  # FSDP1's words
            if value.upper() not in STRATEGIES:
                raise FSDPConfigError(source, named, f"={json.dumps(value)}: miniddp shards over one dimension: "
                                      "FULL_SHARD or SHARD_GRAD_OP (NO_SHARD is DDP; HYBRID_* are not implemented)")
            value = STRATEGIES[value.upper()]
        elif key == "sharding_strategy":
            raise FSDPConfigError(source, named, f"={json.dumps(value, default=str)} must be FULL_SHARD or "
                                  "SHARD_GRAD_OP")
        if key in BOOLEANS:
            value = _bool(value, source, named)
        if key in FALSE_ONLY and value:
            raise FSDPConfigError(source, named, f"=true: {FALSE_ONLY[key]}")
        if key == "version" and _whole(value, source, named) not in (1, 2):
            raise FSDPConfigError(source, named, f"={json.dumps(value)} must be 1 or 2")
        if key in ("version", "min_num_params"):
            value = _whole(value, source, named)
        if key == "auto_wrap_policy" and (not isinstance(value, str) or value.upper() not in POLICIES):
            raise FSDPConfigError(source, named, f"={json.dumps(value, default=str)} must be one of "
                                  f"{', '.join(POLICIES)}")
        if key == "state_dict_type" and str(value).upper() not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            raise FSDPConfigError(source, named, f"={json.dumps(value, default=str)}: FULL_STATE_DICT or "
                                  "SHARDED_STATE_DICT (both saved full here); FSDP2 has no LOCAL_STATE_DICT")
        if key == "transformer_layer_cls_to_wrap":
            names = value.split(",") if isinstance(value, str) else value
            if not isinstance(names, (list, tuple)) or not names or not all(
                    isinstance(n, str) and n.strip().isidentifier() for n in names):
                raise FSDPConfigError(source, named, f"={json.dumps(value, default=str)} must be class names, "
                                      'e.g. ["GPT2Block"] (or "GPT2Block,GPT2MLP")')
            value = tuple(n.strip() for n in names)
        out[key] = value.upper() if key in ("auto_wrap_policy", "state_dict_type") else value
    return out
# --8<-- [end:read_block]


def load_fsdp_config(value) -> dict:
    """``fsdp_config`` as a dict: None, a dict, JSON text, or a JSON file's path (a key written twice refused)."""
    def once(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise FSDPConfigError("fsdp_config", k, "is written twice in the JSON: keep one")
            seen[k] = v
        return seen

    if value is None or isinstance(value, dict):
        return dict(value or {})
    if not isinstance(value, str):
        raise FSDPConfigError("fsdp_config", None, f"must be a JSON file's path, JSON text or a dict, not a "
                              f"{type(value).__name__}")
    named, text = "fsdp_config", value
    if not value.lstrip().startswith("{"):
        if not os.path.isfile(value):
            raise FSDPConfigError("fsdp_config", None, f"{value!r} is no file and no JSON object: give the path "
                                  'of an FSDP config JSON, or JSON text: {"transformer_layer_cls_to_wrap": ["Block"]}')
        named = f"fsdp_config={value!r}"
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        loaded = json.loads(text, object_pairs_hook=once)
    except json.JSONDecodeError as err:
        raise FSDPConfigError(named, None, f"is not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(loaded, dict):
        raise FSDPConfigError(named, None, "must be a JSON object of FSDP settings")
    return loaded


def accelerate_fsdp_variables(block, source: str) -> dict[str, str]:
    """The variables accelerate launch sets for a YAML's ``fsdp_config`` block, each key checked first."""
    if not isinstance(block, dict):
        raise FSDPConfigError(source, "fsdp_config", "must be a mapping of Accelerate's fsdp_* keys")
    unprefixed = [k for k in block if not str(k).startswith("fsdp_")]
    if unprefixed:
        raise FSDPConfigError(source, f"fsdp_config.{unprefixed[0]}", "is not one of Accelerate's keys (they start "
                              "with fsdp_, e.g. fsdp_auto_wrap_policy)")
    conf = read_block(block, f"{source}: fsdp_config", prefix="fsdp_")
    policy = conf.get("auto_wrap_policy", "NO_WRAP")
    for key, wanted in (("transformer_layer_cls_to_wrap", "TRANSFORMER_BASED_WRAP"),
                        ("min_num_params", "SIZE_BASED_WRAP")):
        if key in conf and policy != wanted:
            raise FSDPConfigError(f"{source}: fsdp_config", f"fsdp_{key}", f"is read only with fsdp_auto_wrap_policy: "
                                  f"{wanted} (here {policy}): delete it or change the policy")
    if "fsdp_version" not in block:  # Accelerate's default is FSDP1; both run fully_shard here: said explicitly
        block = {**block, "fsdp_version": 2}
    return {"ACCELERATE_USE_FSDP": "true", **{VARIABLES[k]: _variable(v) for k, v in block.items() if k in VARIABLES}}


def _variable(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


