"""The test harness: what only the test suite needs, kept apart from the library.

What
    ``run_on_ranks`` starts a test's ranks: it is ``miniddp.launching.spawn.run_on_ranks``, re-exported
    here (it lives in the launching layer because notebooks and ``notebook_launcher`` use it too); a test
    may import it from either. ``backend_params(world_size)`` gives a test its backends as pytest
    parameters: gloo always, NCCL only where there is a GPU per rank (skipped with the reason otherwise);
    ``nccl_available`` is the same question as a bool. ``netlab.py`` builds hosts in network namespaces
    joined by links of a chosen rate (root only).

Why
    The library never imports this package (import-linter holds it), so nothing a user runs can
    depend on pytest or on root's network namespaces.

How torch differs
    torch's ``torch/testing/_internal/common_distributed.py`` skips a test with an exit code when it lacks GPUs
    (``skip_if_lt_x_gpu``); here the skip is a pytest parameter, visible in the test's id.

May import
    every room of the library (it is the top of import-linter's layers contract, ``pyproject.toml``):
    ``launching`` above all, for ``run_on_ranks``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..launching.spawn import run_on_ranks

__all__ = ["backend_params", "nccl_available", "run_on_ranks"]


def nccl_available(world_size: int) -> bool:
    """True when NCCL can run ``world_size`` ranks here (one GPU per rank)."""
    return dist.is_nccl_available() and torch.cuda.device_count() >= world_size


def backend_params(world_size: int):
    """pytest parameters: gloo always, nccl when there is a GPU per rank (else skipped)."""
    import pytest  # imported when a test asks: ``import miniddp.testing`` alone does not need it

    reason = f"nccl needs {world_size} CUDA device(s); torch.cuda.device_count()={torch.cuda.device_count()}"
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param("nccl", id="nccl",
                     marks=[pytest.mark.nccl, pytest.mark.skipif(not nccl_available(world_size), reason=reason)]),
    ]
