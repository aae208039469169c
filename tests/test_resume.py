"""Resume is exact, a changed setup is refused or explained, and torchrun restarts come back.

Oracle: the same run without interruptions. Kill points are drawn by hypothesis (mid-epoch, at
an epoch's end, several in one run), with dropout, bf16 autocast, gradient accumulation and a
short last window; the resumed run must end with the same parameters bit for bit, the same
``train_loss`` and the same ``log_history``.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.checkpoint_timeline import checkpoints
from miniddp.training.resume import SetupChangedError
from miniddp.training.tasks import make_task

# 2 ranks x 8 per device over 200 samples: 13 batches per rank, windows of 3 -> [3, 3, 3, 3, 1]
# (a short last window), 5 optimizer steps per epoch; 12 steps cross two epoch boundaries.
CONFIGS = {
    "dropout-bf16-accumulation": dict(model="mlp", dropout=0.1, mixed_precision="bf16", gradient_accumulation_steps=3),
    "batchnorm-dropout-fp32": dict(model="bn", dropout=0.2, gradient_accumulation_steps=2),
}
COMMON = dict(dataset_size=200, eval_size=64, per_device_train_batch_size=8, max_steps=12, logging_steps=5,
              learning_rate=0.01, disable_tqdm=True)


class _Killed(Exception):
    """Stands for kill -9 right after a step: everything after it is lost."""


class _Interrupted(Trainer):
    def __init__(self, *, kill_after, **kwargs):
        super().__init__(**kwargs)
        self.kill_after = kill_after  # the step after which this process "dies"

    def _after_step(self, progress):
        super()._after_step(progress)
        if self.state.global_step == self.kill_after:
            raise _Killed


def _result(trainer, metrics):
    return {"params": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            **{k: metrics[k] for k in ("train_loss", "log_history", "eval_loss", "eval_accuracy", "global_step")}}


def _uninterrupted(rank, world_size, overrides, out):
    cfg = TrainingConfig(**COMMON, **overrides, output_dir=out)
    trainer = Trainer(args=cfg, **make_task(cfg))
    return _result(trainer, trainer.train())


def _with_kills(rank, world_size, overrides, out, kills):
    """Save every step; 'die' after each step in ``kills``; each restart resumes from the newest checkpoint."""
    cfg = TrainingConfig(**COMMON, **overrides, output_dir=out, save_steps=1, save_total_limit=2,
                         resume_from_checkpoint="latest")
    for kill_after in [*kills, None]:
        trainer = _Interrupted(args=cfg, kill_after=kill_after, **make_task(cfg))  # a fresh process's model
        if checkpoints(out):
            torch.manual_seed(1234)  # a restarted process's RNG could be anything: resume must restore it
        try:
            metrics = trainer.train()
        except _Killed:
            continue
    return _result(trainer, metrics)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for name, overrides in CONFIGS.items():
        out = str(tmp_path_factory.mktemp(name))
        runs[name] = run_on_ranks(_uninterrupted, 2, args=(overrides, out), init=False, timeout=120)
    return runs


# --8<-- [start:property]
@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kills=st.lists(st.integers(1, COMMON["max_steps"] - 1), min_size=1, max_size=3, unique=True).map(sorted))
def test_kill_and_resume_anywhere_equals_the_uninterrupted_run(name, kills, uninterrupted, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("killed"))
    resumed = run_on_ranks(_with_kills, 2, args=(CONFIGS[name], out, kills), init=False, timeout=120)
    for rank in (0, 1):
        straight, again = uninterrupted[name][rank], resumed[rank]
        for key in straight["params"]:
            assert torch.equal(straight["params"][key], again["params"][key]), (kills, rank, key)
        for key in ("train_loss", "log_history", "eval_loss", "eval_accuracy", "global_step"):
            assert straight[key] == again[key], (kills, rank, key)
# --8<-- [end:property]


def _resume_under(rank, world_size, out, overrides):
    cfg = TrainingConfig(**{**COMMON, "max_steps": 4, "eval_size": 0, **overrides}, output_dir=out,
                         resume_from_checkpoint="latest")
    try:
        return Trainer(args=cfg, **make_task(cfg)).train()["global_step"]
    except SetupChangedError as err:
        return str(err)


def test_a_changed_setup_is_refused_naming_every_change_unless_allowed(tmp_path):
    out = str(tmp_path)
    run_on_ranks(_resume_under, 2, args=(out, {"max_steps": 2, "save_steps": 2}), init=False, timeout=60)
    # the same command, with the number of processes and the batch changed: refused, both named
    said = run_on_ranks(_resume_under, 1, args=(out, {"max_steps": 2, "per_device_train_batch_size": 16}),
                        init=False, timeout=60)[0]
    assert "world_size: 2 -> 1" in said and "per_device_train_batch_size: 8 -> 16" in said
    assert "resume_allow_changes" in said
    # a longer schedule changes the learning rate of every later step: also a change to agree to
    said = run_on_ranks(_resume_under, 2, args=(out, {}), init=False, timeout=60)[0]
    assert said.count(" -> ") == 1 and "max_steps: 2 -> 4" in said
    assert run_on_ranks(_resume_under, 1, args=(out, {"resume_allow_changes": True}), init=False,
                        timeout=60) == [4]
    # another model cannot be loaded at all, allowed or not
    said = run_on_ranks(_resume_under, 1, args=(out, {"model": "bn", "resume_allow_changes": True}), init=False,
                        timeout=60)[0]
    assert "different model" in said


# --8<-- [start:elastic]
def _torchrun(out, extra=()):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=1", "-m", "miniddp.train", "--output_dir", str(out), "--max_steps", "300",
               "--dataset_size", "4096", "--eval_size", "0", "--save_steps", "40", "--dropout", "0.1",
               "--logging_steps", "50", "--disable_tqdm", "true", "--resume_from_checkpoint", "latest", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with ``RANK=rank`` (a child of the launcher)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def test_torchrun_max_restarts_survives_a_killed_worker_and_ends_bitwise_equal(tmp_path):
    straight, killed = _torchrun(tmp_path / "straight"), _torchrun(tmp_path / "killed")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "killed" / "checkpoint-40" / "manifest.json").exists():
            assert time.monotonic() < deadline and killed.poll() is None, "no checkpoint-40"
            time.sleep(0.02)
        victim = _rank_pid(killed.pid, 1)
        os.kill(victim, signal.SIGKILL)  # mid-run: checkpoint-40 exists, step 300 is far
        killed_log, _ = killed.communicate(timeout=180)
        straight_log, _ = straight.communicate(timeout=180)
    finally:
        for job in (straight, killed):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
    assert killed.returncode == 0 and straight.returncode == 0, killed_log[-3000:] + straight_log[-3000:]
    assert "exitcode: -9" in killed_log, killed_log[-3000:]  # torchrun saw the death...
    assert [p.name for p in checkpoints(tmp_path / "killed")][-1] == "checkpoint-280"  # ...and the job came back
    a = torch.load(tmp_path / "straight" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
# --8<-- [end:elastic]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_killing_the_launcher_stops_its_workers(tmp_path):
    job = _torchrun(tmp_path, ["--max_steps", "100000"])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".miniddp.lock").exists() or not (tmp_path / ".miniddp.lock").read_text():
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.05)
        workers = [_rank_pid(job.pid, rank) for rank in (0, 1)]
        job.send_signal(signal.SIGKILL)  # the launcher only: its workers are in its process group, not killed
        job.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "orphaned workers still training"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


def test_three_ranks_resume_bitwise_with_the_rebuilt_bucket_order(tmp_path):
    """With more than 2 ranks gloo's ring sums an element in an order set by its offset in the bucket:
    the resumed run must all-reduce with the rebuilt bucket layout the interrupted one had."""
    overrides = dict(model="mlp", ddp_bucket_cap_mb=0.01)  # several buckets
    straight = run_on_ranks(_uninterrupted, 3, args=(overrides, str(tmp_path / "a")), init=False, timeout=120)
    for kills in ([1], [3]):  # right after the first backward (rebuild due), and after the rebuild
        out = str(tmp_path / f"k{kills[0]}")
        again = run_on_ranks(_with_kills, 3, args=(overrides, out, kills), init=False, timeout=120)
        for key in straight[0]["params"]:
            assert torch.equal(straight[0]["params"][key], again[0]["params"][key]), (kills, key)


def _hook_run(rank, world_size, overrides, out, kills):
    result = _with_kills(rank, world_size, overrides, out, kills) if kills else _uninterrupted(
        rank, world_size, overrides, out)
    return result


def test_powersgd_memories_survive_a_resume(tmp_path):
    # PowerSGD's error feedback and warm-start Qs differ per rank and change every step: they travel in
    # rank_<r>.pt, so a run killed after compressed steps resumes bitwise (without them it drifts)
    hook = dict(model="mlp", ddp_comm_hook="power_sgd", ddp_comm_powersgd_rank=2, ddp_comm_powersgd_start_iter=3)
    straight = run_on_ranks(_hook_run, 2, args=(hook, str(tmp_path / "a"), []), init=False, timeout=120)
    again = run_on_ranks(_hook_run, 2, args=(hook, str(tmp_path / "b"), [6]), init=False, timeout=120)
    plain = run_on_ranks(_hook_run, 2, args=({"model": "mlp"}, str(tmp_path / "c"), []), init=False, timeout=120)
    for key in straight[0]["params"]:
        assert torch.equal(straight[0]["params"][key], again[0]["params"][key]), key
        assert torch.equal(straight[0]["params"][key], straight[1]["params"][key]), key  # ranks agree
    assert straight[0]["train_loss"] == again[0]["train_loss"]
    assert any(not torch.equal(straight[0]["params"][k], plain[0]["params"][k]) for k in plain[0]["params"])
