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

import pytest
import torch

from miniddp.comm_hooks.grad_bucket import hook_result
from miniddp.teaching.exercise import exercise_command
from miniddp.teaching.exercise.catalog import EXERCISES
from miniddp.teaching.exercise.exercise_command import main, run_checks

S, A = "tests/test_sharding.py::", "tests/test_averaging.py::"
SAME, EDGE = S + "test_same_indices_as_torch_distributed_sampler", S + "test_edge_cases_match_torch"
SPLIT = S + "test_global_batch_is_the_same_set_whatever_the_split"
CHUNKS, RING, SUBGROUPS = (A + "test_chunk_bounds_tile_the_tensor_with_sizes_differing_by_at_most_one",
                           A + "test_ring_all_reduce_equals_dist_all_reduce",
                           A + "test_ring_all_reduce_on_subgroups_uses_group_ranks")
SPIN_S, RING_S, CAP_MB = 4, 10, 1500  # a reference session of these items stays near 600 MB

SAMPLER = '''
from miniddp.by_hand.sharding import ShardSampler as Reference


class ShardSampler(Reference):
    def __iter__(self):
        out = list(super().__iter__())
{body}
'''
SPINS = SAMPLER.format(body="        while True:  # never stops, allocates nothing: only the time limit ends it\n"
                            "            pass")
CONTIGUOUS = '''
import copy

from miniddp.by_hand.sharding import ShardSampler as Reference


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
