"""``miniddp config``: Accelerate's questionnaire, for what miniddp runs; ``--default`` writes without asking.

What
    ``miniddp config [--config_file F]`` asks what ``accelerate config`` asks of a local machine: the
    compute environment, the kind of machine (no distributed training, multi-CPU, multi-GPU), the
    number of machines and this one's rank, the main process's IP address and port, CPU only,
    DeepSpeed (``distributed_type: DEEPSPEED``: miniddp's own ZeRO, stage 0-3, or a DeepSpeed JSON
    whose keys are checked as it is named), else FSDP (``distributed_type: FSDP``: resharding after forward,
    the auto wrap policy and its classes or size), the number of processes, mixed precision (not fp16 with
    sharding, which the trainer refuses, picked here or in the JSON). Defaults are in brackets;
    Enter takes them; a bad answer is explained and asked again: numbers in the digits 0-9 and within
    what torch and Linux can run (``launch_checks.py``), the host an IP address or an ASCII name. ``F``
    is checked before the first question. It writes Accelerate's YAML to ``F``, or to Accelerate's default
    file (``default_config_file``: ``$HF_HOME/accelerate/default_config.yaml``), which
    ``miniddp launch`` then reads when given no ``--config_file``; if the write fails even so, the
    YAML is printed, so that the answers are not lost. ``--default`` writes what ``accelerate config
    default`` writes, and never over an existing file.

Why
    Both pages the project started from begin with ``accelerate config``, then ``accelerate
    launch``; a user of miniddp should not have to write the YAML by hand.

How Accelerate differs
    ``accelerate/commands/config/cluster.py`` asks about many more engines (TPUs, dynamo), of DeepSpeed and
    FSDP also offloading, which miniddp does not run, and of FSDP the version, prefetching, the state dict type and
    CPU-RAM-efficient loading, which change nothing here (it does not offer DeepSpeed or FSDP on a multi-CPU
    machine; miniddp's run there on gloo). It picks options with the arrow keys;
    here an option is picked by its number. It reads
    numbers with ``int`` and finds an unwritable path only when it writes, after the last answer.
"""

from __future__ import annotations

import os
import sys

import yaml

from ..zero.deepspeed_config import FP16_WITH_ZERO, accelerate_variables
from .accelerate_config import default_config_file, default_config_source, write_config
from .launch_checks import MAX_PER_MACHINE, MAX_PROCESSES, OneLineParser, host, unwritable, whole_number

STAGES = ("0: DDP, nothing sharded", "1: the optimizer state sharded", "2: the gradients sharded too",
          "3: the parameters sharded too (miniddp.fully_shard)")  # by number
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")  # Accelerate's FSDP_AUTO_WRAP_POLICY
PRECISIONS = ("no", "fp16", "bf16")
MACHINE_TYPES = (("No distributed training", "NO"), ("multi-CPU", "MULTI_CPU"), ("multi-GPU", "MULTI_GPU"))


def ask(prompt: str, convert=str, default=None, error: str = ""):
    """Accelerate's ``_ask_field``: Enter takes ``default``; an answer ``convert`` refuses is explained and
    asked again."""
    while True:
        try:
            answer = input(prompt).strip()
        except UnicodeDecodeError:  # a terminal whose encoding is strict UTF-8, and a byte that is not
            print("that is not UTF-8 text; try again")
            continue
        if not answer and default is not None:
            return default
        try:
            return convert(answer)
        except ValueError as err:
            print(f"{error or err} (you typed {answer!r}); try again")


def ask_option(question: str, options, default: int = 0, refused=lambda option: "") -> int:
    """The number of an option; ``refused(option)`` says why one cannot be taken here (else "")."""
    print(question)
    for i, option in enumerate(options):
        print(f" [{i}] {option}")

    def convert(answer: str) -> int:
        try:
            index = _number(0, len(options) - 1)(answer)
        except ValueError:
            raise ValueError(f"type a number from 0 to {len(options) - 1}") from None
        if refused(options[index]):
            raise ValueError(refused(options[index]))
        return index
    return ask(f"Type its number [{default}]: ", convert, default)


def _number(low: int, high: int, multiple_of: int = 1):
    """A whole number in ``low..high`` (digits 0-9), a multiple of ``multiple_of``, as ``ask`` converts."""
    def convert(answer: str) -> int:
        value = whole_number(answer, low, high)
        if value % multiple_of:
            raise ValueError(f"{value} is not a multiple of {multiple_of}")
        return value
    return convert


def _yes_no(answer: str) -> bool:
    if answer.lower() in ("y", "yes", "true"):
        return True
    if answer.lower() in ("n", "no", "false"):
        return False
    raise ValueError("answer yes or no")


# --8<-- [start:questions]
def questionnaire() -> dict:
    """The answers, as Accelerate's config keys."""
    ask_option("In which compute environment are you running?", ["This machine (and others like it)"])
    kind = MACHINE_TYPES[ask_option("Which type of machine are you using?", [name for name, _ in MACHINE_TYPES])][1]
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_machines": 1, "machine_rank": 0}
    if kind != "NO":
        cfg["num_machines"] = ask("How many different machines will you use (use more than 1 for multi-node "
                                  "training)? [1]: ", _number(1, MAX_PROCESSES), 1,
                                  f"type a whole number from 1 to {MAX_PROCESSES} (torch numbers ranks with C ints)")
    if cfg["num_machines"] > 1:
        last = cfg["num_machines"] - 1
        cfg["machine_rank"] = ask(f"What is the rank of this machine (0 to {last})? [0]: ",
                                  _number(0, last), 0, f"type a whole number from 0 to {last}")
        cfg["main_process_ip"] = ask("What is the IP address of the machine that will host the main process? ",
                                     host, None, "type the main machine's IP address or ASCII host name, e.g. 10.0.0.1")
        cfg["main_process_port"] = ask("What is the port you will use to communicate with the main process? "
                                       "[29500]: ", _number(1, 65535), 29500, "type a port number from 1 to 65535")
        cfg["same_network"] = True
    cfg["use_cpu"] = kind == "MULTI_CPU" or ask(
        "Do you want to run your training on CPU only (even if a GPU is available)? [yes/NO]: ", _yes_no, False)
    if kind == "NO":
        cfg["num_processes"] = 1
    else:
        # distributed_type: DEEPSPEED and its deepspeed_config block, or FSDP and its fsdp_config block, or nothing
        cfg.update(deepspeed_questions() or fsdp_questions())
        # as many on every machine, and no more than Linux holds on one (more than its cores: launch says so)
        per, most = cfg["num_machines"], min(MAX_PROCESSES, cfg["num_machines"] * MAX_PER_MACHINE)
        cfg["num_processes"] = ask(f"How many processes in total will you use (over all machines)? [{per}]: ",
                                   _number(per, most, per), per, f"type a multiple of {per} (as many on each "
                                   f"machine) from {per} to {most} (at most {MAX_PER_MACHINE} per machine)")
    block = cfg.get("deepspeed_config", {})
    if "deepspeed_config_file" not in block:  # else the JSON's fp16/bf16 blocks say it, and it is not asked
        zero = block.get("zero_stage", 0) > 0 or cfg["distributed_type"] == "FSDP"
        cfg["mixed_precision"] = PRECISIONS[ask_option(
            "Do you wish to use mixed precision?", PRECISIONS, refused=lambda option: zero and option == "fp16" and
            f"fp16 cannot run with sharding (ZeRO stages 1-3, FSDP): {FP16_WITH_ZERO}: pick no or bf16")]
    return {**cfg, "debug": False, "downcast_bf16": "no", "main_training_function": "main",
            "rdzv_backend": "static", **({} if cfg["use_cpu"] else {"gpu_ids": "all"})}
# --8<-- [end:questions]


def deepspeed_questions() -> dict:
    """Accelerate's DeepSpeed questions, for what miniddp's ZeRO runs: a DeepSpeed JSON (checked now), or the
    stage (0-3; no offload), accumulation and clipping. {} when the answer is no."""
    if not ask("Do you want to use DeepSpeed's ZeRO (run by miniddp's own engine, stages 0-3; not DeepSpeed)? "
               "[yes/NO]: ", _yes_no, False):
        return {}
    if ask("Do you want to specify a json file to a DeepSpeed config? [yes/NO]: ", _yes_no, False):
        path = ask("Please enter the path to the json DeepSpeed config file: ", _deepspeed_file)
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": path,
                                                                      "zero3_init_flag": False}}
    stage = ask_option("What should be your DeepSpeed's ZeRO optimization stage?", STAGES, default=2)
    block = {"zero_stage": stage, "gradient_accumulation_steps": ask(
        "How many gradient accumulation steps you're passing in your script? [1]: ", _number(1, 2**31 - 1), 1)}
    if ask("Do you want to use gradient clipping? [yes/NO]: ", _yes_no, False):
        block["gradient_clipping"] = ask("What is the gradient clipping value? [1.0]: ", _clipping, 1.0)
    return {"distributed_type": "DEEPSPEED", "deepspeed_config": {**block, "zero3_init_flag": False}}


# --8<-- [start:fsdp]
def fsdp_questions() -> dict:
    """Accelerate's FSDP questions that matter to ``fully_shard``: resharding after forward, the auto wrap policy and
    its classes or size. Written as FSDP2 (``fsdp_version: 2``), full state dicts, no offload. {} when the answer is
    no."""
    if not ask("Do you want to use FullyShardedDataParallel (miniddp's fully_shard, FSDP2's API)? [yes/NO]: ",
               _yes_no, False):
        return {}
    block = {"fsdp_version": 2, "fsdp_reshard_after_forward": ask(
        "Do you want to enable resharding after forward? [YES/no]: ", _yes_no, True)}
    block["fsdp_auto_wrap_policy"] = WRAP_POLICIES[ask_option("What should be your auto wrap policy?", WRAP_POLICIES)]
    if block["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and not ask(
            "Do you want to use the model's `_no_split_modules` to wrap. Only applicable for 🤗 Transformers "
            "[yes/NO]: ", _yes_no, False):
        block["fsdp_transformer_layer_cls_to_wrap"] = ask(
            "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap ,e.g, :"
            "`BertLayer`, `GPTJBlock`, `T5Block`, `BertLayer,BertEmbeddings,BertSelfOutput` ...? : ", _class_names)
    if block["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP":
        block["fsdp_min_num_params"] = ask("What should be your FSDP's minimum number of parameters for Default Auto "
                                           "Wrapping Policy? [1e8]: ", _number(0, 2**63 - 1), 100000000)
    return {"distributed_type": "FSDP", "fsdp_config": {**block, "fsdp_offload_params": False,
                                                        "fsdp_state_dict_type": "FULL_STATE_DICT"}}
# --8<-- [end:fsdp]


def _class_names(answer: str) -> str:
    names = [name.strip() for name in answer.split(",")]
    if not all(name.isidentifier() for name in names):
        raise ValueError("type Python class names separated by commas, e.g. GPT2Block")
    return ",".join(names)


def _deepspeed_file(answer: str) -> str:
    """A DeepSpeed JSON miniddp can run, by its key names (``zero/deepspeed_config.py``): else ValueError."""
    if not os.path.isfile(answer):
        raise ValueError(f"no file at {answer!r}: give the path of a DeepSpeed config JSON (ds_config.json)")
    accelerate_variables({"deepspeed_config_file": answer}, "the DeepSpeed config file")
    return os.path.abspath(answer)


def _clipping(answer: str) -> float:
    value = float(answer)
    if not value >= 0 or value == float("inf"):
        raise ValueError("type a number >= 0 (0: no clipping)")
    return value


def basic_config(mixed_precision: str = "no") -> dict:
    """What ``accelerate config default`` writes: every GPU of this machine if it has several, else one process."""
    import torch

    gpus = torch.cuda.device_count()
    kind, processes = ("MULTI_GPU", gpus) if gpus > 1 else ("NO", 1)
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_processes": processes,
            "num_machines": 1, "machine_rank": 0, "mixed_precision": mixed_precision, "use_cpu": gpus == 0,
            "debug": False, "downcast_bf16": "no", "main_training_function": "main", "rdzv_backend": "static"}


def main(argv=None) -> int:
    parser = OneLineParser(prog="miniddp config", description=__doc__.splitlines()[0])
    parser.add_argument("--config_file", metavar="F", help=f"where to write (default: {default_config_file()})")
    parser.add_argument("--default", action="store_true", help="write the basic config without asking "
                        "(as `accelerate config default`); never over an existing file")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no",
                        help="with --default: the mixed precision to write")
    args = parser.parse_args(argv)
    path = default_config_file() if args.config_file is None else args.config_file
    problem = unwritable(path)  # before the questions: the answers are not typed for nothing
    if problem:
        where, fix = ((f"--config_file {path}", "name a YAML file in a folder you can write")
                      if args.config_file is not None else
                      (f"{path} (the default config file, from {default_config_source()})",
                       "set HF_HOME to a folder you can write, or pass --config_file F"))
        print(f"miniddp config: error: {where}: {problem}: {fix}", file=sys.stderr)
        return 2
    if args.default:
        if os.path.exists(path):
            print(f"miniddp config: {path} exists: not overwritten (run `miniddp config` to answer the "
                  "questions, or pass another --config_file)", file=sys.stderr)
            return 1
        cfg = basic_config(args.mixed_precision)
    else:
        try:
            cfg = questionnaire()
        except (EOFError, KeyboardInterrupt):
            print("\nminiddp config: stopped; nothing written", file=sys.stderr)
            return 1
    try:
        write_config(cfg, path)
    except OSError as err:  # the place changed during the questions, or the disk is full: keep the answers
        print(f"miniddp config: error: could not write {path} ({err.strerror or err}); the configuration is "
              "below: save it as a .yaml file and pass it with --config_file F", file=sys.stderr, flush=True)
        print(yaml.safe_dump(cfg, sort_keys=True), end="")
        return 1
    print(f"miniddp configuration saved at {path}")
    return 0
