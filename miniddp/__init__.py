"""miniddp: DistributedDataParallel, rebuilt one small module at a time.

Each concept of DDP is one module (see ``docs/index.md`` for the map); this file
re-exports the public names so that ``import miniddp`` is all a user needs.
"""

from .backend import DEVICE_BACKENDS, device_for_local_rank, select_backend
from .env import DistEnv, init_distributed, parse_slurm_nodelist
from .timeouts import DEFAULT_TIMEOUT_S, StalledRankError, as_timedelta, monitored_barrier

__version__ = "0.1.0"

__all__ = [
    "DEVICE_BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "StalledRankError",
    "as_timedelta",
    "device_for_local_rank",
    "init_distributed",
    "monitored_barrier",
    "parse_slurm_nodelist",
    "select_backend",
]
