"""Timeouts: ddp_timeout validation, what a stalled rank does, and a barrier that names it."""

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group.monitored_barrier import monitored_barrier
from miniddp.process_group.stalled_ranks import naming_stalled_ranks
from miniddp.testing import backend_params


@pytest.mark.parametrize("value, seconds", [(1800, 1800), (2.5, 2.5), (timedelta(minutes=2), 120)])
def test_as_timedelta_accepts_seconds_and_timedeltas(value, seconds):
    assert miniddp.as_timedelta(value) == timedelta(seconds=seconds)


def test_default_is_hugging_face_default():
    assert miniddp.DEFAULT_TIMEOUT_S == 1800


@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf, timedelta(0), timedelta(seconds=-3), 1e308])
def test_non_positive_or_nan_timeouts_are_rejected(bad):
    with pytest.raises(ValueError, match="ddp_timeout"):
        miniddp.as_timedelta(bad)


@pytest.mark.parametrize("bad", ["30", None, True])
def test_wrong_types_are_rejected(bad):
    with pytest.raises(TypeError, match="ddp_timeout"):
        miniddp.as_timedelta(bad)


# --8<-- [start:stall]
def _one_rank_stalls(rank, world_size, backend, timeout_s):
    import os

    if backend == "nccl":
        os.environ.update(TORCH_NCCL_ASYNC_ERROR_HANDLING="1", TORCH_NCCL_BLOCKING_WAIT="1")  # raise, not abort
    env = miniddp.init_distributed(backend=backend, timeout=timeout_s)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # a slow checkpoint, a stuck data loader... until rank 0 has given up on it
        store.wait(["test: rank 0 raised"], timedelta(seconds=60))
        return None
    start = time.monotonic()
    t = torch.ones(4, device=env.device)
    try:
        dist.all_reduce(t)  # rank 0 waits here for rank 1
        if env.device.type == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as err:  # the transport's error: its type, not its words
        store.set("test: rank 0 raised", "1")
        return type(err).__name__, time.monotonic() - start
    return "returned", time.monotonic() - start


@pytest.mark.parametrize("backend", backend_params(2))
def test_stalled_rank_makes_its_peer_raise_within_the_timeout(backend):
    timeout_s = 3
    (raised, waited), _ = run_on_ranks(_one_rank_stalls, 2, args=(backend, timeout_s), backend=backend,
                                       init=False, timeout=90)
    assert raised != "returned"  # rank 0 raised on its own: rank 1 only comes back once it has
    assert waited >= timeout_s, f"rank 0 raised after {waited:.1f} s, before its {timeout_s} s timeout"
# --8<-- [end:stall]


def _barrier_with_a_late_rank(rank, world_size, late_rank):
    store = dist.distributed_c10d._get_default_store()
    if rank == late_rank:  # late: it arrives only once every other rank has given up on it
        store.wait([f"test: rank {r} gave up" for r in range(world_size) if r != late_rank], timedelta(seconds=60))
    try:
        monitored_barrier(timeout=1.5)
    except miniddp.StalledRankError as exc:
        store.set(f"test: rank {rank} gave up", "1")
        return exc.missing, str(exc)
    return None


def test_monitored_barrier_names_the_missing_rank_on_every_rank():
    results = run_on_ranks(_barrier_with_a_late_rank, 3, args=(2,), timeout=90)
    for rank in (0, 1):
        missing, message = results[rank]
        assert missing == [2], results
        assert "rank(s) [2] did not reach the barrier" in message
    late_missing, late_message = results[2]  # the latecomer learns it was left behind
    assert late_missing == [2] and "late" in late_message


def _barrier_three_times(rank, world_size):
    for _ in range(3):
        monitored_barrier(timeout=10)
    return "passed"


def test_monitored_barrier_passes_when_everyone_arrives():
    assert run_on_ranks(_barrier_three_times, 3, timeout=30) == ["passed"] * 3


def test_monitored_barrier_validates_its_timeout():
    with pytest.raises(ValueError, match="timeout=-1"):
        monitored_barrier(timeout=-1)  # refused before it touches any store


def _every_rank_fails_in_the_same_collective(rank, world_size):
    dist.barrier()  # all fail at the same moment, well within the 1 s that would make one "late"
    try:
        with naming_stalled_ranks("all-reduce of test #1"):
            raise RuntimeError("Connection reset by peer (simulated: the network failed under every rank)")
    except miniddp.StalledRankError as err:
        return err.missing, str(err)


def test_when_every_rank_was_waiting_the_transport_is_blamed_not_a_rank():
    for missing, message in run_on_ranks(_every_rank_fails_in_the_same_collective, 3, timeout=60):
        assert missing == [] and "every rank was waiting in the all-reduce of test #1" in message, message


def _errors_are_told_apart_by_type_not_by_words(rank, world_size):
    dist.barrier()
    out = {}
    try:
        with naming_stalled_ranks("all-reduce of test #2"):
            raise RuntimeError("words no transport uses")  # gloo's errors have no type of their own
    except miniddp.StalledRankError as err:
        out["RuntimeError"] = err.missing, type(err.__cause__).__name__
    for kind in (miniddp.CollectiveMismatchError, torch.OutOfMemoryError):  # a verdict already; this rank's own
        try:
            with naming_stalled_ranks("all-reduce of test #3"):
                raise kind("passes through")
        except kind as err:
            out[kind.__name__] = type(err).__name__
    return out


def test_any_runtime_error_of_the_collective_checks_in_but_verdicts_and_local_errors_pass_through():
    for out in run_on_ranks(_errors_are_told_apart_by_type_not_by_words, 2, timeout=60):
        assert out == {"RuntimeError": ([], "RuntimeError"), "CollectiveMismatchError": "CollectiveMismatchError",
                       "OutOfMemoryError": "OutOfMemoryError"}, out
