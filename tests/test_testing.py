"""The harness itself: results in rank order, failures and hangs reported, no orphans."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from miniddp.launching.spawn import RankError, RankTimeout, run_on_ranks
from miniddp.process_group import monitored_barrier as monitored_barrier_module


def _rank_info(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, world_size, t.item(), torch.get_num_threads(), os.environ["RANK"], dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_on_ranks(_rank_info, world_size, args=(100,), timeout=60)
    total = sum(range(world_size))
    assert results == [(r + 100, world_size, total, 1, str(r), r) for r in range(world_size)]


def _initialised_ranks(rank, world_size):
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    arrived = f"mb/{monitored_barrier_module._barrier_calls}"  # the harness's barrier after init: its keys
    return sum(store.check([f"{arrived}/{r}"]) for r in range(world_size))


def test_no_rank_runs_its_function_before_every_rank_has_joined():
    # gloo's handshake is asymmetric: without this wait, a rank that returns at once can end its process
    # while a peer is still connecting, and the peer fails with "Connection closed by peer"
    assert run_on_ranks(_initialised_ranks, 3, timeout=60) == [3, 3, 3]


def _rank_one_asserts(rank, world_size):
    assert rank != 1, "rank one disagrees"
    dist.barrier()  # rank 0 waits here for a rank that already died


def test_a_rank_assertion_is_reraised_with_its_rank():
    timeout = 60
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_rank_one_asserts, 2, timeout=timeout)
    assert info.value.rank == 1 and not isinstance(info.value, RankTimeout)
    assert isinstance(info.value.__cause__, AssertionError)
    assert "rank one disagrees" in str(info.value) and "_rank_one_asserts" in info.value.remote_traceback
    assert time.monotonic() - start < timeout  # the failure ended the call, not the timeout


def _hang(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return "done"


def test_a_hung_rank_is_killed_at_the_timeout_and_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang, 2, args=(str(tmp_path),), timeout=3, init=False)
    assert info.value.ranks == [1] and "did not finish within 3 s" in str(info.value)
    assert time.monotonic() - start < 600  # killed, not waited for: the rank would sleep 600 s
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


def _each_its_own_end(rank, world_size):
    if rank == 0:
        raise ValueError("first")
    time.sleep(0.5)  # after rank 0, within the grace
    if rank == 1:
        raise KeyError("second")
    if rank == 2:
        os._exit(4)
    time.sleep(600)  # rank 3: still running when the grace ends


def test_the_error_says_what_became_of_every_other_rank():
    # a crash seen by its peers first (gloo's "Connection closed by peer") is diagnosed by the rank that died
    with pytest.raises(RankError) as info:
        run_on_ranks(_each_its_own_end, 4, timeout=60, init=False, grace=3.0)
    assert info.value.rank == 0 and info.value.exc_type == "ValueError"
    others = dict(info.value.others)
    assert others.keys() == {1, 2, 3}
    assert others[1] == "raised KeyError" and "exited with code 4" in others[2] and "killed" in others[3]


def _wait_for_a_message():
    dist.recv(torch.zeros(2), src=1)  # rank 1 never sends


def _sleep_forever():
    time.sleep(600)


def _one_receives_one_sleeps(rank, world_size):
    if rank == 0:
        _wait_for_a_message()
    else:
        _sleep_forever()


def test_a_hang_says_where_each_rank_was():
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_one_receives_one_sleeps, 2, timeout=8)
    assert info.value.ranks == [0, 1]
    stacks = info.value.stacks
    assert "_wait_for_a_message" in stacks[0] and "_sleep_forever" not in stacks[0]
    assert "_sleep_forever" in stacks[1] and "_wait_for_a_message" not in stacks[1]
    assert "dist.recv(" in stacks[0]  # the line it was waiting at, from the source
    assert "_wait_for_a_message" in str(info.value) and "_sleep_forever" in str(info.value)


def _collective_on_rank_0_only(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never issues it
    return rank


def test_a_rank_that_returned_without_the_collective_is_named():
    with pytest.raises(RankError) as info:
        run_on_ranks(_collective_on_rank_0_only, 2, timeout=60)
    assert info.value.rank == 0 and not isinstance(info.value, RankTimeout)
    others = dict(info.value.others)
    assert others.keys() == {1} and "returned" in others[1]
    last = [line for line in info.value.remote_traceback.splitlines() if line.strip()][-1]
    assert str(info.value).strip().splitlines()[-1] == last  # the rank's exception stays the last line


def test_fork_runs_functions_that_cannot_be_pickled():
    # notebooks define rank functions in __main__: only fork can run them
    scale = 3
    results = run_on_ranks(lambda rank, ws: rank * scale, 2, start_method="fork", init=False, timeout=30)
    assert results == [0, 3]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_rank_info, 0, args=(0,))


def _touch(rank, world_size, path):
    open(path, "w").close()


def _takes_timeout(rank, world_size, *, timeout):
    return timeout


def test_fn_owns_its_keywords_and_a_misspelt_option_fails_before_any_process(tmp_path):
    assert run_on_ranks(_takes_timeout, 2, kwargs={"timeout": 7}, init=False, timeout=30) == [7, 7]
    marker = tmp_path / "ran"
    with pytest.raises(TypeError, match="timout"):
        run_on_ranks(_touch, 2, args=(str(marker),), timout=3)
    with pytest.raises(TypeError, match="args="):
        run_on_ranks(_touch, 2, args=str(marker))
    with pytest.raises(TypeError, match="kwargs="):
        run_on_ranks(_touch, 2, kwargs=[("path", str(marker))])
    assert not marker.exists()  # no rank ever started


# The process table is the oracle of the tests below. A pid killed but not yet reaped is a
# zombie (state Z); one reparented to PID 1 may stay a zombie in a container: both count as dead.
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _survivors(pids, within=5.0):
    """The pids still alive after ``within`` seconds (a SIGKILL takes a moment to land)."""
    deadline = time.monotonic() + within
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _descendants(pid: int) -> list[int]:
    parents = {}  # pid -> parent pid, from the process table
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
        except OSError:  # gone meanwhile
            pass
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _start_descendants(pid_dir, rank):
    """Start a ``sleep`` child and two DataLoader workers; write the pids of this rank and all below it."""
    sleeper = subprocess.Popen(["sleep", "600"])
    # fork: a forkserver rank's default would start a forkserver of its own (seconds; same group)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)  # the workers run
    pids = [os.getpid(), *_descendants(os.getpid())]
    assert {sleeper.pid, *(w.pid for w in batches._workers)} <= set(pids), pids
    path = os.path.join(pid_dir, f"{rank}.pids")
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(path + ".tmp", path)  # a reader never sees half a list
    return sleeper, batches  # the caller keeps them referenced


def _read_pids(pid_dir, ranks):
    return [int(pid) for rank in ranks for pid in (pid_dir / f"{rank}.pids").read_text().split()]


def _no_survivors(pids, within=5.0):
    """Assert that every pid dies within ``within`` s; kill survivors, so a failing test leaves none either."""
    alive = _survivors(pids, within)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"alive: {alive} of {pids}"


def _hang_with_descendants(rank, world_size, pid_dir):
    if rank == 1:
        started = _start_descendants(pid_dir, rank)  # noqa: F841 (kept alive while hanging)
        time.sleep(600)
    return "done"


def test_a_timed_out_rank_takes_its_dataloader_workers_and_children_with_it(tmp_path):
    with pytest.raises(RankTimeout):
        run_on_ranks(_hang_with_descendants, 2, args=(str(tmp_path),), init=False, timeout=5)
    _no_survivors(_read_pids(tmp_path, [1]))


def _fail_while_a_peer_has_a_child(rank, world_size, pid_dir):
    if rank == 1:
        started = _start_descendants(pid_dir, rank)  # noqa: F841
        time.sleep(600)
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(pid_dir, "1.pids")) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("rank 0 fails while rank 1 has a child")


def test_after_a_failure_and_its_grace_nothing_survives(tmp_path):
    start = time.monotonic()
    timeout = 60
    with pytest.raises(RankError, match="rank 0 fails"):
        run_on_ranks(_fail_while_a_peer_has_a_child, 2, args=(str(tmp_path),), init=False, timeout=timeout, grace=0.5)
    assert time.monotonic() - start < timeout  # the failure's grace ended the call, not the timeout
    _no_survivors(_read_pids(tmp_path, [1]))


def _descendants_then_sleep(rank, world_size, pid_dir):
    started = _start_descendants(pid_dir, rank)  # noqa: F841
    time.sleep(600)


# A pytest-xdist worker SIGKILLed (by a CI timeout, say) runs no finally: the ranks must notice.
CALLER = """
import sys
sys.path.insert(0, {tests!r})
from miniddp.process_group import monitored_barrier as monitored_barrier_module
from miniddp.launching.spawn import run_on_ranks
from test_testing import _descendants_then_sleep

if __name__ == "__main__":
    run_on_ranks(_descendants_then_sleep, 2, args=({pid_dir!r},), init=False, start_method={method!r}, timeout=120)
"""


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_when_the_caller_is_sigkilled_no_process_of_the_run_survives(tmp_path, method):
    script = tmp_path / "caller.py"
    script.write_text(CALLER.format(tests=os.path.dirname(__file__), pid_dir=str(tmp_path), method=method))
    caller = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{r}.pids").exists() for r in (0, 1)):
            assert caller.poll() is None, f"the caller exited with {caller.returncode}"
            assert time.monotonic() < deadline, "the ranks never wrote their pids"
            time.sleep(0.05)
        pids = _read_pids(tmp_path, [0, 1])
        assert len(pids) >= 8 and _survivors(pids, within=0) == pids  # 2 ranks, 2 workers, 1 sleep each
    finally:
        caller.kill()  # SIGKILL: no finally, no atexit in the caller
        caller.wait(10)
    _no_survivors(pids)
