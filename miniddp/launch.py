"""Launching: Accelerate-style YAML -> torchrun, SLURM-aware; and a notebook launcher.

What
    ``miniddp launch --config_file FILE.yaml [--machine_rank N] [--dry_run] -- <train flags>``
    reads the fields of an ``accelerate config`` file (``num_processes`` is the
    total over all machines, ``num_machines``, ``machine_rank``,
    ``main_process_ip``, ``main_process_port``, ``mixed_precision``,
    ``same_network``, ``use_cpu``), turns them into ``torchrun`` arguments and
    runs ``miniddp.train`` through ``torch.distributed.run`` — torchrun itself,
    in-process: the same engine, no home-made launcher. ``notebook_launcher``
    runs a function on N ranks from a notebook.

Why
    The YAML is how TRL and Accelerate users describe jobs (TRL's multi-node
    page). The classic multi-node trap is the fixed ``machine_rank`` in that
    file: under SLURM, every node then claims to be node 0. Here, under SLURM,
    the node rank comes from ``SLURM_NODEID`` and the main host from the first
    host of ``SLURM_JOB_NODELIST``; a ``--machine_rank`` flag overrides both.

How Accelerate differs
    ``accelerate launch`` builds the same ``torch.distributed.run`` arguments
    (``accelerate/commands/launch.py``, ``utils/launch.py``) plus many
    backends (DeepSpeed, FSDP, TPU). Its ``notebook_launcher`` forks too.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from .env import parse_slurm_nodelist

KNOWN_KEYS = {"compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
              "main_process_ip", "main_process_port", "mixed_precision", "same_network", "use_cpu",
              "main_training_function", "rdzv_backend", "gpu_ids", "downcast_bf16", "debug", "enable_cpu_affinity",
              "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "num_cpu_threads_per_process"}
DDP_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_HPU", "MULTI_MLU", "NO"}  # what miniddp can run


def read_config(path) -> dict:
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a YAML mapping of accelerate config keys")
    unknown = sorted(set(cfg) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    kind = cfg.get("distributed_type", "MULTI_GPU")
    if kind not in DDP_TYPES:
        raise ValueError(f"{path}: distributed_type={kind!r}: miniddp runs data-parallel jobs only "
                         f"({', '.join(sorted(DDP_TYPES))}); DeepSpeed/FSDP configs need accelerate")
    return cfg


# --8<-- [start:torchrun_args]
def torchrun_args(cfg: dict, environ=None, machine_rank: int | None = None) -> list[str]:
    """The ``torch.distributed.run`` arguments an accelerate-style config describes."""
    env = os.environ if environ is None else environ
    machines = int(cfg.get("num_machines", 1))
    total = int(cfg.get("num_processes", 1))  # over ALL machines, as in accelerate
    if machines < 1 or total < machines or total % machines:
        raise ValueError(f"num_processes={total} must be a positive multiple of num_machines={machines} "
                         "(num_processes counts processes over all machines)")
    per_node = total // machines
    if machines == 1:
        return ["--standalone", f"--nproc-per-node={per_node}"]  # loopback, a free port
    if machine_rank is None:  # under SLURM the node's own id wins over a fixed machine_rank
        machine_rank = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else int(cfg.get("machine_rank", 0))
    if not 0 <= machine_rank < machines:
        raise ValueError(f"machine_rank={machine_rank} must be in [0, num_machines={machines})")
    host = cfg.get("main_process_ip")
    if not host and (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")):
        host = parse_slurm_nodelist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])[0]
    if not host:
        raise ValueError("main_process_ip is required with num_machines > 1 (the address of machine_rank 0)")
    port = int(cfg.get("main_process_port") or 29500)
    args = [f"--nnodes={machines}", f"--nproc-per-node={per_node}"]
    if cfg.get("same_network", True):  # static rendezvous: node ranks are fixed
        args += [f"--node-rank={machine_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:  # c10d rendezvous: nodes meet at the endpoint and are numbered as they arrive
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}"]
    return args
# --8<-- [end:torchrun_args]


def train_flags(cfg: dict, flags: list[str]) -> list[str]:
    """Carry the YAML's mixed_precision / use_cpu to the trainer unless the flags set them."""
    flags = list(flags)
    if cfg.get("mixed_precision") and "--mixed_precision" not in flags:
        flags += ["--mixed_precision", str(cfg["mixed_precision"])]
    if cfg.get("use_cpu") and "--ddp_backend" not in flags:
        flags += ["--ddp_backend", "gloo"]
    return flags


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="miniddp", description="Launch miniddp.train from an accelerate config.")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run miniddp.train with torchrun as FILE.yaml describes")
    launch.add_argument("--config_file", required=True)
    launch.add_argument("--machine_rank", type=int, default=None, help="overrides the YAML and SLURM_NODEID")
    launch.add_argument("--dry_run", action="store_true", help="print the torchrun command and exit")
    args = parser.parse_args(ours)
    try:
        cfg = read_config(args.config_file)
        command = torchrun_args(cfg, machine_rank=args.machine_rank) + ["-m", "miniddp.train"] + train_flags(cfg, rest)
    except (OSError, ValueError) as err:
        print(f"miniddp launch: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("torchrun " + " ".join(command))
        return 0
    from torch.distributed.run import main as torchrun  # the real torchrun, in this process

    torchrun(command)
    return 0


def notebook_launcher(function, args=(), num_processes: int = 2, timeout: float = 600.0) -> list:
    """Run ``function(*args)`` on ``num_processes`` ranks from a notebook (fork, torchrun's variables set).

    The function joins the job itself, e.g. by building a ``miniddp.Trainer``
    (which calls ``init_distributed``). Returns each rank's return value.
    """
    from .testing import run_on_ranks

    return run_on_ranks(lambda rank, world_size: function(*args), num_processes, init=False,
                        start_method="fork", timeout=timeout)


if __name__ == "__main__":
    raise SystemExit(main())
