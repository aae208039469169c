"""What a Trainer reports, and where: the logged loss, the progress bar, evaluation, the results.

What
    ``TrainerReporting`` is the part of ``Trainer`` that reports. Before the first step, rank 0
    claims ``output_dir`` (``output_dir.claim_output_dir``). Every ``logging_steps``, ``_log``
    all-reduces the window losses summed on the device so far (one all-reduce, one host sync) and
    appends their mean over ranks and steps to ``log_history``. At the end, ``_finish`` evaluates
    and writes ``final_model.pt`` and ``metrics.json`` (strict JSON), each atomically, on rank 0,
    and returns the metrics on every rank.

Why
    Reading the loss after every micro-batch (``loss.item()``) would make the host wait for each
    forward on a GPU; summing on the device and syncing once per log keeps the loop asynchronous.
    The logged loss is the mean over *all* ranks, not rank 0's share of the data.

How Hugging Face differs
    ``Trainer._maybe_log_save_evaluate`` logs the loss the same way (accumulated on the device,
    ``_nested_gather``ed across ranks at each log); ``train_loss`` is the mean over all steps, as
    here. It writes ``trainer_state.json`` and the model via ``save_model``; ``metrics.json`` with
    the config is ours, the file the CLI contract names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from ..process_group.stalled_ranks import naming_stalled_ranks
from .batches import evaluate
from .every_rank import on_every_rank
from .nonfinite import finite_or_null
from .output_dir import atomic_save, atomic_write_text, bytes_to_save, claim_output_dir


class TrainerReporting:
    """Logging, evaluation and results, for ``Trainer``. Uses its ``args``, ``rank``, ``world_size``, ``env``,
    ``device``, ``model``, ``plan``, ``scheduler``, ``scaler``, ``state``, ``pending_loss``, ``log_history``,
    ``max_steps``, the ``Trainer``'s keywords (``eval_dataset``, ``data_collator``, ``compute_loss_func``,
    ``compute_metrics``), and sets ``lock``."""

    def _claim_output_dir(self, where) -> None:
        """Rank 0 locks output_dir and checks it (see output_dir.py); its error is every rank's."""
        out = Path(self.args.output_dir).resolve()
        resuming = where == "latest" or (where is not None and out in Path(where).resolve().parents)
        need = bytes_to_save(self.model, optimizer_copies=2, checkpoints=self.args.save_steps > 0)

        def claim():  # report_to's TensorBoard directory too: unwritable, it would fail at the first log
            return claim_output_dir(out, resuming=resuming, overwrite=self.args.overwrite_output_dir, need_bytes=need,
                                    logging_dir=self.reporter.logging_dir)
        self.lock = on_every_rank(claim if self.rank == 0 else None, "claiming output_dir")

    def _log(self, progress) -> None:
        """One ``log_history`` entry: the loss averaged over ranks and over the steps since the last one."""
        self._flush_loss()
        state, step = self.state, self.state["global_step"]
        loss = (state["loss_sum"] - state["logged_loss"]) / (step - state["logged_step"])  # mean since last log
        state.update(logged_step=step, logged_loss=state["loss_sum"])
        self.log_history.append({"step": step, "loss": loss, "lr": self.scheduler.get_last_lr()[0]})
        self.reporter.log(self.log_history[-1], step)  # report_to.py: TensorBoard on rank 0, or nothing
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.4f}")

    def _flush_loss(self) -> None:
        """Move the pending window losses, averaged over ranks, into state (one all-reduce, one host sync)."""
        with naming_stalled_ranks(f"loss all-reduce after step {self.state['global_step']}"):
            dist.all_reduce(self.pending_loss)
        self.state["loss_sum"] += self.pending_loss.item() / self.world_size
        self.pending_loss.zero_()

    def _progress_bar(self):
        if self.rank != 0 or self.args.disable_tqdm:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=self.state["global_step"], desc="train", unit="step")

    def evaluate(self) -> dict:
        """``eval_loss`` and ``compute_metrics``' results (prefixed ``eval_``) over all of eval_dataset."""
        return evaluate(self.model, self.eval_dataset, device=self.device,
                        batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator,
                        compute_loss_func=self.compute_loss_func, compute_metrics=self.compute_metrics)

    def _finish(self) -> dict:
        args = self.args
        metrics = {"world_size": self.world_size, "backend": self.env.backend,
                   "effective_batch_size": self.plan.samples_per_step,  # what a step trained on
                   "global_step": self.state["global_step"],
                   "train_loss": self.state["loss_sum"] / max(1, self.state["global_step"]),
                   **({"fp16_skipped_steps": self.state["skipped_steps"]} if self.scaler else {}),
                   **self.evaluate(), "log_history": self.log_history}
        self.reporter.log({k: v for k, v in metrics.items() if k == "train_loss" or k.startswith("eval_")},
                          self.state["global_step"])

        def write():  # each atomically: a crash or a full disk leaves the previous version whole
            out = Path(args.output_dir)
            atomic_save(self.model.state_dict(), out / "final_model.pt")
            strict = json.dumps(finite_or_null({**metrics, "config": args.to_dict()}), indent=2, allow_nan=False)
            atomic_write_text(out / "metrics.json", strict + "\n")
        on_every_rank(write if self.rank == 0 else None, "writing final_model.pt and metrics.json")
        return metrics
