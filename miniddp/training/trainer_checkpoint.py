"""What a Trainer puts in a checkpoint, and how it resumes from one.

What
    ``TrainerCheckpointing`` is the part of ``Trainer`` that saves and resumes. ``save(step)``
    hands ``checkpoint.save_checkpoint`` the model, optimizer, scheduler (and grad scaler) state,
    the trainer's position (step, epoch, window, loss sums, log history), the setup that defines
    the run, DDP's bucket layout, and per rank the loss not yet reported and the comm hook's
    state (PowerSGD's memories). ``_resume(where)`` loads a checkpoint, or the newest one for
    ``latest``, checks the setup (``resume.compare_setups``), sets aside a later timeline
    (``timeline.set_aside_later_results``) and restores every piece in its place.

Why
    A resumed run must *be* the interrupted run: the same parameters bit for bit, the same
    ``train_loss`` and ``log_history``. That needs every piece of state, and each in the right
    place: a rank's pending loss in its own file (a save then changes no sum), the bucket layout
    (gloo's ring adds elements in an order set by their offset in the bucket).

How Hugging Face differs
    ``Trainer._save_checkpoint`` saves the model, ``optimizer.pt``, ``scheduler.pt``,
    ``trainer_state.json`` (its ``TrainerState``: step, epoch, log history) and
    ``rng_state_<rank>.pth``; ``_load_from_checkpoint`` and ``_load_rng_state`` restore them.
    It saves no setup to compare, no bucket layout, and no comm hook state.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .checkpoint import load_checkpoint_on_every_rank, load_states, save_checkpoint
from .checkpoint_dirs import checkpoints, set_aside_later_results
from .every_rank import on_every_rank
from .resume import apply_new_schedule, check_position, compare_setups, position_in_new_units, set_rng_state


class TrainerCheckpointing:
    """Saving and resuming, for ``Trainer``. Uses its ``args``, ``rank``, ``model``, ``ddp``, ``optimizer``,
    ``scheduler``, ``scaler``, ``comm_hook``, ``state``, ``pending_loss``, ``log_history``, ``setup``,
    ``windows``, ``max_steps``."""

    def save(self, step: int) -> Path:
        """Every rank calls this: ``output_dir/checkpoint-<step>/``, complete once it returns."""
        trainer_state = {**self.state, "log_history": list(self.log_history), "setup": self.setup,
                         "layout": self.ddp.layout_state()}  # the bucket layout: sums in the same order
        states = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "trainer_state": trainer_state}
        if self.scaler:
            states["scaler"] = self.scaler.state_dict()
        # each rank's unreported loss travels in its own file: no all-reduce here, so a save does not
        # change how the losses are summed, and train_loss is the same with or without interruptions
        return save_checkpoint(self.args.output_dir, step, states, self.rank, self.args.save_total_limit,
                               rank_state={"pending_loss": self.pending_loss.cpu(), "comm_hook": self._hook_state()})

    def _hook_state(self):
        """PowerSGD's memories differ per rank: they go to ``rank_<r>.pt``. Other hooks keep nothing."""
        state = self.comm_hook[0] if self.comm_hook else None
        return state.state_dict() if hasattr(state, "state_dict") else None

    def _resume(self, where) -> None:
        path = where
        if where == "latest":
            found = checkpoints(self.args.output_dir)
            if not found:
                if self.rank == 0:
                    print(f"resume_from_checkpoint='latest': {self.args.output_dir} has no complete checkpoint; "
                          "starting from scratch", file=sys.stderr, flush=True)
                return
            path = found[-1]
        state = load_checkpoint_on_every_rank(path, self.rank, latest=where == "latest")
        trainer_state = dict(state["trainer_state"])
        saved_setup = trainer_state.pop("setup")
        notice = compare_setups(saved_setup, self.setup, self.args.resume_allow_changes, path)  # or raise
        check_position(trainer_state["global_step"], self.max_steps, path)
        load_states(path, (self.model, state["model"]), (self.optimizer, state["optimizer"]),
                    (self.scheduler, state["scheduler"]))
        aside = on_every_rank((lambda: set_aside_later_results(self.args.output_dir, path)) if self.rank == 0
                              else None, "setting aside the results after the resumed checkpoint")
        if aside is not None:  # resumed an earlier checkpoint: what came after it is another timeline
            print(f"miniddp: resuming {path}: the checkpoints and results saved after it are another timeline; "
                  f"moved to {aside} (nothing was deleted)", file=sys.stderr, flush=True)
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.log_history = trainer_state.pop("log_history")
        self.ddp.load_layout_state(trainer_state.pop("layout"))
        self.state.update(trainer_state)
        if "rank_state" in state:  # absent for a rank beyond the saved world size (resume_allow_changes)
            set_rng_state(state["rank_state"]["rng"])
            self.pending_loss.copy_(state["rank_state"]["pending_loss"])
            hook_state = state["rank_state"].get("comm_hook")
            target = self.comm_hook[0] if self.comm_hook else None  # the hook's state, if it has one to load
            if hook_state is not None and hasattr(target, "load_state_dict"):
                target.load_state_dict(hook_state)
        if notice:
            if self.rank == 0:
                print(f"miniddp: {notice}", file=sys.stderr, flush=True)
            apply_new_schedule(self.optimizer, self.scheduler, self.args.learning_rate, self.args.weight_decay)
            self.state["window"] = position_in_new_units(saved_setup, self.setup, self.state["window"])
            if self.state["window"] >= len(self.windows):
                self.state.update(epoch=self.state["epoch"] + 1, window=0)
