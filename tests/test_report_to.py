"""report_to: TensorBoard event files from rank 0 at each logging step, or a clear error without the package."""

import importlib.util

import pytest

from miniddp import Trainer, TrainingConfig
from miniddp.testing import run_on_ranks
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
