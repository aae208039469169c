"""TrainerState: where a run is, saved whole in each checkpoint and restored whole, with Hugging Face's names.

Oracles: a value unlike its default in every field, through a checkpoint file and back; the state a run
had when it saved a checkpoint, against the state a resume of that checkpoint restores; the field names
of ``transformers.TrainerState``. Negative controls: a field dropped from a saved state is refused by
name (in a checkpoint too), and a checkpoint whose state lost a value resumes into another run.
"""

import dataclasses
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from miniddp import Trainer, TrainerState, TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.checkpoint_format import CorruptCheckpointError
from miniddp.training.checkpoint_timeline import MANIFEST
from miniddp.training.tasks import make_task

FIELDS = [f.name for f in dataclasses.fields(TrainerState)]
# every field unlike its default: a field that does not round-trip cannot hide behind its default
FILLED = TrainerState(global_step=7, epoch=2, window=3, loss_sum=1.25, logged_step=6, logged_loss=1.0,
                      skipped_steps=1, log_history=[{"step": 6, "loss": 0.5, "lr": 1e-3}])
SHARED_WITH_HF = {"global_step", "epoch", "log_history"}  # the names this state takes from Hugging Face's
# transformers.TrainerState's fields (transformers 5), for when transformers is not installed
HF_FIELDS = {"epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
             "num_train_epochs", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
             "best_global_step", "best_model_checkpoint", "is_local_process_zero", "is_world_process_zero",
             "is_hyper_param_search", "trial_name", "trial_params", "stateful_callbacks"}


def test_every_field_round_trips_through_a_checkpoint_file(tmp_path):
    assert all(getattr(FILLED, name) != getattr(TrainerState(), name) for name in FIELDS)
    saved = FILLED.to_dict()
    assert list(saved) == FIELDS  # whole: every field, nothing else
    torch.save(saved, tmp_path / "trainer_state.pt")
    back = TrainerState.from_dict(torch.load(tmp_path / "trainer_state.pt", weights_only=True))
    assert back == FILLED
    back.log_history[0]["loss"] = 9.0
    assert FILLED.log_history[0]["loss"] == 0.5  # a copy: the restored state shares nothing with the saved one


@pytest.mark.parametrize("name", FIELDS)
def test_a_field_dropped_from_the_save_is_refused_by_name(name):
    saved = FILLED.to_dict()
    del saved[name]
    with pytest.raises(ValueError, match=rf"missing: {name}\b"):
        TrainerState.from_dict(saved)


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown: learning_rate\b"):
        TrainerState.from_dict({**FILLED.to_dict(), "learning_rate": 1e-3})


def test_the_names_it_shares_with_hugging_face_are_the_chosen_ones():
    if importlib.util.find_spec("transformers") is not None:
        from transformers.trainer_callback import TrainerState as HFTrainerState  # noqa: PLC0415

        hf = {f.name for f in dataclasses.fields(HFTrainerState)}
    else:
        hf = HF_FIELDS
    # each shared name is one chosen for its meaning; no other field of ours takes a name of theirs
    assert set(FIELDS) & hf == SHARED_WITH_HF


# --- through a Trainer: saved by a run, restored by a resume ------------------------------------------

# 64 samples in batches of 8 on one rank: 8 steps an epoch. Checkpoint 10 is in the second epoch (window 2),
# two steps after a log (logged_step 8): no field of its state is at its default.
CONFIG = dict(dataset_size=64, eval_size=0, per_device_train_batch_size=8, max_steps=12, logging_steps=4,
              save_steps=10, dropout=0.1, disable_tqdm=True)


class _Recording(Trainer):
    """Records its state and pending loss at each save."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.at_save = {}

    def _after_step(self, progress):
        super()._after_step(progress)
        if self.state.global_step % self.args.save_steps == 0:
            self.at_save[self.state.global_step] = (TrainerState.from_dict(self.state.to_dict()),
                                                    self.pending_loss.clone())


def _result(trainer, metrics):
    return {"params": {k: v.clone() for k, v in trainer.model.state_dict().items()}, "state": trainer.state,
            **{k: metrics[k] for k in ("train_loss", "log_history", "global_step")}}


def _rewrite_state(checkpoint: Path, change) -> None:
    """``change(trainer_state)`` in place, the manifest regenerated to match: a checkpoint that verifies."""
    path = checkpoint / "trainer_state.pt"
    saved = torch.load(path, weights_only=True)
    change(saved)
    torch.save(saved, path)
    data = path.read_bytes()
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _resume_copy(out: Path, name: str, change):
    """Resume a copy of checkpoint-10, its state changed by ``change``: the result, or the error raised."""
    copy = out.parent / name / "checkpoint-10"
    shutil.copytree(out / "checkpoint-10", copy)
    _rewrite_state(copy, change)
    cfg = TrainingConfig(**CONFIG, output_dir=str(copy.parent), resume_from_checkpoint=str(copy))
    trainer = Trainer(args=cfg, **make_task(cfg))
    try:
        return _result(trainer, trainer.train())
    except CorruptCheckpointError as err:
        return str(err)


def _save_and_resume(rank, world_size, out):
    cfg = TrainingConfig(**CONFIG, output_dir=str(out))
    straight = _Recording(args=cfg, **make_task(cfg))
    uninterrupted = _result(straight, straight.train())
    saved_state, saved_pending = straight.at_save[10]

    restorer = Trainer(args=cfg, **make_task(cfg))
    restored = restorer.checkpointer.resume(str(out / "checkpoint-10"), restorer.pending_loss)
    resumed = Trainer(args=cfg, **make_task(cfg))
    again = _result(resumed, resumed.train(resume_from_checkpoint=str(out / "checkpoint-10")))
    return {"uninterrupted": uninterrupted, "saved": saved_state, "restored": restored,
            "pending": (saved_pending, restorer.pending_loss), "again": again,
            "dropped": _resume_copy(out, "dropped", lambda s: s.pop("loss_sum")),
            "defaulted": _resume_copy(out, "defaulted", lambda s: s.update(loss_sum=0.0))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    [result] = run_on_ranks(_save_and_resume, 1, args=(tmp_path_factory.mktemp("state") / "out",), init=False,
                            timeout=180)
    return result


def test_a_resume_restores_the_saved_state_whole(runs):
    saved, restored = runs["saved"], runs["restored"]
    defaults = TrainerState()
    assert all(getattr(saved, name) != getattr(defaults, name) for name in FIELDS if name != "skipped_steps")
    assert restored == saved  # every field
    saved_pending, restored_pending = runs["pending"]
    assert saved_pending != 0 and torch.equal(restored_pending, saved_pending)  # this rank's, not yet in the state
    assert runs["again"]["state"] == runs["uninterrupted"]["state"]


def test_the_resumed_run_is_the_uninterrupted_run(runs):
    straight, again = runs["uninterrupted"], runs["again"]
    for key in straight["params"]:
        assert torch.equal(straight["params"][key], again["params"][key]), key
    for key in ("train_loss", "log_history", "global_step"):
        assert straight[key] == again[key], key


def test_a_checkpoint_whose_state_lacks_a_field_is_refused_naming_it(runs):
    said = runs["dropped"]
    assert isinstance(said, str) and "missing: loss_sum" in said and "checkpoint-10" in said, said


def test_negative_control_a_state_value_lost_at_the_save_makes_the_resumed_run_differ(runs):
    straight, lost = runs["uninterrupted"], runs["defaulted"]
    assert all(torch.equal(straight["params"][k], lost["params"][k]) for k in straight["params"])  # same weights
    assert lost["train_loss"] != straight["train_loss"]  # the oracle sees the lost loss_sum
