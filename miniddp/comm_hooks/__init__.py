"""Communication hooks: what happens to a bucket between "its gradients are ready" and ".grad".

What
    A comm hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: it receives one
    bucket (``grad_bucket.GradBucket``), starts whatever communication it likes and returns a
    future of the averaged flat buffer, which the reducer writes back into ``.grad``.
    ``grad_bucket.py`` is that contract (the bucket, and the checks at registration);
    ``default_hooks.py`` the default hooks (all-reduce at full precision, fp16 and bf16 compression);
    ``powersgd.py`` PowerSGD (two thin matrices instead of each gradient matrix); ``call_order.py``
    when a hook may get the next bucket (at once, or once the previous future is done).
    ``hook_by_name`` (below) maps Accelerate's names to hooks.

Why
    The hook is the one place to change what crosses the wire without touching the bucketing,
    the overlap or the ordering around it.

How torch differs
    The same layout as torch's ``torch/distributed/algorithms/ddp_comm_hooks/``: its
    ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``,
    ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``, and ``DDPCommHookType`` in
    ``torch/distributed/algorithms/ddp_comm_hooks/__init__.py``; torch's own hooks run unchanged on miniddp.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``process_group``,
    ``data`` and ``collectives`` (whose ``count_bytes`` it re-exports). The by-hand steps share its floor
    and stay independent of it.
"""

from __future__ import annotations

from ..collectives.byte_count import ByteCount, count_bytes
from .default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .grad_bucket import GradBucket
from .powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

# --8<-- [start:by_name]
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")  # Accelerate's DDPCommunicationHookType


def hook_by_name(name: str, process_group=None, powersgd_rank: int = 1, powersgd_start_iter: int = 1_000):
    """``(state, hook)`` for a ``--ddp_comm_hook`` name (``None`` for "no"), as Accelerate's
    ``DistributedDataParallelKwargs(comm_hook=...)`` builds it; PowerSGD's state gets the rank and start step."""
    if name == "no":
        return None
    if name in ("fp16", "bf16"):
        return process_group, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[name]
    if name in ("power_sgd", "batched_power_sgd"):
        state = PowerSGDState(process_group, matrix_approximation_rank=powersgd_rank,
                              start_powerSGD_iter=powersgd_start_iter)
        return state, powerSGD_hook if name == "power_sgd" else batched_powerSGD_hook
    raise ValueError(f"ddp_comm_hook={name!r} must be one of {', '.join(COMM_HOOKS)}")
# --8<-- [end:by_name]


__all__ = ["COMM_HOOKS", "ByteCount", "GradBucket", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook",
           "bf16_compress_hook", "count_bytes", "fp16_compress_hook", "hook_by_name", "powerSGD_hook"]
