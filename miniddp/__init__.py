"""miniddp: DistributedDataParallel, rebuilt one small module at a time.

Each concept of DDP is one module (see ``docs/index.md`` for the map); this file
re-exports the public names so that ``import miniddp`` is all a user needs.
"""

from .backend import DEVICE_BACKENDS, device_for_local_rank, select_backend
from .env import DistEnv, init_distributed, parse_slurm_nodelist
from .timeouts import DEFAULT_TIMEOUT_S, StalledRankError, as_timedelta, monitored_barrier
from .desync import CollectiveMismatchError
from .bucketing import compute_bucket_assignment
from .ddp import DistributedDataParallel, WrappedAgainError
from . import comm_hooks  # miniddp.comm_hooks.allreduce_hook, ..., PowerSGDState, powerSGD_hook
from .no_sync import accumulation_windows, no_sync, should_sync
from .sharding import ShardSampler
from .averaging import average_gradients, ring_all_reduce
from .config import TrainingConfig
from .batches import EvalPrediction
from .output_dir import OutputDirError
from .nonfinite import NonFiniteLossError
from .resume import SetupChangedError
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "DEVICE_BACKENDS",
    "CollectiveMismatchError",
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "DistributedDataParallel",
    "EvalPrediction",
    "NonFiniteLossError",
    "OutputDirError",
    "SetupChangedError",
    "ShardSampler",
    "StalledRankError",
    "Trainer",
    "TrainingConfig",
    "WrappedAgainError",
    "accumulation_windows",
    "as_timedelta",
    "average_gradients",
    "comm_hooks",
    "compute_bucket_assignment",
    "device_for_local_rank",
    "init_distributed",
    "monitored_barrier",
    "no_sync",
    "parse_slurm_nodelist",
    "ring_all_reduce",
    "select_backend",
    "should_sync",
]
