"""``miniddp config``: Accelerate's questionnaire, for what miniddp runs; ``--default`` writes without asking.

What
    ``miniddp config [--config_file F]`` asks what ``accelerate config`` asks of a local machine: the
    compute environment, the kind of machine (no distributed training, multi-CPU, multi-GPU), the
    number of machines and this one's rank, the main process's IP address and port, the number of
    processes, CPU only, mixed precision. Defaults are in brackets; Enter takes them; a bad answer
    is explained and asked again. It writes Accelerate's YAML to ``F``, or to Accelerate's default
    file (``default_config_file``: ``$HF_HOME/accelerate/default_config.yaml``), which
    ``miniddp launch`` then reads when given no ``--config_file``. ``--default`` writes what
    ``accelerate config default`` writes, and never over an existing file.

Why
    Both pages the project started from begin with ``accelerate config``, then ``accelerate
    launch``; a user of miniddp should not have to write the YAML by hand.

How Accelerate differs
    ``accelerate/commands/config/cluster.py`` asks about many more engines (DeepSpeed, FSDP, TPUs,
    dynamo) and picks options with the arrow keys; here an option is picked by its number.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from .accelerate_config import default_config_file, write_config

MACHINE_TYPES = (("No distributed training", "NO"), ("multi-CPU", "MULTI_CPU"), ("multi-GPU", "MULTI_GPU"))


def ask(prompt: str, convert=str, default=None, error: str = ""):
    """Accelerate's ``_ask_field``: Enter takes ``default``; an answer ``convert`` refuses is explained and
    asked again."""
    while True:
        answer = input(prompt).strip()
        if not answer and default is not None:
            return default
        try:
            return convert(answer)
        except ValueError as err:
            print(f"{error or err} (you typed {answer!r}); try again")


def ask_option(question: str, options, default: int = 0) -> int:
    print(question)
    for i, option in enumerate(options):
        print(f" [{i}] {option}")
    return ask(f"Type its number [{default}]: ", lambda a: _in_range(int(a), 0, len(options) - 1), default,
               f"type a number from 0 to {len(options) - 1}")


def _in_range(value: int, low: int, high: int | None = None) -> int:
    if value < low or (high is not None and value > high):
        raise ValueError(f"{value} is out of range")
    return value


def _yes_no(answer: str) -> bool:
    if answer.lower() in ("y", "yes", "true"):
        return True
    if answer.lower() in ("n", "no", "false"):
        return False
    raise ValueError("answer yes or no")


def _host(answer: str) -> str:
    try:
        ipaddress.ip_address(answer)
    except ValueError:
        if not answer or " " in answer:
            raise ValueError("type the main machine's IP address (or host name), e.g. 10.0.0.1") from None
    return answer


# --8<-- [start:questions]
def questionnaire() -> dict:
    """The answers, as Accelerate's config keys."""
    ask_option("In which compute environment are you running?", ["This machine (and others like it)"])
    kind = MACHINE_TYPES[ask_option("Which type of machine are you using?", [name for name, _ in MACHINE_TYPES])][1]
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_machines": 1, "machine_rank": 0}
    if kind != "NO":
        whole = "type a whole number, 1 or more"
        cfg["num_machines"] = ask("How many different machines will you use (use more than 1 for multi-node "
                                  "training)? [1]: ", lambda a: _in_range(int(a), 1), 1, whole)
    if cfg["num_machines"] > 1:
        last = cfg["num_machines"] - 1
        cfg["machine_rank"] = ask(f"What is the rank of this machine (0 to {last})? [0]: ",
                                  lambda a: _in_range(int(a), 0, last), 0, f"type a whole number from 0 to {last}")
        cfg["main_process_ip"] = ask("What is the IP address of the machine that will host the main process? ",
                                     _host)
        cfg["main_process_port"] = ask("What is the port you will use to communicate with the main process? "
                                       "[29500]: ", lambda a: _in_range(int(a), 1, 65535), 29500,
                                       "type a port number from 1 to 65535")
        cfg["same_network"] = True
    cfg["use_cpu"] = kind == "MULTI_CPU" or ask(
        "Do you want to run your training on CPU only (even if a GPU is available)? [yes/NO]: ", _yes_no, False)
    if kind == "NO":
        cfg["num_processes"] = 1
    else:
        per = cfg["num_machines"]
        cfg["num_processes"] = ask(f"How many processes in total will you use (over all machines)? [{per}]: ",
                                   lambda a: _in_range(int(a), 1), per, "type a whole number, 1 or more")
    precisions = ["no", "fp16", "bf16"]
    cfg["mixed_precision"] = precisions[ask_option("Do you wish to use mixed precision?", precisions)]
    return {**cfg, "debug": False, "downcast_bf16": "no", "main_training_function": "main",
            "rdzv_backend": "static", **({} if cfg["use_cpu"] else {"gpu_ids": "all"})}
# --8<-- [end:questions]


def basic_config(mixed_precision: str = "no") -> dict:
    """What ``accelerate config default`` writes: every GPU of this machine if it has several, else one process."""
    import torch

    gpus = torch.cuda.device_count()
    kind, processes = ("MULTI_GPU", gpus) if gpus > 1 else ("NO", 1)
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_processes": processes,
            "num_machines": 1, "machine_rank": 0, "mixed_precision": mixed_precision, "use_cpu": gpus == 0,
            "debug": False, "downcast_bf16": "no", "main_training_function": "main", "rdzv_backend": "static"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="miniddp config", description=__doc__.splitlines()[0])
    parser.add_argument("--config_file", metavar="F", help=f"where to write (default: {default_config_file()})")
    parser.add_argument("--default", action="store_true", help="write the basic config without asking "
                        "(as `accelerate config default`); never over an existing file")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no",
                        help="with --default: the mixed precision to write")
    args = parser.parse_args(argv)
    path = args.config_file or default_config_file()
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
    write_config(cfg, path)
    print(f"miniddp configuration saved at {path}")
    return 0
