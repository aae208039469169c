"""`miniddp exercise check` is bounded and says why: whatever the learner's file does.

A learner's file may never stop, eat memory in every rank, deadlock the ranks, exit at import, or
not be UTF-8. The check must end, report each item (stopped by the time limit or the memory cap,
with its value; not run because an earlier item of that file hung; or failed, with the case, the
falsifying example and what differs), never run the learner's code in its own process, and exit
0 only when every item passed. Each test starts few pytest sessions: the cases share one batch.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from miniddp.comm_hooks.grad_bucket import hook_result
from miniddp.teaching.exercise import exercise_command, keeper
from miniddp.teaching.exercise.catalog import EXERCISES
from miniddp.teaching.exercise.exercise_command import main, run_checks
from miniddp.teaching.exercise.swap import LearnerFileError

S, A = "tests/test_sharding.py::", "tests/test_averaging.py::"
SAME, EDGE = S + "test_same_indices_as_torch_distributed_sampler", S + "test_edge_cases_match_torch"
SPLIT = S + "test_global_batch_is_the_same_set_whatever_the_split"
CHUNKS, RING, SUBGROUPS = (A + "test_chunk_bounds_tile_the_tensor_with_sizes_differing_by_at_most_one",
                           A + "test_ring_all_reduce_equals_dist_all_reduce",
                           A + "test_ring_all_reduce_on_subgroups_uses_group_ranks")
SPIN_S, RING_S, CAP_MB = 4, 10, 1500  # a reference session of these items stays near 600 MB

SAMPLER = '''
from miniddp.data.sharding import ShardSampler as Reference


class ShardSampler(Reference):
    def __iter__(self):
        out = list(super().__iter__())
{body}
'''
SPINS = SAMPLER.format(body="        while True:  # never stops, allocates nothing: only the time limit ends it\n"
                            "            pass")
CONTIGUOUS = '''
import copy

from miniddp.data.sharding import ShardSampler as Reference


class ShardSampler(Reference):
    def __iter__(self):
        shards = []
        for rank in range(self.num_replicas):
            other = copy.copy(self)
            other.rank = rank
            shards.append(list(Reference.__iter__(other)))
        order = [i for step in zip(*shards) for i in step]  # the padded permutation, back from its stride
        size = len(shards[self.rank])
        return iter(order[self.rank * size:(self.rank + 1) * size])  # contiguous blocks instead of a stride
'''
REVERSED = SAMPLER.format(body="        return iter(out[::-1])")
WORDY = '''
def chunk_bounds(numel, world_size):
    raise ValueError("chunk " * 400 + "END")


def ring_all_reduce(tensor, group=None):
    return tensor
'''
DEADLOCK = '''
import torch.distributed as dist


def ring_all_reduce(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world > 1:
        dist.recv(tensor.clone(), src=(rank - 1) % world)  # every rank receives first: nobody ever sends
    return tensor
'''
HOG = '''
import time


def ring_all_reduce(tensor, group=None):
    hoard = []
    while True:  # in every rank: only the memory cap over the whole process tree ends it
        hoard.append(bytearray(10_000_000))
        time.sleep(0.02)
'''


def _write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_time_and_memory_bound_every_check_and_a_hang_costs_one_timeout_per_file(tmp_path):
    files = {k: _write(tmp_path / k, "sharding" if k in ("spins", "contiguous", "reversed") else "ring", text)
             for k, text in [("spins", SPINS), ("contiguous", CONTIGUOUS), ("reversed", REVERSED), ("wordy", WORDY),
                             ("deadlock", DEADLOCK), ("hog", HOG)]}
    spins, contiguous, reversed_, wordy, deadlock, hog = run_checks([
        ("sharding", files["spins"], [SAME, EDGE], SPIN_S),
        ("sharding", files["contiguous"], [SPLIT], 60),
        ("sharding", files["reversed"], [EDGE], 60),
        ("ring", files["wordy"], [CHUNKS], 60),
        ("ring", files["deadlock"], [RING, SUBGROUPS], RING_S),
        ("ring", files["hog"], [SUBGROUPS], 60),
    ], memory_mb=CAP_MB)
    # 1. a sampler that never stops: stopped at the time limit, once; the file's next item is not run
    assert [i["outcome"] for i in spins] == ["stopped", "not run"]
    assert spins[0]["stopped"] == "time" and spins[0]["limit"] == SPIN_S and "__iter__" in spins[0]["reason"]
    assert spins[1]["after"] == SAME and not any(i["passed"] for i in spins)
    # ... and memory grown in the ranks, not the check's own process: stopped at the cap over the tree
    assert hog[0]["outcome"] == "stopped" and hog[0]["stopped"] == "memory" and hog[0]["limit"] == CAP_MB
    # 3. a deadlocked ring: one timeout, then the report shows where each rank was, at the learner's line
    assert [i["outcome"] for i in deadlock] == ["stopped", "not run"] and deadlock[1]["after"] == RING
    assert deadlock[0]["stopped"] == "time" and deadlock[0]["limit"] == RING_S
    assert deadlock[0]["reason"].count("ring_all_reduce") >= 2 and "dist.recv(" in deadlock[0]["reason"]
    # 5. the falsifying example, whole reprs, the failing case, words never cut
    [split] = contiguous
    assert split["outcome"] == "failed" and "per_step=" in split["reason"] and "seed=" in split["reason"]
    compared = [line.strip()[len("assert "):].split(" == ") for line in split["reason"].splitlines()
                if line.strip().startswith("assert [")]
    assert compared and all(Ellipsis not in ast.literal_eval(side) for side in compared[0])  # whole, not "..."
    assert any(line.strip().startswith("At index") for line in split["reason"].splitlines())  # what differs
    [edge] = reversed_
    assert edge["case"] and f"[{edge['case']}]" in edge["reason"]
    first_line = wordy[0]["reason"].splitlines()[0]
    assert first_line.count("chunk") > 50 and not any(
        word != "chunk" and "chunk".startswith(word) for word in first_line.split())


def _marking(marks, then, *required):
    """Module-level code that records the pid of the process running it, then ``then``; the exercise's
    ``required`` names defined after it, as the first look at the file (which never runs it) demands."""
    defined = "".join(f"\n\ndef {name}(*args):\n    pass\n" for name in required)
    mark = f"os.path.join({str(marks)!r}, f'{required[0]}.{{os.getpid()}}')"
    return f"import os, sys\nopen({mark}, 'w').close()\n{then}\n{defined}"


def test_module_level_code_runs_only_in_the_bounded_session_and_list_goes_on(tmp_path, monkeypatch, capsys):
    marks, folder = tmp_path / "marks", tmp_path / "mine"
    marks.mkdir()
    monkeypatch.setattr(exercise_command, "CHECK_TIMEOUT_S", 5)
    _write(folder, "sharding", _marking(marks, "sys.exit(0)", "ShardSampler"))
    _write(folder, "bucketing", _marking(marks, "while True:\n    pass", "compute_bucket_assignment"))
    _write(folder, "join", _marking(marks, "os._exit(0)", "Join", "exchange_round"))
    (folder / "ring.py").write_bytes(b"# caf\xe9\ndef ring_all_reduce(tensor, group=None):\n    return tensor\n")
    assert main(["list", "--dir", str(folder)]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    for name in ("sharding", "bucketing", "join", "ring"):
        assert "does not load" in rows[name] and f"{name}.py" in rows[name], rows[name]
    assert "ring.py:1" in rows["ring"]  # the file and the line of the byte that is not UTF-8
    assert rows["averaging"].endswith("not started")
    ran = {tuple(p.name.split(".")) for p in marks.iterdir()}
    assert {name for name, _ in ran} == {"ShardSampler", "compute_bucket_assignment", "Join"}  # each file ran...
    assert str(os.getpid()) not in {pid for _, pid in ran}  # ... never in this process
    # 6. columns from the data: each exercise's required names and status start at one column
    for column in (lambda e: ", ".join(e.required), lambda e: "does not load" if e.name in (
            "sharding", "bucketing", "join", "ring") else "not started"):
        assert len({rows[e.name].index(column(e)) for e in EXERCISES}) == 1


def test_a_file_that_exits_at_import_fails_the_check_in_one_line(tmp_path, capsys):
    _write(tmp_path, "join", _marking(tmp_path, "os._exit(0)", "Join", "exchange_round"))
    assert main(["check", "join", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "join.py" in err and "Traceback" not in err


def test_bad_folders_and_files_are_one_line_and_exit_2(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n", encoding="utf-8")
    for folder in (a_file, a_file / "under"):  # a file; a path under a file (read-only, even for root)
        assert main(["start", "sharding", "--dir", str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(folder) in err and "Traceback" not in err
    (tmp_path / "sharding.py").write_bytes(b"class ShardSampler:\n    name = 'caf\xe9'\n")
    assert main(["check", "sharding", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sharding.py:2" in err and "Traceback" not in err


def test_the_default_all_reduce_is_not_called_a_comm_hook():
    with pytest.raises(TypeError) as info:
        hook_result(None, 0, "not a tensor", torch.zeros(2))
    assert "hook" not in str(info.value) and "bucket 0" in str(info.value)


def test_a_block_not_written_yet_shows_no_example_and_a_wrong_value_does():
    from miniddp.teaching.exercise.reasons import explain

    todo, wrong = NotImplementedError("sharding: write ShardSampler here"), AssertionError("rank 1 differs")
    for exc in (todo, wrong):
        exc.add_note("Falsifying example: test(n=3)")
    assert not any("Falsifying" in line for line in explain(todo))  # fails on any input: the example is noise
    assert any("Falsifying" in line for line in explain(wrong))


# --- nothing of the session outlives the check; nothing in it changes what the check compares with -------------

def _alive(procs) -> list[int]:
    """Those of ``procs`` (pid, start time) still running: a pid reused since is another process."""
    left = []
    for pid, start in procs:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] not in "ZX":
            left.append(pid)
    return left


def _started(pids) -> set[tuple[int, str]]:
    """(pid, start time) of each of ``pids`` still there: how ``_alive`` knows a process again."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                found.add((pid, f.read().rpartition(")")[2].split()[19]))
        except OSError:
            pass
    return found


def _kill(procs) -> None:
    for pid in _alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _poll(condition, bound_s: float, step_s: float = 0.1):
    """``condition()`` once it is true, or its last value after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(step_s)
    return value


MARKS_PID = "open(os.path.join({marks!r}, str(os.getpid())), 'w').close()"
HANGS_WITH_A_CHILD = '''
import os
import time

if os.fork() == 0:  # a child of the session's process
    {mark}
    time.sleep(600)
    os._exit(0)
{mark}
while True:  # the import never ends: the check is signalled meanwhile
    time.sleep(0.1)


class ShardSampler:
    pass
'''


def test_a_check_ended_by_sigterm_sighup_or_sigkill_leaves_no_process_of_its_session(tmp_path):
    signals = (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
    checks, tracked, began = {}, set(), time.monotonic()
    try:
        for signum in signals:  # in parallel: a check's start is mostly importing torch, twice
            marks = tmp_path / signum.name / "marks"
            marks.mkdir(parents=True)
            _write(marks.parent, "sharding", HANGS_WITH_A_CHILD.format(mark=MARKS_PID.format(marks=str(marks))))
            checks[signum] = subprocess.Popen(
                [sys.executable, "-m", "miniddp", "exercise", "check", "sharding", "--dir", str(marks.parent)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for signum, check in checks.items():  # the session's process and its child are both running
            marks = tmp_path / signum.name / "marks"
            assert _poll(lambda: len(list(marks.iterdir())) == 2 or check.poll() is not None, 600)
            assert check.poll() is None
        started_s = time.monotonic() - began
        for signum, check in checks.items():
            session = {pid for pid, _, _ in keeper.descendants(check.pid)}  # the keeper, pytest, the child
            marked = {int(p.name) for p in (tmp_path / signum.name / "marks").iterdir()}
            assert marked <= session
            tracked |= _started(session | {check.pid})
            check.send_signal(signum)
        for signum, check in checks.items():
            check.wait(10 * started_s)  # a bound from this run: ending is far quicker than starting
            assert check.returncode == (-signum if signum == signal.SIGKILL else 128 + signum)
        assert _poll(lambda: not _alive(tracked), 10 * started_s)
        assert _alive(tracked) == []
    finally:
        for check in checks.values():
            check.kill()
            check.wait()
        _kill(tracked)


DETACHES = '''
import os
import time

if os.fork() == 0:
    os.setsid()  # out of the check's process session: no sweep of that session reaches it
    os.fork()  # and a child of its own
    {mark}
    time.sleep(600)
    os._exit(0)
while len(os.listdir({marks!r})) < 2:  # both are running before the import fails
    time.sleep(0.05)
raise RuntimeError("the file does not load: the check ends at once")


class ShardSampler:
    pass
'''


def test_a_process_the_learners_file_detached_with_setsid_ends_with_the_check(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = _write(tmp_path / "mine", "sharding", DETACHES.format(mark=MARKS_PID.format(marks=str(marks)),
                                                                  marks=str(marks)))
    tracked = set()
    try:
        with pytest.raises(LearnerFileError):
            run_checks([("sharding", path, [SAME], 60)])
        tracked = _started(int(p.name) for p in marks.iterdir())
        assert len(list(marks.iterdir())) == 2 and _poll(lambda: not _alive(tracked), 30)
    finally:
        tracked |= _started(int(p.name) for p in marks.iterdir())
        _kill(tracked)


MEAN = A + "test_average_gradients_is_the_mean_over_ranks"
SUMS_AND_SILENCES_ASSERT_CLOSE = '''
import torch
import torch.distributed as dist

torch.testing.assert_close = lambda *args, **kwargs: None  # at import: every comparison would pass


def average_gradients(params, group=None, predivide=True):
    params = params.parameters() if isinstance(params, torch.nn.Module) else params
    grads = [p.grad for p in params if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad, group=group)  # the sum, never divided: a wrong mean
    return len(grads)
'''
RIGHT_BUT_SILENCES_WHEN_CALLED = '''
import torch

from miniddp.by_hand.averaging import {name} as reference


def {name}(*args, **kwargs):
    torch.testing.assert_close = lambda *args, **kwargs: None  # when called: {where}
    return reference(*args, **kwargs)
{more}'''


def test_a_file_that_replaces_assert_close_fails_the_check(tmp_path):
    at_import = _write(tmp_path / "import", "averaging", SUMS_AND_SILENCES_ASSERT_CLOSE)
    in_session = _write(tmp_path / "session", "ring", RIGHT_BUT_SILENCES_WHEN_CALLED.format(
        name="chunk_bounds", where="in the spec's own process",
        more="\n\ndef ring_all_reduce(tensor, group=None):\n    return tensor\n"))
    in_rank = _write(tmp_path / "rank", "averaging", RIGHT_BUT_SILENCES_WHEN_CALLED.format(
        name="average_gradients", where="in a rank", more=""))
    imported, session, rank = exercise_command.check_batch([
        ("averaging", at_import, [MEAN], 60), ("ring", in_session, [CHUNKS], 60), ("averaging", in_rank, [MEAN], 60)])
    # a wrong mean is never reported passing: the file does not load, and the error names what it replaced
    assert isinstance(imported, LearnerFileError) and "torch.testing.assert_close" in str(imported)
    # right values, but a comparison replaced while the spec ran: the item fails, naming it
    for [item] in (session, rank):
        assert item["outcome"] == "failed" and not item["passed"], item
        assert "ComparisonReplacedError" in item["reason"] and "torch.testing.assert_close" in item["reason"]
