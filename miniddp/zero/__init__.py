"""Sharded data parallelism (ZeRO): the room between the engine and training.

Data parallelism keeps a whole copy of the model, its gradients and its optimizer state on every
rank. ZeRO (Rajbhandari et al., arXiv 1910.02054) shards them across ranks instead: stage 1 the
optimizer state, stage 2 the gradients too, reduce-scattered bucket by bucket through the engine's
collective seam (``engine/bucket_collective.py``) instead of all-reduced.

What
    Stage 1 as torch builds it (``torch/distributed/optim/zero_redundancy_optimizer.py``):
    ``zero_partition.py`` (which rank owns which parameter's state) and ``zero_redundancy_optimizer.py``
    (``ZeroRedundancyOptimizer``, torch's signature). Stages 1 and 2 through the engine, as DeepSpeed
    builds them: ``gradient_shards.py`` (each bucket reduce-scattered, a shard of the mean kept) and
    ``reduce_scatter_optimizer.py`` (``ZeroOptimizer``: the shard stepped, the parameters all-gathered) and
    ``gather_prefetch.py`` (that all-gather left in flight after the step, each parameter waited for at its use).
    DeepSpeed's config, read into what is implemented: ``deepspeed_config.py`` (the names, the stage),
    ``deepspeed_keys.py`` (every key checked, honoured or refused) and ``deepspeed_optim.py`` (its
    ``optimizer`` and ``scheduler`` blocks, as AdamW and warmup schedules).

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``engine``, ``by_hand``,
    ``comm_hooks``, ``collectives``, ``process_group`` and ``data``. Training imports it.
"""

from .reduce_scatter_optimizer import ZeroOptimizer
from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroOptimizer", "ZeroRedundancyOptimizer"]
