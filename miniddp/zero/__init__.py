"""Sharded data parallelism (ZeRO): the room between the engine and training.

Data parallelism keeps a whole copy of the model, its gradients and its optimizer state on every
rank. ZeRO (Rajbhandari et al., arXiv 1910.02054) shards them across ranks instead: stage 1 the
optimizer state (torch's ``torch/distributed/optim/zero_redundancy_optimizer.py``), stage 2 the
gradients too, reduce-scattered bucket by bucket through the engine's collective seam
(``engine/bucket_collective.py``) instead of all-reduced. This layer may import the engine and
everything below it; training imports it. Stage 1 as torch builds it: ``zero_partition.py`` (who owns which parameter's
state) and ``zero_optimizer.py`` (``ZeroRedundancyOptimizer``, torch's signature). Stages 1 and 2 through
the engine, as DeepSpeed builds them: ``gradient_shards.py`` (each bucket reduce-scattered, a shard kept)
and ``zero_ddp_optimizer.py`` (``ZeroOptimizer``: the shard stepped, the parameters all-gathered).
"""

from .zero_ddp_optimizer import ZeroOptimizer
from .zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroOptimizer", "ZeroRedundancyOptimizer"]
