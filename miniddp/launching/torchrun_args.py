"""What torchrun is given: its arguments from an Accelerate-style config, and the workers' environment.

What
    ``torchrun_args(cfg)`` turns the fields of an ``accelerate config`` file (``num_processes``,
    the total over all machines, ``num_machines``, ``machine_rank``, ``main_process_ip``,
    ``main_process_port``, ``same_network``, ``rdzv_backend``) into ``torch.distributed.run``
    arguments: ``--standalone`` on one machine, fixed node ranks (static rendezvous) or c10d
    rendezvous on several. ``script_env`` carries the config's settings to any script as
    environment variables, ``train_flags`` as flags to ``-m miniddp.train``. ``before_launch``
    says what a multi-machine job waits for, refuses a main port already taken, and warns when
    a CPU job runs more processes on this machine than it has cores (slower, but allowed).

Why
    The classic multi-node trap is the fixed ``machine_rank`` in that file: under SLURM every
    node then claims to be node 0. Here, under SLURM, the node rank comes from ``SLURM_NODEID``
    and the main host from the first host of ``SLURM_JOB_NODELIST``; a ``--machine_rank`` flag
    overrides both. Without a notice, a machine waiting for the others is silent for up to ten
    minutes.

How Accelerate differs
    ``accelerate launch`` builds the same arguments (``accelerate/utils/launch.py``,
    ``prepare_multi_gpu_env``) and hands the YAML's settings to the script as ``ACCELERATE_*``
    variables; ours are ``MINIDDP_MIXED_PRECISION`` and ``MINIDDP_USE_CPU``.
"""

from __future__ import annotations

import os
import socket

from ..process_group.slurm import parse_slurm_nodelist
from .accelerate_config import LaunchError, machine_rank_error
from .launch_checks import MAX_PER_MACHINE, MAX_PROCESSES, cpu_cores, whole_number


# --8<-- [start:torchrun_args]
def torchrun_args(cfg: dict, environ=None, machine_rank: int | None = None) -> list[str]:
    """The ``torch.distributed.run`` arguments an accelerate-style config describes."""
    machines = int(cfg.get("num_machines", 1))
    total = int(cfg.get("num_processes", 1))  # over ALL machines, as in accelerate
    if machines < 1 or total < machines or total % machines:
        raise LaunchError(f"num_processes={total} must be a positive multiple of num_machines={machines} "
                          "(num_processes counts processes over all machines)")
    per_node = total // machines
    if per_node > MAX_PER_MACHINE:
        raise LaunchError(f"num_processes={total} over num_machines={machines} is {per_node} per machine: more than "
                          f"Linux can hold at once (PID_MAX_LIMIT {MAX_PER_MACHINE}); use more machines or fewer")
    if machines == 1:
        if machine_rank:
            raise LaunchError(machine_rank_error(f"machine_rank {machine_rank}", cfg))
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
    if machine_rank is None and "SLURM_NODEID" in env:  # under SLURM the node's own id wins over a fixed one
        try:
            machine_rank = whole_number(env["SLURM_NODEID"], 0, MAX_PROCESSES)
        except ValueError as err:
            raise LaunchError(f"SLURM_NODEID={env['SLURM_NODEID']!r}: {err}: unset it, or pass --machine_rank R") \
                from None
    machine_rank = int(cfg.get("machine_rank", 0)) if machine_rank is None else machine_rank
    if not 0 <= machine_rank < machines:
        raise LaunchError(machine_rank_error(f"machine_rank {machine_rank}", cfg))
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


# --8<-- [start:script_env]
def script_env(cfg: dict) -> dict:
    """The config's settings for any script, as accelerate's ``ACCELERATE_*`` variables are; and what
    accelerate sets for the workers itself (visible GPUs, threads, debug mode)."""
    # use_cpu reaches an Accelerate or Transformers script too (miniddp launch --drop_in), as accelerate launch
    # tells it: without it, Accelerator() on a CPU-only machine under torchrun trains each rank alone
    env = {"ACCELERATE_USE_CPU": "true"} if cfg.get("use_cpu") else {}
    env |= {"MINIDDP_MIXED_PRECISION": cfg.get("mixed_precision", "no"),
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


RENDEZVOUS_TIMEOUT_S = 600  # torchrun's, static and c10d alike: how long machines wait for each other


def before_launch(cfg: dict, machine_rank: int | None) -> list[str]:
    """What a multi-machine job says before it waits (else it is silent for up to 10 minutes); and, on
    the main machine of a static job, a refusal if its port is already taken (else a traceback)."""
    machines = int(cfg.get("num_machines", 1))
    said = oversubscribed(cfg)
    if machines == 1:
        return said
    rank, host, port = meeting_point(cfg, machine_rank=machine_rank)
    if rank == 0 and static_rendezvous(cfg):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
            try:
                probe.bind(("", port))
            except OSError as err:
                raise LaunchError(f"main_process_port {port} is already in use on this machine ({err.strerror}): "
                                  "another job holds it; choose another main_process_port (on every machine)")
    return said + [f"machine {rank} of {machines}: waiting at {host}:{port} for the other {machines - 1} machine(s) "
                   f"to start, for up to {RENDEZVOUS_TIMEOUT_S} s (torchrun's rendezvous timeout)"]


def oversubscribed(cfg: dict) -> list[str]:
    """A warning, not a refusal, when a CPU job puts more processes on this machine than it has cores: they
    take turns on the cores (and each collective waits for the slowest), which is legal, and slow."""
    per_node, cores = int(cfg["num_processes"]) // int(cfg.get("num_machines", 1)), cpu_cores()
    if per_node <= cores:
        return []
    import torch

    if not cfg.get("use_cpu") and torch.cuda.device_count():  # a GPU job: the cores only feed the GPUs
        return []
    return [f"warning: {per_node} processes on this machine's {cores} CPU core(s) (num_processes per machine): "
            f"oversubscribed, they will take turns, slower; at most {cores} per machine avoids it"]
