"""``miniddp env``: what a bug report needs, as ``accelerate env`` prints it.

What
    Versions (miniddp, Python, torch and its CUDA, Accelerate and Transformers if installed), the
    platform, the process-group backends this torch can create, the devices (CPU cores, memory,
    each GPU), and the config in use: ``--config_file F``, else Accelerate's default file (the one
    ``miniddp launch`` would read), printed (its first 4 KiB), or where it would be, or why it
    cannot be read.

Why
    "It hangs on my machine" is answerable only with the machine: the backend and device a run
    chose, and the config it read, are most of what differs between two machines.

How Accelerate differs
    ``accelerate env`` (``accelerate/commands/env.py``) prints the same kind of list, with its own
    version and its default config; it needs no process group either.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

from .accelerate_config import MAX_BYTES, default_config_file
from .launch_checks import OneLineParser

MAX_SHOWN = 4096  # bytes of the config shown: a config is a few hundred; a report is pasted into an issue


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return f"{total_kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        return "unknown"


def report(config_file: str | None = None) -> list[str]:
    import torch
    import torch.distributed as dist

    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available()),
                                      ("xccl", getattr(dist, "is_xccl_available", lambda: False)())) if ok]
    gpus = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    path = config_file or default_config_file()
    lines = [
        f"- miniddp version: {_version('miniddp')}",
        f"- Platform: {platform.platform()}",
        f"- Python version: {platform.python_version()}",
        f"- PyTorch version: {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"- Accelerate version: {_version('accelerate')}",
        f"- Transformers version: {_version('transformers')}",
        f"- Process-group backends available: {', '.join(backends) or 'none'}",
        f"- CPU cores: {os.cpu_count()}; memory: {_memory_gib()}",
        f"- GPUs: {'; '.join(gpus) if gpus else 'none (CUDA available: ' + str(torch.cuda.is_available()) + ')'}",
    ]
    return lines + _config_lines(path)


def _config_lines(path: str) -> list[str]:
    """The config file, shown as text (bounded: a report is pasted), or what stands in its place."""
    if os.path.isdir(path):  # miniddp launch refuses it: the report says so rather than "none"
        return [f"- Config file: {path} is a directory, not a file (`miniddp launch` refuses it)"]
    if not os.path.lexists(path):
        return [f"- Config file: none at {path} (`miniddp config` writes one)"]
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as err:
        return [f"- Config file: {path} cannot be read ({err.strerror})"]
    text = data[:MAX_SHOWN].decode("utf-8", errors="replace")
    cut = [f"\t... ({'over ' * (len(data) > MAX_BYTES)}{len(data)} bytes; the first {MAX_SHOWN} shown)"]
    return ([f"- Config file in use: {path}"] + [f"\t{line.rstrip()}" for line in text.splitlines() if line.strip()]
            + (cut if len(data) > MAX_SHOWN else []))


def main(argv=None) -> int:
    parser = OneLineParser(prog="miniddp env", description=__doc__.splitlines()[0])
    parser.add_argument("--config_file", metavar="F", help=f"the config to show (default: {default_config_file()})")
    args = parser.parse_args(argv)
    print("Copy-and-paste the text below in your bug report.\n")
    print("\n".join(report(args.config_file)))
    return 0
