"""What a Trainer reports, and where: the logged loss, the progress bar, evaluation, the results.

What
    ``ProgressReporter`` reports for a ``Trainer``, which builds it with what it reports on (the
    model, the scheduler's learning rate, the epoch plan's batch, an ``evaluate`` callable) and hands
    it the ``TrainerState`` at each call. Before the first step, rank 0 claims ``output_dir``
    (``output_dir.claim_output_dir``). Every ``logging_steps``, ``log`` all-reduces the window
    losses summed on the device so far (one all-reduce, one host sync), adds their mean over ranks
    to ``state.loss_sum`` and appends the mean since the last log to ``state.log_history``. At the
    end, ``finish`` evaluates and writes ``final_model.pt`` and ``metrics.json`` (strict JSON), each
    atomically, on rank 0, and returns the metrics on every rank.

Why
    Reading the loss after every micro-batch (``loss.item()``) would make the host wait for each
    forward on a GPU; summing on the device and syncing once per log keeps the loop asynchronous.
    The logged loss is the mean over *all* ranks, not rank 0's share of the data. What it reads
    and changes is in its arguments: nothing reaches into the trainer.

How Hugging Face differs
    ``Trainer._maybe_log_save_evaluate`` logs the loss the same way (accumulated on the device,
    ``_nested_gather``ed across ranks at each log), as a method of the ``Trainer`` that calls its
    callbacks; ``train_loss`` is the mean over the steps of this ``train()`` call (after a resume,
    only the steps since), here over all steps of the run. It writes ``trainer_state.json`` and the
    model via ``save_model``; ``metrics.json`` with the config is ours, the file the CLI contract names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from ..process_group.stalled_ranks import naming_stalled_ranks
from .every_rank import on_every_rank
from .nonfinite import finite_or_null
from .output_dir import atomic_save, atomic_write_text, bytes_to_save, claim_output_dir
from .report_to import Reporter
from .trainer_state import TrainerState


class ProgressReporter:
    """Logging, evaluation and results, for ``Trainer``: built with what it reports on, given the state per call."""

    def __init__(self, *, args, rank: int, world_size: int, backend: str, model, scheduler, fp16: bool,
                 samples_per_step: int, max_steps: int, evaluate, fsdp_units=None):
        self.args = args  # reads output_dir, overwrite_output_dir, save_steps, disable_tqdm, report_to; metrics.json
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.model = model  # the unwrapped model (FSDP: its full-state view, a collective): final_model.pt
        self.scheduler = scheduler  # the learning rate of each log
        self.fp16 = fp16  # a GradScaler runs: metrics.json counts the steps it skipped
        self.samples_per_step = samples_per_step  # epoch.EpochPlan's: what a step trained on
        self.max_steps = max_steps
        self.evaluate = evaluate  # () -> eval_loss and compute_metrics' results, on every rank
        self.fsdp_units = fsdp_units  # under FSDP, each unit's module name (the root last): metrics.json says them
        self.report_to = Reporter(args.report_to, args.output_dir, rank)  # report_to: where logs also go

    def claim_output_dir(self, where):
        """Rank 0 locks output_dir and checks it (see output_dir.py); its error is every rank's. Returns the lock."""
        out = Path(self.args.output_dir).resolve()
        resuming = where == "latest" or (where is not None and out in Path(where).resolve().parents)
        need = bytes_to_save(self.model, optimizer_copies=2, checkpoints=self.args.save_steps > 0)

        def claim():  # report_to's TensorBoard directory too: unwritable, it would fail at the first log
            return claim_output_dir(out, resuming=resuming, overwrite=self.args.overwrite_output_dir, need_bytes=need,
                                    logging_dir=self.report_to.logging_dir)
        return on_every_rank(claim if self.rank == 0 else None, "claiming output_dir")

    # --8<-- [start:log]
    def log(self, state: TrainerState, pending_loss, progress) -> None:
        """One ``log_history`` entry: the loss averaged over ranks and over the steps since the last one."""
        self._flush_loss(state, pending_loss)
        step = state.global_step
        loss = (state.loss_sum - state.logged_loss) / (step - state.logged_step)  # mean since the last log
        state.logged_step, state.logged_loss = step, state.loss_sum
        state.log_history.append({"step": step, "loss": loss, "lr": self.scheduler.get_last_lr()[0]})
        self.report_to.log(state.log_history[-1], step)  # report_to.py: TensorBoard on rank 0, or nothing
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}")

    def _flush_loss(self, state: TrainerState, pending_loss) -> None:
        """Move the pending window losses, averaged over ranks, into state (one all-reduce, one host sync)."""
        with naming_stalled_ranks(f"loss all-reduce after step {state.global_step}"):
            dist.all_reduce(pending_loss)
        state.loss_sum += pending_loss.item() / self.world_size
        pending_loss.zero_()
    # --8<-- [end:log]

    def progress_bar(self, state: TrainerState):
        if self.rank != 0 or self.args.disable_tqdm:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=state.global_step, desc="train", unit="step")

    def finish(self, state: TrainerState) -> dict:
        """Evaluate, write ``final_model.pt`` and ``metrics.json`` on rank 0; the metrics on every rank."""
        args = self.args
        metrics = {"world_size": self.world_size, "backend": self.backend,
                   "effective_batch_size": self.samples_per_step,  # what a step trained on
                   "global_step": state.global_step,
                   "zero_stage": args.zero_stage,  # 0: DDP; 1, 2: miniddp's ZeRO; 3: fully_shard (the deepspeed config)
                   **({"fsdp_units": self.fsdp_units,
                       "reshard_after_forward": args.fsdp_settings.reshard_after_forward} if self.fsdp_units else {}),
                   "train_loss": state.loss_sum / max(1, state.global_step),
                   **({"fp16_skipped_steps": state.skipped_steps} if self.fp16 else {}),
                   **self.evaluate(), "log_history": state.log_history}
        self.report_to.log({k: v for k, v in metrics.items() if k == "train_loss" or k.startswith("eval_")},
                           state.global_step)

        weights = self.model.state_dict()  # on every rank: under FSDP the gather is a collective

        def write():  # each atomically: a crash or a full disk leaves the previous version whole
            out = Path(args.output_dir)
            atomic_save(weights, out / "final_model.pt")
            strict = json.dumps(finite_or_null({**metrics, "config": args.to_dict()}), indent=2, allow_nan=False)
            atomic_write_text(out / "metrics.json", strict + "\n")
        on_every_rank(write if self.rank == 0 else None, "writing final_model.pt and metrics.json")
        return metrics

    def close(self) -> None:
        self.report_to.close()
