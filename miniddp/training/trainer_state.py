"""Where a run is: one dataclass, saved whole in every checkpoint and restored whole on resume.

What
    ``TrainerState`` holds what training changes and a resume must put back: the optimizer steps
    done (``global_step``), the epoch and the accumulation window the loop is at, the loss of every
    step so far (averaged over ranks, summed) and that sum at the last log, the fp16 steps the
    grad scaler skipped, and ``log_history``. ``Trainer.state`` is one. ``to_dict`` is what a
    checkpoint's ``trainer_state.pt`` holds (plain Python values, so ``torch.load(weights_only=True)``
    reads it); ``from_dict`` builds the state back and refuses a dict that lacks a field, or has
    one it does not know, naming it.

Why
    The loop's position used to be a dict with string keys. A dict takes any key: a value added to
    the loop but not to the save disappears at a resume, without an error, and the resumed run
    quietly differs from the one it continues. A dataclass names each field once, with its type
    and meaning; saved and restored whole (never field by field), a new field is checkpointed the
    moment it exists, and a checkpoint without it is refused by name.

How Hugging Face differs
    ``transformers.TrainerState`` (``transformers/trainer_callback.py``) is a dataclass too, written
    whole as ``trainer_state.json`` and read back with ``load_from_json``; ``global_step``, ``epoch``
    and ``log_history`` are its names, with its meanings, except that its ``epoch`` is a float
    whose fraction is the share of the current epoch done: here the fraction is ``window``, counted
    in accumulation windows, so the position is exact. Its running loss sums
    (``_total_loss_scalar``, ``_globalstep_last_logged``) are attributes of the ``Trainer``, not of
    the state, and start again at each ``train()``: after a resume its ``train_loss`` averages only
    the steps trained since. It also copies the run's plan (``max_steps``, ``logging_steps``,
    ``save_steps``, ...) and the best-model tracking (``best_metric``, ``best_model_checkpoint``) into
    the state. Here the plan stays in ``TrainingConfig``, where a resume with allowed changes takes
    the new one, and there is no best-model tracking, so neither is state.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields


# --8<-- [start:state]
@dataclass
class TrainerState:
    """Where a run is; every field a resume restores. Hugging Face's names where it has the concept."""

    global_step: int = 0  # optimizer steps done (Hugging Face's name and meaning)
    epoch: int = 0  # epochs done: Hugging Face's epoch is a float whose integer part this is
    window: int = 0  # accumulation windows done in this epoch: where its batches resume
    loss_sum: float = 0.0  # the loss of every step so far, each averaged over ranks
    logged_step: int = 0  # global_step at the last log
    logged_loss: float = 0.0  # loss_sum at the last log: a log reports the mean of what came since
    skipped_steps: int = 0  # fp16: optimizer steps the GradScaler skipped (a non-finite gradient)
    log_history: list[dict] = field(default_factory=list)  # one entry per log: step, loss, lr

    def to_dict(self) -> dict:
        """Every field, copied (``log_history``'s entries too): what a checkpoint saves."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> TrainerState:
        """The state ``to_dict`` saved; a ``ValueError`` naming what is missing or unknown."""
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in saved]
        unknown = sorted(set(saved) - set(names))
        if missing or unknown:
            raise ValueError("the saved trainer state does not match TrainerState's fields ("
                             + "; ".join(([f"missing: {', '.join(missing)}"] if missing else [])
                                         + ([f"unknown: {', '.join(unknown)}"] if unknown else [])) + ")")
        return cls(**copy.deepcopy(saved))
# --8<-- [end:state]
