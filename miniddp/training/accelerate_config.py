"""Accelerate's config file, as ``miniddp launch`` reads it: every key checked, honoured or said to be ignored.

What
    ``read_config(path)`` reads the YAML that ``accelerate config`` writes and checks it key by key:
    unknown keys, other engines (DeepSpeed, FSDP), numbers out of range, a key given twice (with
    its two line numbers) and a file that is not text are one ``LaunchError`` line each.
    ``HONOURED`` lists the keys acted on as ``accelerate launch`` does (``gpu_ids`` sets
    ``CUDA_VISIBLE_DEVICES``, ``num_cpu_threads_per_process`` sets ``OMP_NUM_THREADS``,
    ``rdzv_backend``, ``debug``); ``ignored_settings`` names, once, the keys it reads and does not
    act on (``dynamo_config``, the TPU keys...).

Why
    A setting that is accepted and then dropped without a word is a silent wrong answer: the user
    believes the job runs on GPUs 2 and 3, or with 4 threads per process. YAML itself keeps the
    last of two equal keys, so a file edited twice silently means its second half.

How Accelerate differs
    ``accelerate launch`` reads the same file through its own dataclasses
    (``accelerate/commands/config/config_args.py``) and ignores unknown keys it does not use.
"""

from __future__ import annotations

import json
import os

import yaml

KNOWN_KEYS = {"compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
              "main_process_ip", "main_process_port", "mixed_precision", "same_network", "use_cpu",
              "main_training_function", "rdzv_backend", "gpu_ids", "downcast_bf16", "debug", "enable_cpu_affinity",
              "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "num_cpu_threads_per_process"}
DDP_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_HPU", "MULTI_MLU", "NO"}  # what miniddp can run
OTHER_ENGINES = {"deepspeed_config": "DeepSpeed", "fsdp_config": "FSDP", "megatron_lm_config": "Megatron-LM",
                 "DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM"}  # keys and distributed_types
WHOLE_NUMBERS = {  # key: (lowest, highest, what to write instead)
    "num_processes": (1, None, "the total number of processes over all machines, e.g. `num_processes: 2`"),
    "num_machines": (1, None, "the number of machines, e.g. `num_machines: 1`"),
    "machine_rank": (0, None, "this machine's index, 0 on the main machine"),
    "main_process_port": (1, 65535, "a free TCP port on machine 0, e.g. `main_process_port: 29500`"),
}
MIXED_PRECISION = ("no", "fp16", "bf16")


def default_config_file() -> str:
    """Where ``accelerate config`` writes and ``accelerate launch`` looks: ``$HF_HOME/accelerate/default_config.yaml``
    (``HF_HOME``: ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``), as ``config_args.py`` says."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


def write_config(cfg: dict, path: str) -> None:
    """``cfg`` as Accelerate's YAML (its keys sorted, as ``to_yaml_file`` writes them)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=True)


class LaunchError(ValueError):
    """A bad flag or config: ``main`` prints it as one line and exits with status 2."""


def read_config(path) -> dict:
    """An accelerate config file, checked key by key (mixed_precision normalised to a string)."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.load(f, Loader=_NoDuplicates)  # safe_load's loader, refusing a key given twice
    except OSError as err:
        raise LaunchError(f"--config_file {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise LaunchError(f"--config_file {path}: not a text file (byte {err.start} is not UTF-8): an accelerate "
                          "config is YAML text, `key: value` per line") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise LaunchError(f"{path}: not valid YAML{where} ({getattr(err, 'problem', None) or err}); "
                          "an accelerate config is one `key: value` per line") from None
    if not isinstance(cfg, dict):
        raise LaunchError(f"{path}: expected a YAML mapping of accelerate config keys (`num_processes: 2`, ...)")
    engine = next((OTHER_ENGINES[k] for k in [*cfg, str(cfg.get("distributed_type"))] if k in OTHER_ENGINES), None)
    if engine:
        raise LaunchError(f"{path}: this is {'an' if engine == 'FSDP' else 'a'} {engine} config: "
                          "it needs `accelerate launch`; miniddp runs DDP only")
    unknown = sorted(set(cfg) - KNOWN_KEYS)
    if unknown:
        raise LaunchError(f"{path}: unknown key(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    kind = cfg.get("distributed_type", "MULTI_GPU")
    if kind not in DDP_TYPES:
        raise LaunchError(f"{path}: distributed_type: {kind!r}: miniddp runs data-parallel jobs only "
                          f"({', '.join(sorted(DDP_TYPES))}); other engines need `accelerate launch`")
    for key, (low, high, fix) in WHOLE_NUMBERS.items():
        value = cfg.get(key)
        wrong = isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high)
        if value is not None and wrong:
            bounds = f"in {low}..{high}" if high else f">= {low}"
            raise LaunchError(f"{path}: {key}: {json.dumps(value)} must be a whole number {bounds}: set it to {fix}")
    if cfg.get("mixed_precision") is False:  # YAML reads an unquoted `no` as false
        cfg["mixed_precision"] = "no"
    if cfg.get("mixed_precision", "no") not in MIXED_PRECISION:
        raise LaunchError(f"{path}: mixed_precision: {json.dumps(cfg['mixed_precision'])}: "
                          f"miniddp supports {', '.join(MIXED_PRECISION)}")
    for key in ("use_cpu", "same_network"):
        if not isinstance(cfg.get(key, False), bool):
            raise LaunchError(f"{path}: {key}: {json.dumps(cfg[key])} must be true or false")
    if not isinstance(cfg.get("main_process_ip") or "", str):
        raise LaunchError(f"{path}: main_process_ip: {json.dumps(cfg['main_process_ip'])} must be a host name "
                          "or address, e.g. `main_process_ip: 10.0.0.1`")
    _check_honoured(path, cfg)
    return cfg


class _NoDuplicates(yaml.SafeLoader):
    """YAML keeps the last of two equal keys without a word; an accelerate config must not."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise LaunchError(f"{self.name}: key {key!r} is given twice (lines {seen[key]} and "
                                  f"{key_node.start_mark.line + 1}): keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# --8<-- [start:honoured]
# keys miniddp launch acts on as accelerate launch does, beyond the process counts and addresses
HONOURED = {
    "gpu_ids": "CUDA_VISIBLE_DEVICES for the workers (all: every GPU)",
    "num_cpu_threads_per_process": "OMP_NUM_THREADS for the workers",
    "rdzv_backend": "static (fixed machine ranks) or c10d (ranks numbered as machines arrive)",
    "debug": "MINIDDP_DEBUG=collectives: every collective is checked across ranks (accelerate's debug mode)",
}
# keys read and then not acted on: said once when set, never silently dropped
IGNORED = {
    "dynamo_config": "torch.compile is not set up by the launcher: compile in the script",
    "downcast_bf16": "a TPU setting", "tpu_env": "a TPU setting", "tpu_use_cluster": "a TPU setting",
    "tpu_use_sudo": "a TPU setting", "enable_cpu_affinity": "the workers keep the scheduler's CPU placement",
    "main_training_function": "used by accelerate's notebook launcher only",
}
# --8<-- [end:honoured]


def _check_honoured(path, cfg: dict) -> None:
    ids = cfg.get("gpu_ids")
    if ids is not None and str(ids).strip().lower() != "all" and not all(
            part.strip().isdigit() for part in str(ids).split(",")):
        raise LaunchError(f"{path}: gpu_ids: {json.dumps(ids)} must be `all` or GPU indices like `0,1`")
    threads = cfg.get("num_cpu_threads_per_process")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise LaunchError(f"{path}: num_cpu_threads_per_process: {json.dumps(threads)} must be a whole number >= 1")
    if cfg.get("rdzv_backend", "static") not in ("static", "c10d"):
        raise LaunchError(f"{path}: rdzv_backend: {json.dumps(cfg['rdzv_backend'])} must be static or c10d")
    if not isinstance(cfg.get("debug", False), bool):
        raise LaunchError(f"{path}: debug: {json.dumps(cfg['debug'])} must be true or false")


def ignored_settings(cfg: dict) -> list[str]:
    """One line per key the config sets that miniddp launch does not act on, and why."""
    def is_set(key) -> bool:
        value = cfg.get(key)
        if isinstance(value, dict):  # dynamo_config: {dynamo_backend: NO} is accelerate's "off"
            return str(value.get("dynamo_backend", "NO")).upper() != "NO"
        return value not in (None, False, "", [], "NO", "no")
    return [f"{key} ({why})" for key, why in IGNORED.items() if is_set(key)]
