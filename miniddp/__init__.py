"""miniddp: DistributedDataParallel, rebuilt one small module at a time.

Each concept of DDP is one module, in the folder of its layer (``docs/index.md``: the map
and the layers); this file re-exports the public names so that ``import miniddp`` is all a
user needs. Importing it changes nothing else: no engine table is filled, no name is swapped
(``bucket_cap_mb="auto"`` is ``composed.py``'s class attribute; an exercise's swap runs where the exercise
check asks for it, ``teaching/exercise/swap.py``).
"""

from .process_group.backend import DEVICE_BACKENDS, device_for_local_rank, select_backend
from .process_group.env import DistEnv, init_distributed
from .process_group.slurm import parse_slurm_nodelist
from .process_group.timeouts import DEFAULT_TIMEOUT_S, as_timedelta
from .process_group.monitored_barrier import monitored_barrier
from .process_group.stalled_ranks import StalledRankError
from .process_group.desync import CollectiveMismatchError
from .engine.bucketing import compute_bucket_assignment
from .composed import DistributedDataParallel  # the engine's, with bucket_cap_mb="auto"
from .engine.ddp import WrappedAgainError
from .engine.compile_graph_split import DDPOptimizer
from .engine.static_graph import StaticGraphChangedError
from . import comm_hooks  # miniddp.comm_hooks.allreduce_hook, ..., PowerSGDState, powerSGD_hook
from .engine.no_sync import accumulation_windows, no_sync, should_sync
from .zero.reduce_scatter_optimizer import ZeroOptimizer
from .zero.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from .fsdp.fully_shard import FSDPModule, fully_shard
from .fsdp.mixed_precision import MixedPrecisionPolicy
from .fsdp.state_dict import full_state_dict, load_full_state_dict
from .data.sharding import ShardSampler
from .by_hand.averaging import average_gradients, ring_all_reduce
from .by_hand.bucketed import BucketedDataParallel
from .training.config import TrainingConfig
from .training.batches import EvalPrediction
from .training.output_dir import OutputDirError
from .training.nonfinite import NonFiniteLossError
from .training.resume import SetupChangedError
from .training.trainer import Trainer
from .training.trainer_state import TrainerState

__version__ = "0.1.0"

__all__ = [
    "BucketedDataParallel",
    "DEVICE_BACKENDS",
    "CollectiveMismatchError",
    "DDPOptimizer",
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "DistributedDataParallel",
    "EvalPrediction",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "NonFiniteLossError",
    "OutputDirError",
    "SetupChangedError",
    "ShardSampler",
    "StalledRankError",
    "StaticGraphChangedError",
    "Trainer",
    "TrainerState",
    "TrainingConfig",
    "WrappedAgainError",
    "ZeroOptimizer",
    "ZeroRedundancyOptimizer",
    "accumulation_windows",
    "as_timedelta",
    "average_gradients",
    "comm_hooks",
    "compute_bucket_assignment",
    "device_for_local_rank",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
    "load_full_state_dict",
    "monitored_barrier",
    "no_sync",
    "parse_slurm_nodelist",
    "ring_all_reduce",
    "select_backend",
    "should_sync",
]
