"""What a Trainer puts in a checkpoint, and how it resumes from one.

What
    ``Checkpointer`` saves and resumes for a ``Trainer``, which builds it with every object it saves
    or loads: the model, DDP (its bucket layout), the optimizer, the scheduler, the grad scaler, the
    comm hook, and the setup that defines the run. ``save(state, pending_loss)`` hands
    ``checkpoint_format.save_checkpoint`` their states, the whole ``TrainerState`` with the setup and the
    bucket layout in ``trainer_state.pt``, and per rank the loss not yet reported and the comm hook's
    state (PowerSGD's memories). ``resume(where, pending_loss)`` loads a checkpoint, or the newest one
    for ``latest``, checks the setup (``resume.compare_setups``), sets aside a later timeline
    (``checkpoint_timeline.set_aside_later_results``), restores every piece in its place and returns the
    saved ``TrainerState``, whole.

Why
    A resumed run must *be* the interrupted run: the same parameters bit for bit, the same
    ``train_loss`` and ``log_history``. That needs every piece of state, and each in the right
    place: a rank's pending loss in its own file (a save then changes no sum), the bucket layout
    (gloo's ring adds elements in an order set by their offset in the bucket). Under ZeRO the optimizer's
    state is sharded; ``optimizer.pt`` holds it whole (``ZeroOptimizer.state_dict``, called by every rank),
    and loading cuts this rank's shard again, for the same or another number of ranks. Given its objects
    at construction and the state at each call, the checkpointer's inputs are its arguments,
    not attributes of a class it is mixed into.

How Hugging Face differs
    ``Trainer._save_checkpoint`` saves the model, ``optimizer.pt``, ``scheduler.pt``,
    ``trainer_state.json`` (its ``TrainerState``, see ``trainer_state.py``) and
    ``rng_state_<rank>.pth``; ``_load_from_checkpoint`` and ``_load_rng_state`` restore them, as
    methods of the ``Trainer``. It saves no setup to compare, no bucket layout, and no comm hook state.
    Under DeepSpeed each rank saves its own shard (``zero_pp_rank_<r>_..._optim_states.pt``); another
    number of ranks loads them after a conversion (its Universal Checkpoint, ``ds_to_universal.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .checkpoint_format import CorruptCheckpointError, load_checkpoint_on_every_rank, load_states, save_checkpoint
from .checkpoint_timeline import checkpoints, set_aside_later_results
from .every_rank import on_every_rank
from .resume import apply_new_schedule, check_position, compare_setups, position_in_new_units, set_rng_state
from .trainer_state import TrainerState

RUN = ("setup", "layout")  # in trainer_state.pt beside the state's fields: what a resume checks and rebuilds


class Checkpointer:
    """Saving and resuming, for ``Trainer``: built with the objects it saves and loads, given the state per call."""

    def __init__(self, *, args, rank: int, model, ddp, optimizer, scheduler, scaler, comm_hook, setup: dict,
                 windows_per_epoch: int, max_steps: int):
        self.args = args  # reads output_dir, save_total_limit, resume_allow_changes, learning_rate, weight_decay
        self.rank = rank
        self.model, self.ddp = model, ddp  # the unwrapped model's weights; DDP's bucket layout
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler  # scaler: None unless fp16
        self.comm_hook = comm_hook  # (state, hook) or None: PowerSGD's state has memories per rank
        self.setup = setup  # resume.setup_of: what a resumed run must share with the saved one
        self.windows_per_epoch = windows_per_epoch  # a changed batch geometry may move the window past the end
        self.max_steps = max_steps  # a checkpoint past it is refused

    # --8<-- [start:save]
    def save(self, state: TrainerState, pending_loss) -> Path:
        """Every rank calls this: ``output_dir/checkpoint-<global_step>/``, complete once it returns."""
        trainer_state = {**state.to_dict(), "setup": self.setup,
                         "layout": self.ddp.layout_state()}  # the bucket layout: sums in the same order
        # every rank builds them: under ZeRO, optimizer.state_dict() is a collective that gathers each rank's shard
        # of the state into torch.optim's whole format (rank 0 writes it; any world size can load it)
        states = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "trainer_state": trainer_state}
        if self.scaler:
            states["scaler"] = self.scaler.state_dict()
        # each rank's unreported loss travels in its own file: no all-reduce here, so a save does not
        # change how the losses are summed, and train_loss is the same with or without interruptions
        return save_checkpoint(self.args.output_dir, state.global_step, states, self.rank, self.args.save_total_limit,
                               rank_state={"pending_loss": pending_loss.cpu(), "comm_hook": self._hook_state()})
    # --8<-- [end:save]

    def _hook_state(self):
        """PowerSGD's memories differ per rank: they go to ``rank_<r>.pt``. Other hooks keep nothing."""
        state = self.comm_hook[0] if self.comm_hook else None
        return state.state_dict() if hasattr(state, "state_dict") else None

    def _find(self, where) -> str | None:
        """``where``, or for ``latest`` the newest complete checkpoint (None, said once, when there is none)."""
        if where != "latest":
            return where
        found = checkpoints(self.args.output_dir)
        if not found:
            if self.rank == 0:
                print(f"resume_from_checkpoint='latest': {self.args.output_dir} has no complete checkpoint; "
                      "starting from scratch", file=sys.stderr, flush=True)
            return None
        return found[-1]

    # --8<-- [start:resume]
    def resume(self, where, pending_loss) -> TrainerState | None:
        """Load ``where`` into the objects and this rank's ``pending_loss``; return the saved state (None: nothing
        to resume from)."""
        path = self._find(where)
        if path is None:
            return None
        loaded = load_checkpoint_on_every_rank(path, self.rank, latest=where == "latest")
        saved = dict(loaded["trainer_state"])
        try:  # the same file on every rank: every rank raises the same error
            saved_setup, layout = (saved.pop(name) for name in RUN)
            state = TrainerState.from_dict(saved)
        except (KeyError, ValueError) as err:
            raise CorruptCheckpointError(f"{path}/trainer_state.pt is not a whole trainer state ({err}); resume from "
                                         "another checkpoint-<step> directory") from None
        notice = compare_setups(saved_setup, self.setup, self.args.resume_allow_changes, path)  # or raise
        check_position(state.global_step, self.max_steps, path)
        load_states(path, (self.model, loaded["model"]), (self.optimizer, loaded["optimizer"]),
                    (self.scheduler, loaded["scheduler"]))
        self._set_aside_later_results(path)
        if self.scaler and "scaler" in loaded:
            self.scaler.load_state_dict(loaded["scaler"])
        self.ddp.load_layout_state(layout)
        if "rank_state" in loaded:  # absent for a rank beyond the saved world size (resume_allow_changes)
            self._load_rank_state(loaded["rank_state"], pending_loss)
        if notice:
            if self.rank == 0:
                print(f"miniddp: {notice}", file=sys.stderr, flush=True)
            apply_new_schedule(self.optimizer, self.scheduler, self.args.learning_rate, self.args.weight_decay)
            state.window = position_in_new_units(saved_setup, self.setup, state.window)
            if state.window >= self.windows_per_epoch:
                state.epoch, state.window = state.epoch + 1, 0
        return state
    # --8<-- [end:resume]

    def _set_aside_later_results(self, path) -> None:
        aside = on_every_rank((lambda: set_aside_later_results(self.args.output_dir, path)) if self.rank == 0
                              else None, "setting aside the results after the resumed checkpoint")
        if aside is not None:  # resumed an earlier checkpoint: what came after it is another timeline
            print(f"miniddp: resuming {path}: the checkpoints and results saved after it are another timeline; "
                  f"moved to {aside} (nothing was deleted)", file=sys.stderr, flush=True)

    def _load_rank_state(self, rank_state: dict, pending_loss) -> None:
        """This rank's random streams, its unreported loss (into ``pending_loss``) and its comm hook's state."""
        set_rng_state(rank_state["rng"])
        pending_loss.copy_(rank_state["pending_loss"])
        hook_state = rank_state.get("comm_hook")
        target = self.comm_hook[0] if self.comm_hook else None  # the hook's state, if it has one to load
        if hook_state is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(hook_state)
