"""Every run ends cleanly: no gloo thread outlives the group miniddp created, and user scripts with
and without destroy_process_group() exit 0 under torchrun (pytorch#190489).

The abort is a race at interpreter teardown, so two kinds of test: facts checked once in a fresh
process (which gloo threads are alive when teardown starts; the torch behaviour beside ours), and
real torchrun runs of user scripts, each a fresh interpreter on every rank, with a negative control
that shows the abort when the guard is switched off. In every guarded run a witness
(``exit_scripts/witness/sitecustomize.py``) records the gloo threads alive when teardown begins:
the abort needs one, so "none, in every run" holds the guard to its mechanism deterministically,
where an exit-status count alone catches a broken guard only with the race's odds (1 run in 10 to 4
in 10 abort without it, depending on the load). That is what lets each script run once: a fresh
interpreter on every rank, torch and torch._dynamo imported each time, is the dearest process the suite
starts. A count of aborts without the guard is not kept: at those odds it could not fail in a bounded
number of runs (see the comment where it stood, at the end of this file)."""

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group.clean_exit import destroy_process_group, gloo_threads

SCRIPTS = Path(__file__).resolve().parent / "exit_scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"
RUNS = 1  # with the witness, one run shows a broken guard; the run shows the exit status end to end


def _fresh(script: str, *args: str, guard: bool = True, tmp_path: Path):
    """Run a script in a fresh interpreter (a world of one); return the JSON it wrote."""
    report = tmp_path / "report.json"
    env = {**os.environ, "MINIDDP_CLEAN_EXIT": "1" if guard else "0", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):  # no launcher: a world of one
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args, str(report)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


# --8<-- [start:facts]
def test_the_group_init_distributed_created_is_gone_before_teardown(tmp_path):
    assert _fresh("threads_at_exit.py", "miniddp", "nothing", tmp_path=tmp_path) == []


def test_negative_control_without_the_guard_gloo_threads_live_into_teardown(tmp_path):
    alive = _fresh("threads_at_exit.py", "miniddp", "nothing", guard=False, tmp_path=tmp_path)
    assert "pt_gloo_runloop" in alive  # what the abort needs: a gloo thread that may still ask for the GIL


def test_destroy_process_group_joins_gloo_threads_while_a_miniddp_model_is_alive(tmp_path):
    assert _fresh("threads_at_exit.py", "miniddp", "destroy", guard=False, tmp_path=tmp_path) == []


def test_torch_ddp_keeps_the_group_and_its_threads_past_destroy(tmp_path):
    # torch's behaviour beside ours: its DDP holds self.process_group, so destroy cannot join the threads
    alive = _fresh("threads_at_exit.py", "torch", "destroy", guard=False, tmp_path=tmp_path)
    assert "pt_gloo_runloop" in alive


@pytest.mark.parametrize("mode", ["plain", "miniddp-first"])
def test_late_imported_torch_defaults_hold_the_group_unless_miniddp_came_first(mode, tmp_path):
    got = _fresh("defaults_hold_group.py", mode, tmp_path=tmp_path)
    if mode == "plain":  # torch alone: torch._dynamo imports torch.distributed.nn.functional after the group
        assert got["defaults_hold_group"] and "pt_gloo_runloop" in got["gloo_threads_after_destroy"]
    else:
        assert got == {"defaults_hold_group": False, "gloo_threads_after_destroy": []}
# --8<-- [end:facts]


def _destroy_beside_a_stalled_peer(rank, world_size, stall_s):
    if rank == 1:
        time.sleep(stall_s)  # never joins rank 0's all-reduce: stalled, or gone
        return None
    dist.all_reduce(torch.ones(4), async_op=True)  # in flight, waiting for rank 1
    start = time.monotonic()
    gone = destroy_process_group(timeout_s=0.5)
    took = time.monotonic() - start
    return gone, took, destroy_process_group(timeout_s=0.5), dist.is_initialized()


def test_destroy_is_bounded_beside_a_stalled_peer_and_idempotent():
    stall_s = 3.0
    (gone, took, again, initialized), _ = run_on_ranks(_destroy_beside_a_stalled_peer, 2, args=(stall_s,),
                                                         timeout=60)
    assert not gone and took < stall_s  # gave up on the stuck collective instead of waiting for the peer
    assert again and not initialized  # a second call finds no group: nothing to do, no error


def test_destroy_without_a_group_is_a_no_op():
    assert not dist.is_initialized() and destroy_process_group() and gloo_threads() == []


# --- the end-to-end count: real torchrun, a fresh interpreter per run and rank ---------------------

PLAN = [
    {"name": "by_hand", "script": "by_hand.py", "runs": RUNS, "witness": True},
    {"name": "trainer_only", "script": "trainer_only.py", "runs": RUNS, "args": ["{out}/trainer-{run}"],
     "witness": True},
    {"name": "destroys", "script": "destroys.py", "runs": RUNS, "witness": True},
    {"name": "raises", "script": "raises.py", "runs": RUNS, "witness": True},
    # the witness's own negative control: without the guard it sees gloo's threads alive at teardown
    {"name": "witnessed_control", "script": "by_hand.py", "runs": 1, "env": {"MINIDDP_CLEAN_EXIT": "0"},
     "witness": True},
]


@pytest.fixture(scope="module")
def exits(once, tmp_path_factory):
    """{form: [(rank 0's status, rank 1's status, stderr, gloo threads alive at teardown on rank 0 and on rank 1
    (None: no witness)), ...]} over every run of the plan, run once
    per session whichever xdist worker asks first (``once``, conftest.py)."""
    return once("clean_exit_runs", lambda: _run_the_plan(tmp_path_factory.mktemp("exits")))


def _run_the_plan(out: Path) -> dict:
    plan = [{**item, "script": str(SCRIPTS / item["script"])} for item in PLAN]
    (out / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "runs.py"),
                           str(out / "plan.json"), str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {}
    for item in PLAN:
        ranks = [json.loads((out / f"{item['name']}.rank{r}.json").read_text()) for r in range(2)]
        got[item["name"]] = [(a["status"], b["status"], a["stderr"] + b["stderr"], (a.get("alive"), b.get("alive")))
                             for a, b in zip(*ranks)]
    return got


def _summary(runs) -> str:
    counts = collections.Counter((a, b) for a, b, *_ in runs)
    alive = collections.Counter(str(threads) for *_, threads in runs)
    worst = next((err for a, b, err, _ in runs if (a, b) != (0, 0)), "")
    return (f"(rank 0, rank 1) exit statuses: {dict(counts)}; gloo threads at teardown (rank 0, rank 1): "
            f"{dict(alive)}\n{worst[-2000:]}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("form", ["by_hand", "trainer_only", "destroys"])
def test_user_scripts_exit_0_every_time_under_torchrun(exits, form):
    runs = exits[form]
    assert len(runs) == RUNS and all((a, b) == (0, 0) for a, b, *_ in runs), _summary(runs)
    # every rank of every run reached teardown with no gloo thread left to abort it
    assert all(threads == ([], []) for *_, threads in runs), _summary(runs)


@pytest.mark.timeout(900)
def test_a_rank_that_raises_exits_1_and_nobody_aborts(exits):
    runs = exits["raises"]
    assert [b for _, b, *_ in runs] == [1] * len(runs), _summary(runs)  # rank 1's own exception: 1
    assert all(a in (0, 1) for a, *_ in runs), _summary(runs)  # rank 0: its failed barrier, never a signal
    # rank 1 destroyed its group in `finally`: nothing left at teardown. Rank 0's failed barrier is in the
    # traceback Python keeps to print (sys.last_traceback): its Work holds the group, whose threads stay,
    # idle (the witness sees them), and no run has aborted there: nothing is left for them to release.
    assert all(threads[1] == [] for *_, threads in runs), _summary(runs)


@pytest.mark.timeout(900)
def test_negative_control_without_the_guard_the_witness_sees_gloo_threads_at_teardown(exits):
    [(*_, threads)] = exits["witnessed_control"]
    assert all(names is not None and "pt_gloo_runloop" in names for names in threads), threads


# Not a test: "without the guard, torchrun runs abort". The abort is a race lost at interpreter teardown,
# 1 run in 10 to 4 in 10 unguarded (fewer under the suite's load). Seeing one with 99% odds takes
# log(0.01)/log(0.9) = 44 fresh two-rank torchrun runs at 1 in 10; the 4 the time allows miss it with odds
# 0.9**4 = 66% (0.6**4 = 13% at 4 in 10), so the control either skipped (it could not fail) or flaked. What
# holds the guard to its job deterministically is the mechanism the abort needs, a gloo thread alive when
# teardown begins: test_negative_control_without_the_guard_the_witness_sees_gloo_threads_at_teardown (the
# witness, under torchrun) and test_negative_control_without_the_guard_gloo_threads_live_into_teardown (in
# a fresh process) show it there without the guard; the guarded tests above show it gone.
