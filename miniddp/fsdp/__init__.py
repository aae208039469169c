"""FSDP / ZeRO-3: the parameters themselves sharded, gathered one unit at a time; the room beside ZeRO.

What
    ``fully_shard.py`` (``fully_shard``, ``FSDPModule``: the entry point, the refusals), ``fsdp_param.py`` (one
    parameter's dim-0 shard and its full tensor, freed and refilled), ``fsdp_param_group.py`` (a unit: one
    all-gather before it computes, one reduce-scatter after its backward), ``fsdp_state.py`` (the hooks, the root's
    end of backward, the recorded order and prefetch), ``mixed_precision.py`` (``MixedPrecisionPolicy``) and
    ``state_dict.py`` (full state dicts, the optimizer's too, and gradient clipping over shards). torch FSDP2's
    names, file for file (``torch/distributed/fsdp/_fully_shard/``).

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``collectives`` for its
    all-gathers and reduce-scatters, and ``process_group``. It needs nothing of DDP's engine: a unit is its own
    bucket. Training imports it.
"""

from .fully_shard import FSDPModule, fully_shard
from .mixed_precision import MixedPrecisionPolicy
from .state_dict import (
    clip_grad_norm_,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_", "full_optimizer_state_dict", "full_state_dict",
           "fully_shard", "load_full_optimizer_state_dict", "load_full_state_dict"]
