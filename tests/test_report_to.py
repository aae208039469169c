"""report_to: TensorBoard event files from rank 0 at each logging step, or a clear error without the package
or a directory for them."""

import contextlib
import importlib.util
import io
import os

import pytest

from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.output_dir import LOCK, OutputDirError, claim_output_dir
from miniddp.training.report_to import Reporter
from miniddp.training.tasks import make_task


def _train(rank, world_size, out):
    config = TrainingConfig(output_dir=out, max_steps=6, logging_steps=2, report_to="tensorboard", dataset_size=256,
                            eval_size=64, disable_tqdm=True)
    metrics = Trainer(args=config, **make_task(config)).train()
    return metrics if rank == 0 else None


def test_tensorboard_gets_rank_0s_logged_numbers_at_each_logging_step(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install -e '.[dev]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    metrics = run_on_ranks(_train, 2, args=(str(tmp_path),), init=False, timeout=120)[0]
    files = list((tmp_path / "runs").glob("*/events.out.tfevents.*"))
    assert len(files) == 1  # rank 0's only: the numbers are already averaged over ranks
    events = EventAccumulator(str(files[0].parent))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([h["loss"] for h in metrics["log_history"]], rel=1e-6)
    assert [e.step for e in events.Scalars("train/learning_rate")] == [2, 4, 6]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(metrics["eval_loss"], rel=1e-6)
    assert events.Scalars("eval/accuracy")[-1].step == 6


def test_report_to_none_and_other_ranks_write_nothing(tmp_path):
    assert TrainingConfig(output_dir=str(tmp_path)).report_to == "none"  # Transformers 5's default too
    for reporter in (Reporter("none", str(tmp_path), rank=0), Reporter("tensorboard", str(tmp_path), rank=1)):
        reporter.log({"step": 1, "loss": 0.5}, 1)
        reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_package_or_an_unknown_name_is_refused_before_any_rank_starts(monkeypatch):
    with pytest.raises(ValueError, match="report_to"):
        TrainingConfig(report_to="wandb")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match="pip install tensorboard"):
        TrainingConfig(report_to="tensorboard")


def _claim(out, logging_dir):
    return claim_output_dir(out, resuming=False, overwrite=False, need_bytes=0, logging_dir=logging_dir)


def test_a_log_dir_that_cannot_be_made_is_refused_with_output_dir_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "out"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "afile" / "logs"))
    reporter = Reporter("tensorboard", str(out), rank=0)
    assert reporter.logging_dir == str(tmp_path / "afile" / "logs")
    with pytest.raises(OutputDirError, match="report_to") as info:
        _claim(out, reporter.logging_dir)
    assert f"{tmp_path / 'afile'} is a file" in str(info.value)
    assert not out.exists()  # the claim made it, and took it back
    if os.path.isdir("/proc"):  # a filesystem where nobody, root included, makes a directory
        with pytest.raises(OutputDirError, match="report_to"):
            _claim(out, "/proc/miniddp-runs")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    writable = Reporter("tensorboard", str(out), rank=0).logging_dir
    assert os.path.dirname(writable) == str(out / "runs")
    lock = _claim(out, writable)
    assert [p.name for p in out.iterdir()] == [LOCK]  # checked by making it, then removed: the writer makes it
    lock.release()
    assert Reporter("tensorboard", str(out), rank=1).logging_dir is None  # only rank 0 writes


def _cli_into(rank, world_size, out):
    """miniddp-train's exit status, what it printed, and how many steps it took."""
    from miniddp.training import cli  # noqa: PLC0415
    from miniddp.training.trainer import Trainer as Trained  # noqa: PLC0415

    cli.RANK_0_FIRST_S = 0  # stderr is captured per rank: rank 1 need not wait for rank 0 to speak
    steps, window_step = [], Trained._window_step
    Trained._window_step = lambda self, micro_batches: steps.append(1) or window_step(self, micro_batches)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            cli.main(["--output_dir", out, "--report_to", "tensorboard", "--logging_steps", "1", "--max_steps", "2",
                      "--dataset_size", "64", "--eval_size", "0", "--disable_tqdm", "true"])
        except SystemExit as exit_:
            return exit_.code, said.getvalue(), len(steps)
    return 0, said.getvalue(), len(steps)


def test_an_unusable_log_dir_stops_every_rank_before_the_first_step_in_one_line(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install -e '.[dev]'")
    (tmp_path / "runs").write_text("")  # output_dir/runs/<date>_<host> cannot be made
    results = run_on_ranks(_cli_into, 2, args=(str(tmp_path),), init=False, timeout=120)
    assert [code for code, _, _ in results] == [3, 3]  # the job could not start, as for output_dir
    assert [steps for _, _, steps in results] == [0, 0]
    said = results[0][1].strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said
    assert "--report_to" in said and f"{tmp_path / 'runs'} is a file" in said
    assert results[1][1] == ""  # rank 0 speaks for the job
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "runs"]
