"""DDP's memory per rank (benchmarks/memory.py): the breakdown is right, and so is the ZeRO arithmetic."""

import sys
from pathlib import Path

import pytest
import torch

from miniddp.launching.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of scripts, not an installed package
from benchmarks.memory import count_storages, zero_bytes_per_rank  # noqa: E402

GB = 1e9


def _breakdowns(rank, world_size):
    """miniddp and torch DDP, with and without gradient_as_bucket_view, on a small GELU MLP."""
    sys.path.insert(0, str(ROOT))  # the rank is a fresh process
    from benchmarks.memory import measure

    return {(impl, view): measure(rank, world_size, impl, view, steps=2, batch=8, hidden=64, layers=2)
            for impl in ("miniddp", "torch") for view in (False, True)}


# --8<-- [start:breakdown]
@pytest.mark.timeout(120)
def test_gradient_as_bucket_view_keeps_one_copy_of_the_gradients_not_two():
    for rank, got in enumerate(run_on_ranks(_breakdowns, 2, timeout=90)):
        for (impl, view), b in got.items():
            model = b["param_bytes"]  # one fp32 copy of the model
            where = f"rank {rank}, {impl}, gradient_as_bucket_view={view}"
            assert b["parameters"] == model, where
            assert b["buckets"] == model, where  # every gradient has a slot in a flat buffer
            # Adam: exp_avg and exp_avg_sq per parameter, and a 4-byte `step` per tensor
            assert b["optimizer"] == 2 * model + 4 * 6, where
            if view:  # .grad *is* a slice of a bucket: nothing of its own
                assert b["gradients"] == 0 and b["grads_in_buckets"] == 6, where
                assert b["gradients"] + b["buckets"] == model, where
            else:  # .grad is a copy out of the bucket: the gradients twice
                assert b["gradients"] == model and b["grads_in_buckets"] == 0, where
                assert b["gradients"] + b["buckets"] == 2 * model, where
        for view in (False, True):  # the oracle: torch's DDP holds the same bytes in each category
            keys = ("parameters", "gradients", "optimizer", "buckets", "grads_in_buckets")
            assert {k: got["torch", view][k] for k in keys} == {k: got["miniddp", view][k] for k in keys}
# --8<-- [end:breakdown]


def test_count_storages_counts_shared_memory_once():
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:]]  # two gradients inside one bucket
    assert count_storages({"buckets": [flat], "gradients": views}) == {"buckets": 40, "gradients": 0}
    copies = [v.clone() for v in views]  # negative control: their own storage costs again
    assert count_storages({"buckets": [flat], "gradients": copies}) == {"buckets": 40, "gradients": 40}
    assert count_storages({"gradients": [None, views[0]]}) == {"gradients": 40}  # the whole storage


# --8<-- [start:zero]
def test_zero_formula_gives_the_papers_numbers():
    # ZeRO paper (arXiv 1910.02054), Figure 1: 7.5 B parameters, 64 ranks, mixed-precision Adam (K = 12)
    psi, n = 7.5e9, 64
    got = [zero_bytes_per_rank(psi, n, stage) / GB for stage in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    assert zero_bytes_per_rank(psi, 1, 3) == zero_bytes_per_rank(psi, 1, 0)  # one rank: nothing to shard
    assert zero_bytes_per_rank(psi, 8, 0) == zero_bytes_per_rank(psi, 64, 0)  # DDP: independent of N
    with pytest.raises(ValueError, match="stage=4"):
        zero_bytes_per_rank(psi, n, 4)
# --8<-- [end:zero]
