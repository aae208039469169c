"""output_dir belongs to one run; nothing on disk is lost; divergence stops the run.

Each test reproduces a failure found by running the CLI as a new user would:
two runs into one directory, another run's results reused, an unusable directory found
only after training, a full disk destroying the previous final model, NaN reported as
success with invalid JSON, debris of interrupted saves never cleaned.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.checkpoint_format import load_checkpoint
from miniddp.training.checkpoint_timeline import checkpoints
from miniddp.training.nonfinite import NonFiniteLossError
from miniddp.training.output_dir import LOCK, OutputDirError, OutputDirLock, atomic_save, bytes_to_save
from miniddp.training.tasks import make_task

SMALL = dict(max_steps=4, dataset_size=128, eval_size=0, per_device_train_batch_size=8, disable_tqdm=True)


def _train(rank, world_size, out, overrides):
    """Train the built-in task; the error's type and text if it refused or stopped."""
    cfg = TrainingConfig(**{**SMALL, **overrides}, output_dir=out)
    try:
        return Trainer(args=cfg, **make_task(cfg)).train()
    except (OutputDirError, NonFiniteLossError) as err:
        return f"{type(err).__name__}: {err}"


def _run(out, world_size=1, **overrides):
    return run_on_ranks(_train, world_size, args=(str(out), overrides), init=False, timeout=90)


def _cli(out, *flags):
    return subprocess.Popen([sys.executable, "-m", "miniddp.train", "--output_dir", str(out), "--eval_size", "0",
                             "--disable_tqdm", "true", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


# --8<-- [start:two_runs]
def test_a_second_run_into_a_running_run_s_directory_fails_at_once_naming_the_holder(tmp_path):
    first = _cli(tmp_path, "--max_steps", "4000", "--dataset_size", "4096", "--save_steps", "500")
    try:
        while not (tmp_path / LOCK).exists() or not (tmp_path / LOCK).read_text():
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        second = _cli(tmp_path, "--max_steps", "4", "--dataset_size", "64")
        _, said = second.communicate(timeout=60)
        assert second.returncode == 3, said
        assert f"in use by another run (pid {first.pid} on " in said and len(said.splitlines()) == 1
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.kill()
        first.communicate()
# --8<-- [end:two_runs]


def test_the_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from miniddp.training.output_dir import "
                               "OutputDirLock; OutputDirLock(sys.argv[1]); print('locked', flush=True); "
                               "time.sleep(600)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(OutputDirError, match=f"in use by another run \\(pid {holder.pid} "):
        OutputDirLock(tmp_path)  # alive: refused
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = OutputDirLock(tmp_path)  # the kernel dropped the dead process's lock
    assert f"pid {holder.pid} on " in lock.previous  # named in the takeover message
    lock.release()
    assert OutputDirLock(tmp_path).previous == ""  # a clean release leaves nobody to take over from


def test_another_run_s_results_are_refused_unless_resumed_or_overwritten(tmp_path):
    _run(tmp_path, max_steps=6, save_steps=2)  # a finished run: checkpoint-2, -4, -6, final model, metrics
    said = _run(tmp_path, max_steps=4, save_steps=2)[0]
    assert said.startswith("OutputDirError") and "holds another run's results (final_model.pt, metrics.json, "
    assert "--overwrite_output_dir" in said and "--resume_from_checkpoint latest" in said
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # untouched
    # overwriting deletes the old run's checkpoints: rotation can no longer keep the wrong run's
    metrics = _run(tmp_path, max_steps=4, save_steps=2, save_total_limit=1, overwrite_output_dir=True)[0]
    assert metrics["global_step"] == 4 and [p.name for p in checkpoints(tmp_path)] == ["checkpoint-4"]
    assert _run(tmp_path, max_steps=4, resume_from_checkpoint="latest")[0]["global_step"] == 4


def test_an_unusable_output_dir_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    said = _run(tmp_path / "file", max_steps=2000)[0]
    assert said.startswith("OutputDirError") and "file cannot be created" in said


def test_debris_of_interrupted_saves_is_removed_at_the_next_start(tmp_path):
    (tmp_path / ".checkpoint-7.tmp").mkdir()
    (tmp_path / ".checkpoint-7.tmp" / "model.pt").write_bytes(b"half")
    (tmp_path / ".final_model.pt.tmp-4242").write_bytes(b"half")
    _run(tmp_path, max_steps=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "final_model.pt", "metrics.json"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a disk that fills up (needs root and mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave: int) -> None:
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave))


# --8<-- [start:full_disk]
def test_a_full_disk_never_destroys_a_previous_file(small_disk):
    path = small_disk / "final_model.pt"
    atomic_save({"w": torch.ones(1000)}, path)
    _fill(small_disk, leave=1000)
    with pytest.raises(OutputDirError, match=f"could not write {path}: No space left on device"):
        atomic_save({"w": torch.zeros(100_000)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(1000))  # the old version, whole
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "final_model.pt"]  # no temp file left


def test_a_read_only_output_dir_is_refused_before_the_first_step(small_disk):
    (small_disk / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    said = _run(small_disk / "out", max_steps=2000)[0]
    assert said.startswith("OutputDirError") and "out is not writable: Read-only file system" in said


def test_a_disk_too_full_to_save_is_refused_before_training(small_disk):
    _fill(small_disk, leave=64 << 10)
    said = _run(small_disk / "out", max_steps=2000, save_steps=100)[0]
    assert said.startswith("OutputDirError") and "MiB free; a checkpoint and the final model need" in said


def test_a_disk_that_fills_up_mid_run_stops_every_rank_and_keeps_the_last_checkpoint(small_disk):
    out = small_disk / "out"
    _run(out, max_steps=1, save_steps=1)  # how much one checkpoint takes
    one = sum(f.stat().st_size for f in (out / "checkpoint-1").iterdir())
    shutil.rmtree(out)
    need = bytes_to_save(make_task(TrainingConfig())["model"], optimizer_copies=2, checkpoints=True)
    _fill(small_disk, leave=need + one // 2)  # the start-up check passes; the disk fills after a few saves
    said = _run(out, world_size=2, max_steps=40, save_steps=1)
    assert said[0] == said[1].replace("rank 0: ", "") or said[1] == said[0].replace("rank 0: ", ""), said
    assert "No space left on device" in said[0] and str(out) in said[0] and len(said[0].splitlines()) == 1
    kept = checkpoints(out)
    assert kept and load_checkpoint(kept[-1], rank=0)  # verified against its manifest: whole
    assert not list(out.glob(".checkpoint-*.tmp"))  # the next start would remove it anyway; none left here
# --8<-- [end:full_disk]


# --8<-- [start:nan]
def test_divergence_stops_every_rank_before_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    said = _run(tmp_path, world_size=2, max_steps=50, save_steps=1, learning_rate=1e20)
    assert all(s.startswith("NonFiniteLossError: training diverged at step ") for s in said), said
    step = int(said[0].split("at step ")[1].split(":")[0])
    assert f"Last checkpoint: {tmp_path / f'checkpoint-{step - 1}'}" in said[0]
    assert not (tmp_path / "final_model.pt").exists() and not (tmp_path / "metrics.json").exists()
    last = load_checkpoint(tmp_path / f"checkpoint-{step - 1}", rank=0)["model"]
    assert all(torch.isfinite(t).all() for t in last.values())  # the last good weights


class _OneBadSample(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (torch.full_like(x, float("nan")) if i == 5 else x), y


def _nan_on_one_rank(rank, world_size, out):
    torch.manual_seed(0)
    data = _OneBadSample(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = nn.Sequential(nn.Linear(4, 2))
    cfg = TrainingConfig(output_dir=out, max_steps=8, per_device_train_batch_size=4, disable_tqdm=True)
    try:
        Trainer(model=model, args=cfg, train_dataset=data,
                compute_loss_func=lambda logits, labels, num_items_in_batch: nn.functional.cross_entropy(logits, labels)
                ).train()
    except NonFiniteLossError as err:
        return str(err)


def test_a_nan_on_one_rank_stops_every_rank_naming_it(tmp_path):
    said = run_on_ranks(_nan_on_one_rank, 2, args=(str(tmp_path),), init=False, timeout=60)
    assert said[0] == said[1] and "loss nan on rank(s) [" in said[0]
# --8<-- [end:nan]


def _strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in metrics.json"))


def _nan_metric(rank, world_size, out):
    cfg = TrainingConfig(**{**SMALL, "eval_size": 32}, output_dir=out)
    task = make_task(cfg)
    task["compute_metrics"] = lambda prediction: {"nan_metric": float("nan")}
    Trainer(args=cfg, **task).train()


def test_metrics_json_is_strict_json(tmp_path):
    run_on_ranks(_nan_metric, 1, args=(str(tmp_path),), init=False, timeout=60)
    assert _strict((tmp_path / "metrics.json").read_text())["eval_nan_metric"] is None


def _fp16_overflow(rank, world_size, out):
    cfg = TrainingConfig(**SMALL, output_dir=out, mixed_precision="fp16")
    task = make_task(cfg)
    task["compute_loss_func"] = lambda out, labels, num_items_in_batch: 1e6 * nn.functional.cross_entropy(
        out["logits"], labels)
    return Trainer(args=cfg, **task).train()


def test_fp16_steps_the_grad_scaler_skips_are_counted_not_errors(tmp_path):
    metrics = run_on_ranks(_fp16_overflow, 1, args=(str(tmp_path),), init=False, timeout=60)[0]
    assert metrics["global_step"] == SMALL["max_steps"] and metrics["fp16_skipped_steps"] >= 1
