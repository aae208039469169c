"""Accelerate's config file, as ``miniddp launch`` reads it: every key checked, honoured or said to be ignored.

What
    ``read_config(path)`` reads the YAML that ``accelerate config`` writes and checks it key by key:
    unknown keys, other engines (Megatron-LM), numbers out of range (``launch_checks.py``), a
    ``machine_rank`` that is not below ``num_machines``, a host that is not an address or an ASCII
    name, a key given twice (with its two line numbers), YAML anchors and aliases, a file that is not
    text or is over 1 MiB are one ``LaunchError`` line each.
    ``HONOURED`` lists the keys acted on as ``accelerate launch`` does (``gpu_ids`` sets
    ``CUDA_VISIBLE_DEVICES``, ``num_cpu_threads_per_process`` sets ``OMP_NUM_THREADS``,
    ``rdzv_backend``, ``debug``); ``ignored_settings`` names, once, the keys it reads and does not
    act on (``dynamo_config``, the TPU keys...). ``distributed_type: DEEPSPEED`` runs miniddp's ZeRO
    (stage 0-3): ``deepspeed_variables`` are the ``ACCELERATE_*`` variables its ``deepspeed_config`` block
    becomes (``zero/deepspeed_config.py``, where each key is checked and the trainer reads them back);
    ``distributed_type: FSDP`` runs ``miniddp.fully_shard``: ``fsdp_variables`` are ``ACCELERATE_USE_FSDP`` and the
    ``FSDP_*`` variables of its ``fsdp_config`` block (``training/fsdp_keys.py``), offloading refused.

Why
    A setting that is accepted and then dropped without a word is a silent wrong answer: the user
    believes the job runs on GPUs 2 and 3, or with 4 threads per process. YAML itself keeps the
    last of two equal keys, so a file edited twice silently means its second half. Aliases let a
    few hundred bytes stand for billions of values (a "billion laughs"), which an error line that
    shows the value would then spell out.

How Accelerate differs
    ``accelerate launch`` reads the same file through its own dataclasses
    (``accelerate/commands/config/config_args.py``) and ignores unknown keys it does not use. With
    ``DEEPSPEED`` it runs DeepSpeed's engine, with ``FSDP`` torch's (and on the CPU neither: it drops them there).
"""

from __future__ import annotations

import os

import yaml

from ..training.fsdp_keys import accelerate_fsdp_variables
from ..zero.deepspeed_config import accelerate_variables
from .launch_checks import MAX_PER_MACHINE, MAX_PROCESSES, host, shown

KNOWN_KEYS = {"compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
              "main_process_ip", "main_process_port", "mixed_precision", "same_network", "use_cpu",
              "main_training_function", "rdzv_backend", "gpu_ids", "downcast_bf16", "debug", "enable_cpu_affinity",
              "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "num_cpu_threads_per_process",
              "deepspeed_config", "fsdp_config"}
DDP_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_HPU", "MULTI_MLU", "NO", "DEEPSPEED", "FSDP"}  # miniddp runs
OTHER_ENGINES = {"megatron_lm_config": "Megatron-LM", "MEGATRON_LM": "Megatron-LM"}  # keys and distributed_types
WHOLE_NUMBERS = {  # key: (lowest, highest, what to write instead); the highest: see launch_checks.py
    "num_processes": (1, MAX_PROCESSES, "the total number of processes over all machines, e.g. `num_processes: 2`"),
    "num_machines": (1, MAX_PROCESSES, "the number of machines, e.g. `num_machines: 1`"),
    "machine_rank": (0, MAX_PROCESSES - 1, "this machine's index, 0 on the main machine"),
    "main_process_port": (1, 65535, "a free TCP port on machine 0, e.g. `main_process_port: 29500`"),
    "num_cpu_threads_per_process": (1, MAX_PER_MACHINE, "the threads of each process, e.g. 4"),
}
MIXED_PRECISION = ("no", "fp16", "bf16")
MAX_BYTES = 2**20  # a config is a few hundred bytes; a bigger file is the wrong file (or /dev/zero)


def default_config_source() -> str:
    """Which variable ``default_config_file`` came from, for an error line about it."""
    return next((f"{v}={os.environ[v]}" for v in ("HF_HOME", "XDG_CACHE_HOME") if os.environ.get(v)), "~/.cache")


def default_config_file() -> str:
    """Where ``accelerate config`` writes and ``accelerate launch`` looks: ``$HF_HOME/accelerate/default_config.yaml``
    (``HF_HOME``: ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``), as ``config_args.py`` says."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


def write_config(cfg: dict, path: str) -> None:
    """``cfg`` as Accelerate's YAML (its keys sorted, as ``to_yaml_file`` writes them)."""
    text = yaml.safe_dump(cfg, sort_keys=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class LaunchError(ValueError):
    """A bad flag or config: ``main`` prints it as one line and exits with status 2."""


def read_config(path) -> dict:
    """An accelerate config file, checked key by key (mixed_precision normalised to a string)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded: a pipe or a device may never end
        if len(data) > MAX_BYTES:
            raise LaunchError(f"{path}: over {MAX_BYTES // 2**20} MiB: not an accelerate config (a few lines of "
                              "`key: value`); check the path")
        loader = _NoDuplicates(data.decode("utf-8"))  # safe_load's loader, refusing a key given twice
        loader.name = str(path)
        try:
            cfg = loader.get_single_data()
        finally:
            loader.dispose()
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
        raise LaunchError(f"{path}: this is a {engine} config: it needs `accelerate launch`; miniddp runs DDP, ZeRO "
                          "and FSDP only")
    unknown = sorted(set(cfg) - KNOWN_KEYS)
    if unknown:
        raise LaunchError(f"{path}: unknown key(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    if cfg.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        raise LaunchError(f"{path}: compute_environment: {shown(cfg['compute_environment'])}: miniddp launches on "
                          "this machine (LOCAL_MACHINE); a cloud job needs `accelerate launch`")
    kind = cfg.get("distributed_type", "MULTI_GPU")
    if not isinstance(kind, str) or kind not in DDP_TYPES:
        raise LaunchError(f"{path}: distributed_type: {shown(kind)}: miniddp runs data-parallel jobs only "
                          f"({', '.join(sorted(DDP_TYPES))}); other engines need `accelerate launch`")
    for key, (low, high, fix) in WHOLE_NUMBERS.items():
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            too_big = isinstance(value, int) and not isinstance(value, bool) and value > high
            bounds = f"in {low}..{high}" if too_big or key == "main_process_port" else f">= {low}"
            raise LaunchError(f"{path}: {key}: {shown(value)} must be a whole number {bounds}: set it to {fix}")
    if cfg.get("machine_rank", 0) >= cfg.get("num_machines", 1):
        raise LaunchError(machine_rank_error(f"{path}: machine_rank: {cfg['machine_rank']}", cfg))
    if cfg.get("mixed_precision") is False:  # YAML reads an unquoted `no` as false
        cfg["mixed_precision"] = "no"
    if cfg.get("mixed_precision", "no") not in MIXED_PRECISION:
        raise LaunchError(f"{path}: mixed_precision: {shown(cfg['mixed_precision'])}: "
                          f"miniddp supports {', '.join(MIXED_PRECISION)}")
    for key in ("use_cpu", "same_network"):
        if not isinstance(cfg.get(key, False), bool):
            raise LaunchError(f"{path}: {key}: {shown(cfg[key])} must be true or false")
    if cfg.get("main_process_ip") not in (None, ""):  # unset: SLURM's first host, or an error on 2+ machines
        try:
            host(cfg["main_process_ip"])
        except ValueError as err:
            raise LaunchError(f"{path}: main_process_ip: {shown(cfg['main_process_ip'])} {err}") from None
    _check_honoured(path, cfg)
    if cfg.get("deepspeed_config") and kind != "DEEPSPEED":
        raise LaunchError(f"{path}: deepspeed_config is read with `distributed_type: DEEPSPEED` only: set it, or "
                          "delete the block")
    if cfg.get("fsdp_config") and kind != "FSDP":
        raise LaunchError(f"{path}: fsdp_config is read with `distributed_type: FSDP` only: set it, or delete the "
                          "block")
    if kind == "FSDP" and cfg.get("mixed_precision") == "fp16":
        raise LaunchError(f"{path}: mixed_precision: fp16 cannot run with distributed_type: FSDP (a GradScaler would "
                          "find an inf in one rank's shard only, and that rank alone would skip the step): use bf16")
    deepspeed_variables(cfg, path)  # each key checked now, before any process starts
    fsdp_variables(cfg, path)
    return cfg


def deepspeed_variables(cfg: dict, path=None) -> dict:
    """``distributed_type: DEEPSPEED``: the ``ACCELERATE_*`` variables of its ``deepspeed_config`` (else none)."""
    if cfg.get("distributed_type") != "DEEPSPEED":
        return {}
    try:
        return accelerate_variables(cfg.get("deepspeed_config") or {}, str(path))
    except ValueError as err:  # DeepSpeedConfigError: it names the key
        raise LaunchError(" ".join(str(err).split())) from None


def fsdp_variables(cfg: dict, path=None) -> dict:
    """``distributed_type: FSDP``: ``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables of its ``fsdp_config``."""
    if cfg.get("distributed_type") != "FSDP":
        return {}
    try:
        return accelerate_fsdp_variables(cfg.get("fsdp_config") or {}, str(path))
    except ValueError as err:  # FSDPConfigError: it names the key
        raise LaunchError(" ".join(str(err).split())) from None


def machine_rank_error(given: str, cfg: dict, source=None) -> str:
    """The one refusal of a machine rank outside ``0..num_machines-1``, from the YAML or from the flag."""
    machines = cfg.get("num_machines", 1)
    return (f"{given} must be < num_machines ({machines}{f', from {source}' if source else ''}): machines are "
            f"numbered 0..{machines - 1}, 0 on the main machine")


class _NoDuplicates(yaml.SafeLoader):
    """YAML keeps the last of two equal keys without a word; an accelerate config must not. Keys are names,
    and aliases (``*name``) are refused: no accelerate config uses them, and they can multiply a value."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise LaunchError(f"{self.name}: line {mark.line + 1}: a YAML alias (*{self.peek_event().anchor}): an "
                              "accelerate config has none; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                what = shown(key) if isinstance(key_node, yaml.ScalarNode) else f"(a {key_node.id})"
                raise LaunchError(f"{self.name}: line {key_node.start_mark.line + 1}: the key {what} is not a "
                                  "name: an accelerate config's keys are names like num_processes")
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
            part.strip().isascii() and part.strip().isdigit() for part in str(ids).split(",")):
        raise LaunchError(f"{path}: gpu_ids: {shown(ids)} must be `all` or GPU indices like `0,1`")
    if cfg.get("rdzv_backend", "static") not in ("static", "c10d"):
        raise LaunchError(f"{path}: rdzv_backend: {shown(cfg['rdzv_backend'])} must be static or c10d")
    if not isinstance(cfg.get("debug", False), bool):
        raise LaunchError(f"{path}: debug: {shown(cfg['debug'])} must be true or false")


def ignored_settings(cfg: dict) -> list[str]:
    """One line per key the config sets that miniddp launch does not act on, and why."""
    def is_set(key) -> bool:
        value = cfg.get(key)
        if isinstance(value, dict):  # dynamo_config: {dynamo_backend: NO} is accelerate's "off"
            return str(value.get("dynamo_backend", "NO")).upper() != "NO"
        # accelerate writes main_training_function: main whatever was asked: its default is no setting
        return value not in (None, False, "", [], "NO", "no") and (key, value) != ("main_training_function", "main")
    return [f"{key} ({why})" for key, why in IGNORED.items() if is_set(key)]
