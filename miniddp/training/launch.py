"""Launching: ``miniddp launch script.py`` like ``accelerate launch``, SLURM-aware.

What
    ``miniddp launch [--config_file F] [--num_processes N] [--machine_rank R] [--dry_run]
    script.py [args...]`` (or ``-m module [args...]``) runs the script on N
    processes through ``torch.distributed.run`` — torchrun itself, in-process: the
    same engine, no home-made launcher. Everything after the script or module name
    is the script's, untouched. Without a config: one machine, one process per
    visible GPU, else 2 on the CPU. With one, it reads the fields of an
    ``accelerate config`` file (``num_processes`` is the total over all machines,
    ``num_machines``, ``machine_rank``, ``main_process_ip``, ``main_process_port``,
    ``mixed_precision``, ``same_network``, ``use_cpu``). The training CLI is
    ``miniddp launch ... -m miniddp.train --output_dir out``.

Why
    The YAML is how TRL and Accelerate users describe jobs (TRL's multi-node
    page). The classic multi-node trap is the fixed ``machine_rank`` in that
    file: under SLURM, every node then claims to be node 0. Here, under SLURM,
    the node rank comes from ``SLURM_NODEID`` and the main host from the first
    host of ``SLURM_JOB_NODELIST``; a ``--machine_rank`` flag overrides both.
    A bad file or flag is one line naming the key and the fix, exit status 2.

How Accelerate differs
    ``accelerate launch`` builds the same ``torch.distributed.run`` arguments
    (``accelerate/commands/launch.py``, ``utils/launch.py``) plus many
    backends (DeepSpeed, FSDP, TPU), and hands the YAML's settings to the script
    as ``ACCELERATE_*`` variables; ours are ``MINIDDP_MIXED_PRECISION`` and
    ``MINIDDP_USE_CPU``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import socket
import sys

from .accelerate_config import LaunchError, ignored_settings, read_config
from ..process_group.env import parse_slurm_nodelist

USAGE = "miniddp launch [options] script.py|-m module [args...]"

# --8<-- [start:torchrun_args]
def torchrun_args(cfg: dict, environ=None, machine_rank: int | None = None) -> list[str]:
    """The ``torch.distributed.run`` arguments an accelerate-style config describes."""
    machines = int(cfg.get("num_machines", 1))
    total = int(cfg.get("num_processes", 1))  # over ALL machines, as in accelerate
    if machines < 1 or total < machines or total % machines:
        raise LaunchError(f"num_processes={total} must be a positive multiple of num_machines={machines} "
                          "(num_processes counts processes over all machines)")
    per_node = total // machines
    if machines == 1:
        if machine_rank:
            raise LaunchError(f"machine_rank={machine_rank} must be 0 on a one-machine job (num_machines=1)")
        return ["--standalone", f"--nproc-per-node={per_node}"]  # loopback, a free port
    machine_rank, host, port = meeting_point(cfg, environ, machine_rank)
    args = [f"--nnodes={machines}", f"--nproc-per-node={per_node}"]
    if static_rendezvous(cfg):  # node ranks are fixed
        args += [f"--node-rank={machine_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:  # c10d rendezvous: nodes meet at the endpoint and are numbered as they arrive
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}"]
    return args


def meeting_point(cfg: dict, environ=None, machine_rank: int | None = None) -> tuple[int, str, int]:
    """(this machine's rank, the main machine's host, its port) of a job on several machines."""
    env = os.environ if environ is None else environ
    machines = int(cfg.get("num_machines", 1))
    if machine_rank is None:  # under SLURM the node's own id wins over a fixed machine_rank
        machine_rank = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else int(cfg.get("machine_rank", 0))
    if not 0 <= machine_rank < machines:
        raise LaunchError(f"machine_rank={machine_rank} must be in [0, num_machines={machines})")
    host = cfg.get("main_process_ip")
    if not host and (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")):
        host = parse_slurm_nodelist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])[0]
    if not host:
        raise LaunchError("main_process_ip is required with num_machines > 1 (the address of machine_rank 0)")
    return machine_rank, host, int(cfg.get("main_process_port") or 29500)


def static_rendezvous(cfg: dict) -> bool:
    """Fixed machine ranks (accelerate's default), unless same_network: false or rdzv_backend: c10d."""
    return cfg.get("same_network", True) and cfg.get("rdzv_backend", "static") == "static"
# --8<-- [end:torchrun_args]


def default_num_processes(use_cpu: bool = False) -> tuple[int, str]:
    """One process per visible GPU, else 2 on the CPU; and why, for a one-line notice."""
    import torch

    gpus = 0 if use_cpu else torch.cuda.device_count()
    if gpus:
        return gpus, f"{gpus} process{'es' * (gpus > 1)}, one per visible GPU (torch.cuda.device_count() = {gpus})"
    return 2, "2 processes on the CPU: " + ("the config sets use_cpu" if use_cpu else "no GPU is visible")


# --8<-- [start:split]
VALUE_OPTIONS = {"--config_file", "--num_processes", "--machine_rank"}
FLAG_OPTIONS = {"--dry_run", "-h", "--help"}


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
                              "--dry_run) go before the script; the script's own go after it")
        i += 2 if word in VALUE_OPTIONS else 1
    return argv, [], []
# --8<-- [end:split]


# --8<-- [start:script_env]
def script_env(cfg: dict) -> dict:
    """The config's settings for any script, as accelerate's ``ACCELERATE_*`` variables are; and what
    accelerate sets for the workers itself (visible GPUs, threads, debug mode)."""
    env = {"MINIDDP_MIXED_PRECISION": cfg.get("mixed_precision", "no"),
           "MINIDDP_USE_CPU": "true" if cfg.get("use_cpu") else "false"}
    if cfg.get("gpu_ids") is not None and str(cfg["gpu_ids"]).strip().lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(part.strip() for part in str(cfg["gpu_ids"]).split(","))
    if cfg.get("num_cpu_threads_per_process"):
        env["OMP_NUM_THREADS"] = str(cfg["num_cpu_threads_per_process"])
    if cfg.get("debug"):
        env["MINIDDP_DEBUG"] = "collectives"
    return env


def train_flags(cfg: dict, flags: list[str]) -> list[str]:
    """For ``-m miniddp.train``: carry mixed_precision / use_cpu as its flags, unless the flags set them."""
    given = {f.split("=")[0] for f in flags}
    flags = list(flags)
    if cfg.get("mixed_precision") and "--mixed_precision" not in given:
        flags += ["--mixed_precision", str(cfg["mixed_precision"])]
    if cfg.get("use_cpu") and "--use_cpu" not in given:
        flags += ["--use_cpu", "true"]
    return flags
# --8<-- [end:script_env]


def _whole(low: int, fix: str):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"{text} must be a whole number >= {low}: give {fix}")
        return int(text)
    return parse


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is enough
        raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="miniddp launch", usage=USAGE, allow_abbrev=False,
                            description="Run a script on N processes with torchrun, as `accelerate launch` does.")
    add = parser.add_argument
    add("--config_file", metavar="F", help="an accelerate config YAML (num_processes, num_machines, ...)")
    add("--num_processes", metavar="N", type=_whole(1, "the total over all machines, e.g. --num_processes 2"),
        help="total over all machines (default: the YAML's, else one per GPU, else 2 on the CPU)")
    add("--machine_rank", metavar="R", type=_whole(0, "this machine's index, 0 on the main one"),
        help="this machine's index; overrides the YAML and SLURM_NODEID")
    add("--dry_run", action="store_true", help="print the torchrun command and exit")
    return parser


RENDEZVOUS_TIMEOUT_S = 600  # torchrun's, static and c10d alike: how long machines wait for each other


def before_launch(cfg: dict, machine_rank: int | None) -> list[str]:
    """What a multi-machine job says before it waits (else it is silent for up to 10 minutes); and, on
    the main machine of a static job, a refusal if its port is already taken (else a traceback)."""
    machines = int(cfg.get("num_machines", 1))
    if machines == 1:
        return []
    rank, host, port = meeting_point(cfg, machine_rank=machine_rank)
    if rank == 0 and static_rendezvous(cfg):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
            try:
                probe.bind(("", port))
            except OSError as err:
                raise LaunchError(f"main_process_port {port} is already in use on this machine ({err.strerror}): "
                                  "another job holds it; choose another main_process_port (on every machine)")
    return [f"machine {rank} of {machines}: waiting at {host}:{port} for the other {machines - 1} machine(s) to "
            f"start, for up to {RENDEZVOUS_TIMEOUT_S} s (torchrun's rendezvous timeout)"]


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
    cfg = read_config(args.config_file) if args.config_file else {}
    if args.num_processes:
        cfg["num_processes"] = args.num_processes
    why = None
    if "num_processes" not in cfg:  # per machine, times the machines
        per_node, why = default_num_processes(cfg.get("use_cpu", False))
        cfg["num_processes"] = per_node * cfg.get("num_machines", 1)
    command = torchrun_args(cfg, machine_rank=args.machine_rank) + target
    notices = [f"{why}; --num_processes N to choose"] if why else []
    notices += [f"{args.config_file}: ignoring {', '.join(ignored_settings(cfg))}"] if ignored_settings(cfg) else []
    if not args.dry_run:
        notices += before_launch(cfg, args.machine_rank)
    for line in notices:  # said once the command is known to be good: an error stays one line
        print(f"miniddp launch: {line}", file=sys.stderr, flush=True)
    if target == ["-m", "miniddp.train"]:
        script_args = train_flags(cfg, script_args)
    return command + script_args, script_env(cfg), args.dry_run


def _check_module(name: str) -> None:
    """Fail in one line now rather than in every worker: is there a module ``name`` to run from here?"""
    sys.path.insert(0, os.getcwd())  # the workers run `python -m name` from here
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as err:  # a parent package is missing
        found = not (err.name and name.startswith(err.name))
    except Exception:  # a parent package fails to import in this process: the workers will say why
        found = True
    finally:
        sys.path.pop(0)
    if not found:
        raise LaunchError(f"no module named {name} (run from the folder that holds it, or install it)")


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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun  # the real torchrun, in this process

    from torch.distributed.elastic.multiprocessing.api import SignalException

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
