"""Launching: ``miniddp launch script.py`` like ``accelerate launch``: the command line and its run.

What
    ``miniddp launch [--config_file F] [--num_processes N] [--machine_rank R] [--dry_run] [--drop_in]
    script.py [args...]`` (or ``-m module [args...]``) runs the script on N processes through
    ``torch.distributed.run``: torchrun itself, in-process, no home-made launcher. This module
    splits the command line (everything after the script or module name is the script's,
    untouched), reads the config (``accelerate_config.py``; with no ``--config_file``, Accelerate's
    default file if it exists, as ``accelerate launch`` does), picks the process count (one per
    visible GPU, else 2 on the CPU), and runs torchrun with the arguments ``torchrun_args.py``
    builds. The training CLI is ``miniddp launch ... -m miniddp.train --output_dir out``. A YAML with
    ``distributed_type: DEEPSPEED`` runs miniddp's ZeRO stage 0-3 and ``FSDP`` its ``fully_shard``: the
    ``deepspeed_config`` or ``fsdp_config`` block reaches the workers as the variables ``accelerate launch`` sets
    (``ACCELERATE_*``, ``FSDP_*``), which miniddp's Trainer reads.

Why
    The YAML is how TRL and Accelerate users describe jobs (TRL's multi-node page), and
    ``accelerate launch`` is the command they type. A bad file or flag is one line naming the
    key and the fix, exit status 2 (a default config path that is a directory too, rather than
    skipped); a failed worker's exit status is the launcher's.

How Accelerate differs
    ``accelerate launch`` (``accelerate/commands/launch.py``) parses the same way, with many
    more options and backends (torch's FSDP, TPU, DeepSpeed's own engine), and runs the same ``torch.distributed.run``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys

from .accelerate_config import (
    LaunchError,
    deepspeed_variables,
    default_config_file,
    default_config_source,
    fsdp_variables,
    ignored_settings,
    machine_rank_error,
    read_config,
)
from .launch_checks import MAX_PROCESSES, whole_number
from .torchrun_args import before_launch, default_num_processes, script_env, torchrun_args, train_flags

USAGE = "miniddp launch [options] script.py|-m module [args...]"

# --8<-- [start:split]
VALUE_OPTIONS = {"--config_file", "--num_processes", "--machine_rank"}
FLAG_OPTIONS = {"--dry_run", "--drop_in", "-h", "--help"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """``[launcher options] script.py|-m module [script args]`` -> the three parts.

    The first word that is not a launcher option is the script (after ``-m``, the
    module); everything after it is the script's, even ``--num_processes 5``.
    """
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-m", "--module"):
            if i + 1 == len(argv):
                raise LaunchError("-m needs a module name: `miniddp launch -m miniddp.train --output_dir out`")
            return argv[:i], ["-m", argv[i + 1]], argv[i + 2:]
        if not word.startswith("-"):
            return argv[:i], [word], argv[i + 1:]
        if word == "--":
            raise LaunchError("`--` is not used: name the script or module, then its arguments, e.g. "
                              "`miniddp launch --config_file F -m miniddp.train --output_dir out`")
        if word not in VALUE_OPTIONS | FLAG_OPTIONS and word.split("=")[0] not in VALUE_OPTIONS:
            raise LaunchError(f"unknown option {word}: the launcher's options ({', '.join(sorted(VALUE_OPTIONS))}, "
                              "--dry_run, --drop_in) go before the script; the script's own go after it")
        i += 2 if word in VALUE_OPTIONS else 1
    return argv, [], []
# --8<-- [end:split]


def _whole(low: int, high: int, fix: str):
    def parse(text: str) -> int:
        try:
            return whole_number(text, low, high)
        except ValueError:  # ASCII digits only: int() also reads '٢'
            if text.isdigit() and not text.isascii():
                raise argparse.ArgumentTypeError(f"{text} must be written in the digits 0-9: give {fix}") from None
            bounds = f"in {low}..{high}" if text.isdigit() else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text} must be a whole number {bounds}: give {fix}") from None
    return parse


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is enough
        raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="miniddp launch", usage=USAGE, allow_abbrev=False,
                            description="Run a script on N processes with torchrun, as `accelerate launch` does.")
    add = parser.add_argument
    add("--config_file", metavar="F", help="an accelerate config YAML (num_processes, num_machines, ...)")
    add("--num_processes", metavar="N", type=_whole(1, MAX_PROCESSES, "the total over all machines, e.g. "
                                                                       "--num_processes 2"),
        help="total over all machines (default: the YAML's, else one per GPU, else 2 on the CPU)")
    add("--machine_rank", metavar="R", type=_whole(0, MAX_PROCESSES - 1, "this machine's index, 0 on the main one"),
        help="this machine's index; overrides the YAML and SLURM_NODEID")
    add("--dry_run", action="store_true", help="print the torchrun command and exit")
    add("--drop_in", action="store_true", help="run the script on miniddp's DDP in place of torch's "
        "(python -m miniddp.drop_in): an unchanged Transformers, TRL, Accelerate or Lightning script")
    return parser


def launch_command(argv: list[str]) -> tuple[list[str], dict, bool]:
    """The torchrun arguments, the environment for the workers, and whether this is a dry run."""
    ours, target, script_args = split_argv(argv)
    args = _parser().parse_args(ours)
    if not target:
        raise LaunchError("name the script to run: `miniddp launch [options] script.py [args]` or `-m module [args]`")
    if target[0] == "-m":
        _check_module(target[1])
    elif not os.path.isfile(target[0]):
        hint = "" if target[0].endswith(".py") else f"; to run a module: `miniddp launch -m {target[0]}`"
        raise LaunchError(f"no such script: {target[0]} (paths are relative to {os.getcwd()}){hint}")
    notices = []
    default = default_config_file()
    if args.config_file is None and os.path.lexists(default):  # as `accelerate launch` does
        if not os.path.isfile(default):  # accelerate skips it without a word, and the job runs without its config
            raise LaunchError(f"{default} (the default config file, from {default_config_source()}) is "
                              f"{'a directory' if os.path.isdir(default) else 'not a regular file'}: "
                              "remove it, or pass --config_file F")
        args.config_file = default
        notices.append(f"using {args.config_file} (the default config file; --config_file F for another)")
    cfg = read_config(args.config_file) if args.config_file is not None else {}
    if args.machine_rank is not None and args.machine_rank >= cfg.get("num_machines", 1):
        raise LaunchError(machine_rank_error(f"--machine_rank {args.machine_rank}", cfg, args.config_file))
    if args.num_processes:
        cfg["num_processes"] = args.num_processes
    why = None
    if "num_processes" not in cfg:  # per machine, times the machines
        per_node, why = default_num_processes(cfg.get("use_cpu", False))
        cfg["num_processes"] = per_node * cfg.get("num_machines", 1)
    engine = cfg.get("distributed_type")
    if args.drop_in and engine in ("DEEPSPEED", "FSDP"):  # its variables start DeepSpeed's engine or torch's FSDP
        raise LaunchError(f"{args.config_file}: distributed_type: {engine} with --drop_in: the drop-in replaces "
                          f"torch's DDP, and a Transformers or Accelerate script would start "
                          f"{'DeepSpeed' if engine == 'DEEPSPEED' else 'torch FSDP'}; use MULTI_GPU or MULTI_CPU with "
                          "--drop_in (miniddp's ZeRO and FSDP run in its own Trainer)")
    drop_in = ["-m", "miniddp.drop_in"] if args.drop_in else []  # it runs the script, or `-m module`, itself
    command = torchrun_args(cfg, machine_rank=args.machine_rank) + drop_in + target
    notices += [f"{why}; --num_processes N to choose"] if why else []
    notices += [f"{args.config_file}: ignoring {', '.join(ignored_settings(cfg))}"] if ignored_settings(cfg) else []
    if not args.dry_run:
        notices += before_launch(cfg, args.machine_rank)
    for line in notices:  # said once the command is known to be good: an error stays one line
        print(f"miniddp launch: {line}", file=sys.stderr, flush=True)
    if target == ["-m", "miniddp.train"]:
        script_args = train_flags(cfg, script_args)
        script_args += deepspeed_flags(cfg, script_args)
    return command + script_args, {**script_env(cfg), **deepspeed_variables(cfg), **fsdp_variables(cfg)}, args.dry_run


def deepspeed_flags(cfg: dict, flags: list[str]) -> list[str]:
    """For ``-m miniddp.train``: the ``deepspeed_config`` block's accumulation and clipping as its flags, unless
    the flags give them (then the trainer refuses a disagreement, as Hugging Face's does)."""
    if cfg.get("distributed_type") != "DEEPSPEED":
        return []
    block, given, extra = cfg.get("deepspeed_config") or {}, {f.split("=")[0] for f in flags}, []
    for key, flag in (("gradient_accumulation_steps", "--gradient_accumulation_steps"),
                      ("gradient_clipping", "--max_grad_norm")):
        if key in block and flag not in given:
            extra += [flag, str(block[key])]
    return extra


def _check_module(name: str) -> None:
    """Fail in one line now rather than in every worker: is there a module ``name`` to run from here?"""
    sys.path.insert(0, os.getcwd())  # the workers run `python -m name` from here
    spec = None
    try:
        spec = importlib.util.find_spec(name)
        found = spec is not None
    except ModuleNotFoundError as err:  # a parent package is missing
        found = not (err.name and name.startswith(err.name))
    except Exception:  # a parent package fails to import in this process: the workers will say why
        found = True
    finally:
        sys.path.pop(0)
    if not found:
        raise LaunchError(f"no module named {name} (run from the folder that holds it, or install it)")
    # a package runs its __main__ under -m; looked for on disk (not in a zip), so that it is not imported here
    folders = list((spec and spec.submodule_search_locations) or [])
    has_main = any(os.path.isfile(os.path.join(folder, "__main__.py")) for folder in folders)
    if folders and all(os.path.isdir(folder) for folder in folders) and not has_main:
        raise LaunchError(f"{name} is a package without a __main__.py: `python -m {name}` cannot run it; "
                          "name the module to run in it")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}  (miniddp launch --help: the options)")
        return 0
    try:
        if argv[:1] != ["launch"]:
            raise LaunchError(f"the command is `{USAGE}` (miniddp launch --help: the options)")
        command, env, dry_run = launch_command(argv[1:])
    except ValueError as err:  # LaunchError, or a SLURM variable that does not parse
        print(f"miniddp launch: error: {' '.join(str(err).split())}", file=sys.stderr)  # one line, always
        return 2
    if dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " torchrun " + shlex.join(command))
        return 0
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun  # the real torchrun, in this process

    os.environ.update(env)
    try:
        torchrun(command)
    except ChildFailedError as err:  # the worker printed its own traceback; torchrun's summary, not ours
        print(err, file=sys.stderr)
        code = err.get_first_failure()[1].exitcode
        return code if 0 < code < 256 else 128 - code if code < 0 else 1
    except (KeyboardInterrupt, SignalException) as stop:  # Ctrl-C or a kill: torchrun has stopped the workers
        signum = getattr(stop, "sigval", signal.SIGINT)
        print(f"miniddp launch: stopped by {signal.Signals(signum).name}; the workers were stopped too",
              file=sys.stderr, flush=True)
        return 128 + int(signum)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
