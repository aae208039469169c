"""The harness itself: results in rank order, failures and hangs reported, no orphans."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from miniddp.testing import RankError, RankTimeout, run_on_ranks


def _rank_info(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, world_size, t.item(), torch.get_num_threads(), os.environ["RANK"], dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_on_ranks(_rank_info, world_size, 100, timeout=60)
    total = sum(range(world_size))
    assert results == [(r + 100, world_size, total, 1, str(r), r) for r in range(world_size)]


def _rank_one_asserts(rank, world_size):
    assert rank != 1, "rank one disagrees"
    dist.barrier()  # rank 0 waits here for a rank that already died


def test_a_rank_assertion_is_reraised_with_its_rank():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_rank_one_asserts, 2, timeout=60)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, AssertionError)
    assert "rank one disagrees" in str(info.value) and "_rank_one_asserts" in info.value.remote_traceback
    assert time.monotonic() - start < 20  # not the full timeout


def _hang(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return "done"


def test_a_hung_rank_is_killed_at_the_timeout_and_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang, 2, str(tmp_path), timeout=3, init=False)
    assert info.value.ranks == [1] and "did not finish within 3 s" in str(info.value)
    assert time.monotonic() - start < 15
    pid = int((tmp_path / "1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan
        os.kill(pid, 0)


def _crash(rank, world_size):
    if rank == 0:
        os._exit(3)
    return "ok"


def test_a_rank_that_dies_without_an_exception_is_reported():
    with pytest.raises(RankError, match="exited with code 3"):
        run_on_ranks(_crash, 2, timeout=30, init=False)


def test_fork_runs_functions_that_cannot_be_pickled():
    # notebooks define rank functions in __main__: only fork can run them
    scale = 3
    results = run_on_ranks(lambda rank, ws: rank * scale, 2, start_method="fork", init=False, timeout=30)
    assert results == [0, 3]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_rank_info, 0, 0)
